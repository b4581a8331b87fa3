"""Every exercise of the book has a check, the book's answers pass it, and no message gives it away.

The pages are read as text: each numbered question of a chapter's ``## Exercises`` section has a
visible ``check(k, answer_k)`` cell and a hidden answer that ends in ``assert check(k, ...).right``
(the notebooks run those against the page's own computation). Here each checker is built on a
small stand-in for its page's context, and right answers, typical wrong ones (with the hint they
must get) and the empty answer go through it.
"""

import json
import math
import pathlib
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import benchmark, exercises, memory
from jaxdist_lessons.exercises import ch08_multi_host, checking
from jaxdist_lessons.tables import human_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = sorted(
    p for p in (ROOT / "book").glob("*.md") if "\n## Exercises" in p.read_text()
)
# Chapters whose exercises have no checks yet (none: every chapter is converted).
PENDING: set[str] = set()


def exercises_section(path: pathlib.Path) -> str:
    text = path.read_text()
    section = text[text.index("\n## Exercises") + 1 :]
    end = re.search(r"\n## ", section[3:])
    return section if end is None else section[: end.start() + 3]


def questions(section: str) -> list[int]:
    """The numbers of the numbered questions before the first code cell."""
    prose = section.split("```{code-cell}")[0]
    return [int(m) for m in re.findall(r"^(\d+)\. ", prose, re.M)]


def test_chapters_found():
    assert len(CHAPTERS) >= 14
    assert set(CHAPTERS_CONTEXT) | PENDING == {p.stem for p in CHAPTERS}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_exercise_has_a_check(path):
    if path.stem in PENDING:
        pytest.skip("exercises not converted yet")
    section = exercises_section(path)
    numbers = questions(section)
    assert numbers == list(range(1, len(numbers) + 1)) and numbers
    assert re.search(rf'exercises\.checker\(\s*"{path.stem}"', section)
    visible = [
        int(k) for k, a in re.findall(r"^check\((\d+), answer_(\d+)\)$", section, re.M)
    ]
    assert visible == numbers
    for k in numbers:  # the hidden answer runs through the same check
        assert re.search(
            rf"check\(\s*{k},", section.split(f"check({k}, answer_{k})")[1]
        )
    hidden = re.findall(r"assert check\(\s*(\d+),", section) + re.findall(
        r"and check\((\d+),", section
    )
    assert sorted({int(k) for k in hidden}) == numbers
    assert path.stem in exercises.CHAPTERS
    assert sorted(checker_for(path.stem).exercises) == numbers


# --- Stand-ins for each page's context ----------------------------------------------------------


class State(NamedTuple):
    params: Any
    opt_state: Any


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


def _ch03():
    variables = {
        "Conv_0": {"kernel": jnp.zeros((3, 3, 64, 64))},
        "BatchNorm_0": {"scale": jnp.zeros(64), "bias": jnp.zeros(64)},
    }
    rules = [(r"kernel$", P(None, None, None, "model")), (r"(scale|bias)$", P("model"))]
    return {"mesh": _mesh(), "variables": variables, "rules": rules}


def _ch06():
    mesh = jax.make_mesh((8,), ("data",))
    mlp = benchmark.mlp_workload(8, width=32 * 8)
    gpt = benchmark.transformer_workload(8, hidden=64)
    return {"n": 8, "mesh": mesh, "tx": optax.adam(1e-3), "mlp": mlp, "gpt": gpt}


def _ch09():
    from jaxdist_lessons.models import vit

    model = vit.ViT(
        num_classes=10, patch_size=4, hidden=64, num_layers=2, num_heads=8, mlp_dim=256
    )
    return {
        "abstract": jax.eval_shape(
            model.init, jax.random.key(0), jnp.ones((1, 16, 16, 3))
        )
    }


def _ch10():
    from jaxdist_lm import model_config as lm_config

    scale = json.loads((ROOT / "book" / "data" / "lm_scale.json").read_text())
    return {"rows": scale["rows"], "lm_config": lm_config}


CHAPTERS_CONTEXT = {
    "01_why_distribute": dict,
    "02_device_mesh": lambda: {"mesh": _mesh()},
    "03_sharding": _ch03,
    "04_gradients": lambda: {"n": 8, "in_features": 192},
    "05_resnet50": lambda: {
        "n": 8,
        "state": State(
            {"w": jnp.zeros((100, 10))}, {"m": jnp.zeros((100, 10)), "c": jnp.zeros(3)}
        ),
    },
    "06_performance": _ch06,
    "07_troubleshooting": lambda: {
        "n": 8,
        "mesh": jax.make_mesh((8,), ("data",)),
        "params_7b": memory.transformer_params(
            num_layers=32, hidden=4096, vocab_size=50257, seq_len=2048
        ),
    },
    "08_multi_host": lambda: {
        "n": 8,
        "links": {"ICI (inside a slice)": 1200e9 / 2, "DCN (between slices)": 50e9 / 8},
    },
    "09_flax_partitioning": _ch09,
    "10_language_model": _ch10,
    "11_pipelines_mesh_shape": dict,
    "12_long_sequences": dict,
    "13_experts": dict,
    "appendix_seed_errata": dict,
}

_CACHE: dict[str, exercises.Checker] = {}


def checker_for(chapter: str) -> exercises.Checker:
    if chapter not in _CACHE:
        _CACHE[chapter] = exercises.checker(chapter, **CHAPTERS_CONTEXT[chapter]())
    return _CACHE[chapter]


def right_answer(ex: exercises.Exercise) -> Any:
    if ex.kind == "tuple":
        return tuple(right_answer(p) for p in ex.parts)
    if ex.kind == "dict":
        return {k: right_answer(v) for k, v in ex.expected.items()}
    if ex.kind == "callable":
        return None  # the pages pass their own
    return ex.expected


def leaves(ex: exercises.Exercise) -> list[Any]:
    if ex.kind == "tuple":
        return [x for p in ex.parts for x in leaves(p)]
    if ex.kind == "dict":
        return [x for v in ex.expected.values() for x in leaves(v)]
    return [] if ex.kind == "callable" else [ex.expected]


def giveaways(value: Any) -> list[str]:
    """Patterns that would give ``value`` away in a message."""
    if isinstance(value, str):
        return [rf"\b{re.escape(value.lower())}\b"]
    if isinstance(value, (tuple, list, frozenset, set)):
        if value and all(isinstance(v, str) for v in value):
            return [rf"\b{re.escape(v.lower())}\b" for v in value]
        return [re.escape(exercises.normalise(value))] if value else []
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return [re.escape(exercises.normalise(value))]
    x = float(value)
    forms = {f"{x:.3g}", f"{x:,.0f}", f"{x:.0f}", f"{x:.2f}"}
    if x >= 1000:
        forms |= {
            human_bytes(x),
            human_bytes(x, binary=True),
            f"{x / 1e6:.1f}",
            f"{x / 1e9:.1f}",
        }
    if 0 < x < 1:
        forms |= {f"{x:.1%}", f"{x:.0%}", f"1/{1 / x:.0f}"}
    return [
        rf"(?<![\d.,]){re.escape(f)}(?![\d])" for f in forms if f not in ("0", "0.00")
    ]


def assert_gives_nothing_away(ex: exercises.Exercise, message: str) -> None:
    text = re.sub(r"\(part \d+ of \d+\)", "", message).lower()
    for value in leaves(ex):
        for pattern in giveaways(value):
            assert not re.search(pattern, text), (pattern, message)


def all_exercises():
    for chapter in CHAPTERS_CONTEXT:
        for k in range(1, 4):
            yield chapter, k


def _exercise(chapter, k):
    check = checker_for(chapter)
    if k not in check.exercises:
        pytest.skip(f"{chapter} has {len(check.exercises)} exercises")
    return check, check.exercises[k]


@pytest.mark.parametrize("chapter,k", list(all_exercises()))
def test_right_empty_and_generic_wrong_answers(chapter, k):
    check, ex = _exercise(chapter, k)
    empty = check(k, None)
    assert not empty.right and empty.message.startswith("Expected")
    answer = right_answer(ex)
    if answer is not None:
        verdict = check(k, answer)
        assert verdict.right and verdict.message.startswith("Right: "), verdict
        # shown within the page's column, the words unchanged
        assert repr(verdict).split() == verdict.message.split()
        assert max(map(len, repr(verdict).splitlines())) <= 88
    messages = [empty.message]
    if ex.kind == "number":  # generic: too high, too low, and how far, never the value
        for scale, words in [(3, "too high"), (1 / 3, "too low"), (1.05, "close")]:
            verdict = check(k, ex.expected * scale)
            assert not verdict.right and verdict.message.startswith("Not yet: ")
            messages.append(verdict.message)
            if not ex.hints:
                assert words in verdict.message
    if ex.kind == "tuple":  # a wrong part says which
        parts = list(answer)
        parts[-1] = "certainly wrong" if not isinstance(parts[-1], (int, float)) else -1
        verdict = check(k, tuple(parts))
        assert f"part {len(parts)} of {len(parts)}" in verdict.message
        messages.append(verdict.message)
    for message in messages[1:] if ex.kind in ("name", "tuple") else messages:
        assert_gives_nothing_away(ex, message)  # "Expected:" may list the choices


def _parts(chapter, k):
    return [p.expected for p in checker_for(chapter).exercises[k].parts]


# (chapter, exercise, a typical wrong answer (from the right parts), a phrase of its hint)
TYPICAL = [
    ("01_why_distribute", 1, lambda e, c: 2, "weights only"),
    ("01_why_distribute", 2, lambda e, c: (7e9 * 16 / 8, 1), "FSDP's share"),
    ("01_why_distribute", 2, lambda e, c: (_parts(*c)[0] / 1e9, 1), "not gigabytes"),
    (
        "01_why_distribute",
        2,
        lambda e, c: (_parts(*c)[0], 7e9 * 8),
        "whole optimizer state",
    ),
    (
        "01_why_distribute",
        3,
        lambda e, c: "no" if e.expected == "yes" else "yes",
        "activations",
    ),
    (
        "02_device_mesh",
        1,
        lambda e, c: {
            "data": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "tensor": [[0, 2, 4, 6], [1, 3, 5, 7]],
        },
        "swapped",
    ),
    (
        "02_device_mesh",
        2,
        lambda e, c: [[0, 1], [2, 3], [4, 5], [6, 7]],
        "different columns",
    ),
    ("02_device_mesh", 3, lambda e, c: jax.make_mesh((4,), ("data",)), "odd-numbered"),
    ("03_sharding", 1, lambda e, c: (P("tensor", None), (512, 4096)), "input features"),
    ("03_sharding", 1, lambda e, c: ("P(None, 'model')", (1024, 4096)), "whole kernel"),
    ("03_sharding", 2, lambda e, c: (_parts(*c)[0] * 2, 1), "not 4"),
    ("03_sharding", 2, lambda e, c: (5040 * 5040 * 2, 1), "whole array"),
    ("03_sharding", 2, lambda e, c: (_parts(*c)[0], _parts(*c)[0]), "tensor axis only"),
    (
        "03_sharding",
        3,
        lambda e, c: 3 * 3 * 64 * 64 * 2 + 512,
        "what each device holds",
    ),
    ("04_gradients", 1, lambda e, c: e.expected - 4, "one more float32"),
    ("04_gradients", 1, lambda e, c: (e.expected - 4) / 4, "not parameters"),
    ("04_gradients", 2, lambda e, c: 8, "pmean trap"),
    ("04_gradients", 3, lambda e, c: e.expected / 2, "one half of the ring"),
    ("04_gradients", 3, lambda e, c: e.expected * 8, "bits"),
    ("04_gradients", 3, lambda e, c: 25_557_032 * 4, "whole gradient"),
    ("05_resnet50", 1, lambda e, c: memory.resnet_params(num_classes=10), "full-width"),
    ("05_resnet50", 2, lambda e, c: "proj_conv", "reads the image"),
    ("05_resnet50", 3, lambda e, c: 4000, "parameters only"),
    ("05_resnet50", 3, lambda e, c: e.expected / 8, "splits nothing"),
    (
        "06_performance",
        2,
        lambda e, c: (_parts(*c)[0] / 8, _parts(*c)[1]),
        "once per micro",
    ),
    ("06_performance", 2, lambda e, c: (_parts(*c)[0], _parts(*c)[1] * 8), "locally"),
    ("06_performance", 3, lambda e, c: 1 / 3, "decoder's dimensions"),
    ("07_troubleshooting", 1, lambda e, c: ("batch", 8), "pmap bound"),
    ("06_performance", 3, lambda e, c: 1 / 3, "decoder's dimensions"),
    ("07_troubleshooting", 1, lambda e, c: ("data", 1), "trap"),
    ("07_troubleshooting", 2, lambda e, c: 3, "not a v5e slice"),
    ("07_troubleshooting", 3, lambda e, c: 1, "another shape"),
    ("07_troubleshooting", 3, lambda e, c: 4, "reuse"),
    ("08_multi_host", 1, lambda e, c: "no", "same rows"),
    (
        "08_multi_host",
        2,
        lambda e, c: ch08_multi_host._demo_all_reduce_bytes(8)[1],
        "gradients alone",
    ),
    ("08_multi_host", 3, lambda e, c: (_parts(*c)[0] / 2, 1, 1), "2 (N-1)/N"),
    ("08_multi_host", 3, lambda e, c: (_parts(*c)[0] * 1e3, 1, 1), "milliseconds"),
    ("08_multi_host", 3, lambda e, c: (*_parts(*c)[:2], 100e6 * 96), "slower link"),
    (
        "09_flax_partitioning",
        1,
        lambda e, c: "P(('data', 'tensor'), 'data')",
        "only one",
    ),
    ("10_language_model", 1, lambda e, c: (["1b", "8b", "70b"], ["1b"]), "more memory"),
    ("10_language_model", 2, lambda e, c: 1, "resumes"),
    ("10_language_model", 3, lambda e, c: e.expected * 16, "16"),
    ("11_pipelines_mesh_shape", 1, lambda e, c: 30, "not (S-1)/M"),
    ("11_pipelines_mesh_shape", 2, lambda e, c: (_parts(*c)[0], "down"), "compute"),
    ("12_long_sequences", 1, lambda e, c: 15, "invert"),
    ("12_long_sequences", 2, lambda e, c: 32, "K and V"),
    (
        "12_long_sequences",
        3,
        lambda e, c: {k: 2 * v.expected for k, v in e.expected.items()},
        "not 4",
    ),
    ("13_experts", 1, lambda e, c: (80, 1), "k experts"),
    ("13_experts", 1, lambda e, c: (_parts(*c)[0], 2 * _parts(*c)[1]), "not 4"),
    ("13_experts", 2, lambda e, c: "forward dispatch", "forward pass"),
    ("appendix_seed_errata", 1, lambda e, c: ("ValueError", 5), "traceback"),
    ("appendix_seed_errata", 2, lambda e, c: (1, 1), "loop body"),
    ("appendix_seed_errata", 3, lambda e, c: lambda: 1 / 0, "ZeroDivisionError"),
]


@pytest.mark.parametrize("chapter,k,wrong,phrase", TYPICAL)
def test_typical_wrong_answers_get_their_hint(chapter, k, wrong, phrase):
    check, ex = _exercise(chapter, k)
    verdict = check(k, wrong(ex, (chapter, k)))
    assert not verdict.right and verdict.message.startswith("Not yet"), verdict
    assert phrase in verdict.message, verdict
    assert_gives_nothing_away(ex, verdict.message)


def test_every_hint_is_reached_or_listed():
    """Each exercise has at least one typical wrong answer tested above, or only generic hints."""
    tested = {(c, k) for c, k, *_ in TYPICAL}
    for chapter in CHAPTERS_CONTEXT:
        for k, ex in checker_for(chapter).exercises.items():
            hinted = ex.hints or any(p.hints for p in ex.parts)
            if hinted:
                assert (chapter, k) in tested, (chapter, k)


def test_answers_in_other_forms():
    check = checker_for("01_why_distribute")
    held, saved = (p.expected for p in check.exercises[2].parts)
    assert check(2, (f"{held / 1e9:g} GB", f"{saved / 2**30:.4f} GiB")).right
    # True / False for yes / no
    assert check(3, check.exercises[3].expected == "yes").right
    sharded = checker_for("03_sharding")
    block = sharded.exercises[1].parts[1].expected
    assert sharded(1, ("P(None, 'tensor')", list(block))).right
    assert sharded(1, (P(None, "model"), block)).right  # the axis's old name
    assert checker_for("12_long_sequences")(1, "0.0667").right
    assert not checker_for("04_gradients")(3, "lots").right
    assert math.isclose(checking._number("1.5 ms", "seconds"), 1.5e-3)


def test_unknown_chapter_and_number():
    with pytest.raises(ValueError, match="no exercises"):
        exercises.checker("99_nothing")
    with pytest.raises(ValueError, match="has exercises"):
        checker_for("13_experts")(7, 1)


def test_ch05_block_bytes_are_what_device_0_holds():
    """Chapter 5's second answer sizes device 0's blocks from shardings alone."""
    from jax.sharding import AxisType, NamedSharding

    from jaxdist_lessons import sharding
    from jaxdist_lessons.exercises import ch05_resnet50

    mesh = jax.make_mesh(
        (jax.device_count() // 2, 2),
        ("data", "tensor"),
        axis_types=(AxisType.Auto,) * 2,
    )
    tree = {
        "kernel": jnp.zeros((3, 3, 8, 16)),
        "bias": jnp.zeros(16),
        "step": jnp.zeros(3),
    }
    specs = {"kernel": P(None, None, None, "tensor"), "bias": P("tensor"), "step": P()}
    shardings = {key: NamedSharding(mesh, spec) for key, spec in specs.items()}
    held = sharding.bytes_per_device(jax.device_put(tree, shardings))
    expected = (3 * 3 * 8 * 8 + 8 + 3) * 4
    assert (
        ch05_resnet50.block_bytes(tree, shardings)
        == held[jax.devices()[0].id]
        == expected
    )
