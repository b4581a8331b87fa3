"""Exercises a reader can check: ``check(number, answer)`` says right or wrong, and why.

Each chapter's Exercises section makes a checker, then the reader fills in an answer::

    check = exercises.checker("04_gradients", n=n, in_features=192)
    answer_3 = None  # bytes each device sends
    check(3, answer_3)  # -> "Expected: ..." ; "Not yet: ..." ; "Right: ..."

The expected values come from the package's own formulas (``comms``, ``memory``, ``costmodel``,
...) or from what the page passes to ``checker`` (its mesh, its device count, its model), never
from a printed number, so the visible cells do not give the answers away. A wrong answer gets
the hint whose condition matches it (off by the factor 2 of a ring all-reduce, bits for bytes,
per device for total, ...) or a generic one (too high or too low, and by roughly how much); no
message contains the expected value. The hidden answer cells end with
``assert check(n, value).right``, so CI runs the book's own answers through the same check.

Answers may be numbers (or strings such as ``"63 GB"`` or ``"1.5 ms"``), names and choices
(``"psum"``, ``"yes"``), partition specs (``P(None, 'tensor')`` or its text), device groups,
dicts of those, or tuples of them for a question with several parts. Messages are English, like
the rest of the book's printed output (the Chinese edition translates prose, not outputs).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Exercise", "Hint", "Verdict", "Checker", "checker", "CHAPTERS", "normalise"]

# The tensor-parallel mesh axis was once called ``model``: either name is the same answer.
_AXIS_SYNONYMS = {"model": "tensor"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one check: ``right`` and the message shown under the cell."""

    right: bool
    message: str

    def __bool__(self) -> bool:
        return self.right

    def __str__(self) -> str:
        return self.message

    __repr__ = __str__


@dataclasses.dataclass(frozen=True)
class Hint:
    """What to say (``says``) when a wrong answer matches ``when(answer, expected)``."""

    says: str
    when: Callable[[Any, Any], bool]


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One question: what kind of answer it wants, how to compare, and what to say.

    ``expected`` is the right answer (computed from the page's context); ``kind`` is one of
    ``number``, ``name``, ``names`` (a set of them), ``spec``, ``groups``, ``dict``, ``callable``
    or ``tuple`` (then
    ``parts`` holds one Exercise per part). ``why`` is the sentence a right answer gets.
    """

    asks: str
    expected: Any
    kind: str = "number"
    why: str = ""
    rel_tol: float = 0.02
    unit: str = ""
    hints: tuple[Hint, ...] = ()
    parts: tuple[Exercise, ...] = ()
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)


# --- Normalising answers ----------------------------------------------------------------------

_UNITS = {
    "bytes": {
        "b": 1,
        "byte": 1,
        "bytes": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    },
    "seconds": {
        "s": 1,
        "sec": 1,
        "second": 1,
        "seconds": 1,
        "ms": 1e-3,
        "us": 1e-6,
        "µs": 1e-6,
    },
}


def _number(answer: Any, unit: str = "") -> float | None:
    """``answer`` as a float (numbers, NumPy/JAX scalars, ``"63e9"``, ``"63 GB"``); else None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, str):
        match = re.fullmatch(
            r"\s*([-+]?[\d_,]*\.?\d+(?:[eE][-+]?\d+)?)\s*([a-zA-Zµ]*)\s*", answer
        )
        if not match:
            return None
        value = float(match.group(1).replace(",", "").replace("_", ""))
        suffix = match.group(2).lower()
        if not suffix:
            return value
        scale = _UNITS.get(unit, {}).get(suffix)
        return None if scale is None else value * scale
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def normalise(answer: Any) -> str:
    """A name, choice or spec as comparable text: lower case, no quotes, spaces or ``P(...)``."""
    if answer is True or answer is False:
        return "yes" if answer else "no"
    if isinstance(answer, list):
        answer = tuple(answer)
    text = str(answer).strip().lower()
    text = re.sub(r"^(jax\.)?(sharding\.)?(p|partitionspec)\((.*)\)$", r"\4", text)
    text = re.sub(r"[\"'`\s]", "", text)
    text = re.sub(r"(jax\.)?lax\.", "", text)
    for old, new in _AXIS_SYNONYMS.items():
        text = re.sub(rf"\b{old}\b", new, text)
    text = {"true": "yes", "y": "yes", "false": "no", "n": "no"}.get(text, text)
    while text.endswith(",none"):  # P(None, 'x', None) is P(None, 'x')
        text = text[: -len(",none")]
    return text.rstrip(",")


def _groups(answer: Any) -> frozenset[frozenset[int]] | None:
    try:
        return frozenset(frozenset(int(d) for d in group) for group in answer)
    except (TypeError, ValueError):
        return None


def _axis(name: Any) -> str:
    return normalise(name)


# --- Judging ----------------------------------------------------------------------------------


def _size_words(ratio: float) -> str:
    """How far off, in words that do not give the value away."""
    high = ratio > 1
    factor = ratio if high else 1 / ratio
    direction = "too high" if high else "too low"
    if factor < 1.1:
        return f"close, but a little {direction}"
    if factor < 2:
        return f"{direction}, by less than a factor of two"
    if factor < 10:
        return f"{direction}, by a factor between two and ten"
    return f"{direction}, by more than a factor of ten"


def _close(a: float, b: float, rel_tol: float) -> bool:
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-12)


def _judge(ex: Exercise, answer: Any) -> tuple[bool, str]:
    """(right, reason): the reason is a hint when wrong and empty when right."""
    for hint in ex.hints:
        try:
            matched = hint.when(answer, ex.expected)
        except Exception:  # a hint that cannot read this answer does not apply
            matched = False
        if matched and not _same(ex, answer):
            return False, hint.says
    if _same(ex, answer):
        return True, ""
    if ex.kind == "number":
        value = _number(answer, ex.unit)
        if value is None:
            return False, f"expected {ex.asks}"
        if ex.expected == 0:
            return False, "too high" if value > 0 else "too low"
        return False, _size_words(value / ex.expected) + "."
    if ex.kind == "dict":
        if not isinstance(answer, Mapping):
            return False, f"expected {ex.asks}"
        got = {_axis(k): v for k, v in answer.items()}
        for key, part in ex.expected.items():
            if _axis(key) not in got:
                return False, f"the answer has no entry for {key!r}."
            sub = dataclasses.replace(part, asks=ex.asks)
            right, reason = _judge(sub, got[_axis(key)])
            if not right:
                return False, f"for {key!r}: {reason}"
        return False, "the entries do not match."
    if ex.kind == "callable" and ex.expected is _runs and callable(answer):
        try:
            answer()
        except Exception as exc:
            return False, f"it raises {type(exc).__name__}: {str(exc)[:200]}"
    return False, "that is not it."


def _same(ex: Exercise, answer: Any) -> bool:
    if ex.kind == "number":
        value = _number(answer, ex.unit)
        return value is not None and _close(value, float(ex.expected), ex.rel_tol)
    if ex.kind in ("name", "spec"):
        got = normalise(answer)
        got = ex.aliases.get(got, got)
        return got == normalise(ex.expected)
    if ex.kind == "groups":
        return _groups(answer) == _groups(ex.expected)
    if ex.kind == "names":
        return _names(answer) == _names(ex.expected)
    if ex.kind == "dict":
        if not isinstance(answer, Mapping):
            return False
        got = {_axis(k): v for k, v in answer.items()}
        return all(
            _axis(k) in got and _same(part, got[_axis(k)])
            for k, part in ex.expected.items()
        )
    if ex.kind == "callable":
        try:
            return bool(callable(answer) and ex.expected(answer))
        except Exception:
            return False
    raise ValueError(f"unknown kind {ex.kind!r}")


def judge(ex: Exercise, answer: Any) -> Verdict:
    """The verdict on ``answer``: "Expected: ...", "Not yet: ..." or "Right: ..."."""
    if answer is None or (
        ex.kind == "tuple" and all(a is None for a in _as_tuple(answer))
    ):
        return Verdict(False, f"Expected: {ex.asks}.")
    if ex.kind == "tuple":
        parts = _as_tuple(answer)
        if len(parts) != len(ex.parts):
            return Verdict(False, f"Expected {len(ex.parts)} parts: {ex.asks}.")
        for i, (part, given) in enumerate(zip(ex.parts, parts), start=1):
            if given is None:
                return Verdict(False, f"Part {i}: expected {part.asks}.")
            right, reason = _judge(part, given)
            if not right:
                return Verdict(
                    False, f"Not yet (part {i} of {len(ex.parts)}): {reason}"
                )
        return Verdict(True, f"Right: {ex.why}")
    right, reason = _judge(ex, answer)
    return (
        Verdict(True, f"Right: {ex.why}")
        if right
        else Verdict(False, f"Not yet: {reason}")
    )


def _as_tuple(answer: Any) -> tuple:
    return tuple(answer) if isinstance(answer, (tuple, list)) else (answer,)


# --- Hint conditions --------------------------------------------------------------------------


def factor(f: float, says: str, rel_tol: float = 0.02) -> Hint:
    """A hint for an answer ``f`` times the expected value (2: ring factor, 8: bits, ...)."""
    return Hint(says, lambda a, e: _close(_number(a, "bytes") or 0.0, e * f, rel_tol))


def equals(value: Any, says: str, rel_tol: float = 0.02) -> Hint:
    """A hint for a particular wrong number."""
    return Hint(
        says, lambda a, e: _close(_number(a, "bytes") or math.nan, value, rel_tol)
    )


def named(names: Sequence[str], says: str) -> Hint:
    """A hint for particular wrong names, choices or specs."""
    wanted = {normalise(n) for n in names}
    return Hint(says, lambda a, e: normalise(a) in wanted)


BYTES_NOT_GB = (
    factor(1e-9, "give bytes, not gigabytes."),
    factor(1e-6, "give bytes, not megabytes."),
    factor(1 / 2**30, "give bytes, not GiB."),
    factor(1 / 2**20, "give bytes, not MiB."),
    factor(8, "that looks like bits: give bytes (8 bits each)."),
)


# --- The chapters -----------------------------------------------------------------------------


def _ch01(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import hardware, memory

    state_70b = memory.training_state_bytes(70e9, "adam", "mixed")
    h100 = "H100 80GB"
    adam_7b = memory.training_state_bytes(7e9, "adam", "fp32")
    zero1 = memory.per_device(adam_7b, "zero1", 8).total
    data = memory.per_device(adam_7b, "data", 8).total
    resnet_state = memory.training_state_bytes(memory.resnet_params(), "adam", "fp32")
    acts = memory.resnet_activation_bytes(1024, 224, "fp32")
    resnet = dataclasses.replace(resnet_state, activations=acts)
    share = memory.per_device(resnet, "data", 8)
    fits = share.total <= hardware.chip("A100 40GB").memory_bytes
    return {
        1: Exercise(
            asks="a number of H100 80GB devices (an integer)",
            expected=memory.devices_needed(state_70b.total, h100),
            rel_tol=0,
            why="about 16 bytes per parameter (bf16 weights and gradients, fp32 master weights "
            "and Adam's two moments), divided over the devices' memory and rounded up.",
            hints=(
                equals(
                    memory.devices_needed(memory.weights_bytes(70e9, "bf16"), h100),
                    "that holds the bf16 weights only: count the gradients, the fp32 master "
                    "weights and Adam's two moments too.",
                    0,
                ),
                equals(
                    memory.devices_needed(memory.weights_bytes(70e9, "fp32"), h100),
                    "that holds fp32 weights only: count the whole training state.",
                    0,
                ),
            ),
        ),
        2: Exercise(
            asks="(bytes each device holds under ZeRO-1, bytes saved per device)",
            expected=None,
            kind="tuple",
            why="ZeRO-1 splits only Adam's moments over the 8 devices; weights and gradients "
            "stay whole on each, and the saving is 7/8 of the optimizer state.",
            parts=(
                Exercise(
                    asks="bytes each device holds under ZeRO-1 (a number)",
                    expected=zero1,
                    unit="bytes",
                    hints=(
                        equals(
                            adam_7b.total / 8,
                            "that is FSDP's share, everything split: ZeRO-1 splits only the "
                            "optimizer state.",
                        ),
                        equals(
                            data,
                            "that is plain data parallelism's share: ZeRO-1 splits the "
                            "optimizer state over the devices.",
                        ),
                        *BYTES_NOT_GB,
                    ),
                ),
                Exercise(
                    asks="bytes saved per device (a number)",
                    expected=data - zero1,
                    unit="bytes",
                    hints=(
                        equals(
                            adam_7b.optimizer,
                            "that is the whole optimizer state: each device still keeps its "
                            "own share of it.",
                        ),
                        *BYTES_NOT_GB,
                    ),
                ),
            ),
        ),
        3: Exercise(
            asks='"yes" or "no"',
            expected="yes" if fits else "no",
            kind="name",
            why="the training state is small; the activations of each device's share of the "
            "batch (1024 / 8 images) decide it.",
            hints=(
                Hint(
                    "add the activations of each device's share of the batch (1024 / 8 "
                    "images, every layer's output kept for the backward pass) to the "
                    "training state, and compare with 40 GB.",
                    lambda a, e: normalise(a) in ("yes", "no"),
                ),
            ),
        ),
    }


def _mesh_groups(mesh: Any) -> dict[str, list[list[int]]]:
    """For each axis of ``mesh``, the groups of device ids that differ only along it."""
    import numpy as np

    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    groups = {}
    for i, name in enumerate(mesh.axis_names):
        moved = np.moveaxis(ids, i, -1)
        groups[name] = moved.reshape(-1, moved.shape[-1]).tolist()
    return groups


def _ch02(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    mesh = ctx["mesh"]
    groups = _mesh_groups(mesh)
    data_axis, other = mesh.axis_names[0], mesh.axis_names[-1]

    def swapped(a: Any, e: Any) -> bool:
        got = {_axis(k): v for k, v in a.items()}
        return _groups(got[_axis(data_axis)]) == _groups(groups[other]) and len(
            groups[data_axis][0]
        ) != len(groups[other][0])

    def even_mesh(m: Any) -> bool:
        import jax

        ids = [d.id for d in m.devices.flat]
        return sorted(ids) == list(range(0, jax.device_count(), 2))

    return {
        1: Exercise(
            asks="a dict from each axis name to its all-reduce groups, lists of device ids, "
            "e.g. {'data': [[...], ...], 'tensor': [[...], ...]}",
            expected={
                name: Exercise(asks="", expected=g, kind="groups")
                for name, g in groups.items()
            },
            kind="dict",
            why="a group holds the devices whose mesh coordinates differ only along that axis, "
            "which is what XLA writes as the replica groups.",
            hints=(
                Hint(
                    "the groups of the two axes are swapped: a group along an axis walks "
                    "that axis of the device array, with the other coordinates fixed.",
                    swapped,
                ),
            ),
        ),
        2: Exercise(
            asks="a list of groups of device ids, the devices of each group holding the same "
            "block",
            expected=groups[data_axis],
            kind="groups",
            why="the axis the spec does not name holds copies: the groups are those of the "
            f"all-reduce over {data_axis!r}.",
            hints=(
                Hint(
                    "those devices hold different columns of the kernel: the spec splits "
                    f"them over {_axis(other)!r}. Copies lie along the axis it does not name.",
                    lambda a, e: _groups(a) == _groups(groups[other]),
                ),
            ),
        ),
        3: Exercise(
            asks="a Mesh over the even-numbered devices",
            expected=lambda m: hasattr(m, "devices") and even_mesh(m),
            kind="callable",
            why="without devices=, jax.make_mesh takes all of jax.devices() in an order of its "
            "choosing; devices= says which ones, and the shape must match their number.",
            hints=(
                Hint(
                    "your mesh holds odd-numbered devices: without devices=, jax.make_mesh takes "
                    "them from all of jax.devices().",
                    lambda a, e: any(d.id % 2 for d in a.devices.flat),
                ),
                Hint(
                    "some even-numbered devices are missing.",
                    lambda a, e: not even_mesh(a),
                ),
            ),
        ),
    }


def _ch03(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxdist_lessons import sharding

    mesh, variables, rules = ctx["mesh"], ctx["variables"], ctx["rules"]
    data_axis, tp = mesh.axis_names[0], mesh.axis_names[-1]
    column = P(None, tp)
    block = sharding.shard_shape((1024, 4096), mesh, column)
    shape = (5040, 5040)
    both = sharding.expected_bytes_per_device(
        shape, jnp.bfloat16, mesh, P((data_axis, tp))
    )
    only = sharding.expected_bytes_per_device(shape, jnp.bfloat16, mesh, column)
    whole = 5040 * 5040 * 2

    def held(rule_list: Any) -> int:
        specs = sharding.specs_from_rules(variables, mesh, rule_list)
        return sum(
            sharding.expected_bytes_per_device(x.shape, x.dtype, mesh, s)
            for x, s in zip(jax.tree.leaves(variables), jax.tree.leaves(specs))
        )

    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(variables))
    kernels = held([rule for rule in rules if "kernel" in rule[0]])
    everything = held(rules)
    bf16 = (
        factor(2, "bfloat16 takes 2 bytes per element, not 4."),
        factor(0.5, "count bytes, not elements: bfloat16 takes 2 bytes each."),
        equals(
            whole,
            "that is the whole array: divide by the devices the spec splits it over.",
        ),
    )
    return {
        1: Exercise(
            asks="(the spec, the block shape each device holds), e.g. (P(...), (rows, cols))",
            expected=None,
            kind="tuple",
            why="column-parallel: every device holds all input rows and its slice of the "
            "output columns, so the matmul needs no communication.",
            parts=(
                Exercise(
                    asks="a PartitionSpec",
                    expected=column,
                    kind="spec",
                    hints=(
                        named(
                            [P(tp), P(tp, None)],
                            "that splits the input features (row-parallel, the second layer of "
                            "a Megatron pair): shard the output features.",
                        ),
                        named(
                            [P(None, data_axis), P(data_axis)],
                            f"{data_axis!r} splits the batch: shard the features over the "
                            "tensor axis.",
                        ),
                    ),
                ),
                Exercise(
                    asks="a shape (rows, cols)",
                    expected=block,
                    kind="spec",
                    hints=(
                        named(
                            [(1024, 4096)],
                            "that is the whole kernel: each device holds one block.",
                        ),
                        named(
                            [(block[1] * 1024 // 4096, 4096)],
                            "that splits the rows: the spec splits the output columns.",
                        ),
                    ),
                ),
            ),
        ),
        2: Exercise(
            asks="(bytes per device with the first spec, bytes per device with the second)",
            expected=None,
            kind="tuple",
            why="bytes per element times the elements of one block: the first spec splits "
            "rows over every device, the second splits columns over the tensor axis alone.",
            parts=(
                Exercise(
                    asks="bytes per device (a number)",
                    expected=both,
                    unit="bytes",
                    hints=bf16,
                ),
                Exercise(
                    asks="bytes per device (a number)",
                    expected=only,
                    unit="bytes",
                    hints=(
                        *bf16,
                        equals(
                            both,
                            "P(None, 'tensor') splits over the tensor axis only; the data axis "
                            "holds copies.",
                        )
                        if both != only
                        else equals(math.nan, ""),
                    ),
                ),
            ),
        ),
        3: Exercise(
            asks="the bytes per device your rules save compared with full replication (a "
            "number)",
            expected=total - kernels,
            unit="bytes",
            why="the kernels hold almost all the bytes: splitting them saves nearly what the "
            "full rule list saves, while the small BatchNorm vectors stay whole.",
            hints=(
                equals(
                    total - everything,
                    "that is what the full rule list saves, BatchNorm split too: with BatchNorm "
                    "replicated the saving is a little smaller.",
                    0.0005,
                ),
                equals(
                    kernels,
                    "that is what each device holds: the question asks what it saves.",
                    0.0005,
                ),
                *BYTES_NOT_GB,
            ),
            rel_tol=0.0002,
        ),
    }


def _ch04(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import comms

    n, features_in = ctx["n"], ctx["in_features"]
    widths = (features_in, 128, 128, 10)
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    grads = params * 4
    resnet = 25_557_032 * 4
    ring = comms.ring_all_reduce_bytes(resnet, 8)
    return {
        1: Exercise(
            asks="the bytes the step all-reduces (a number)",
            expected=grads + 4,
            rel_tol=0,
            unit="bytes",
            why="one float32 gradient per parameter, plus the loss's mean: one more float32.",
            hints=(
                equals(
                    grads, "almost: the step all-reduces one more float32, the loss.", 0
                ),
                equals(
                    params, "count bytes, not parameters: a float32 is 4 bytes.", 0.01
                ),
                equals(
                    comms.ring_all_reduce_bytes(grads + 4, n),
                    "that is what each device sends in a ring; the question asks the bytes the "
                    "all-reduce reduces, its operand.",
                ),
            ),
        ),
        2: Exercise(
            asks="the ratio of the psum'd gradients to the true ones (a number)",
            expected=n * n,
            rel_tol=0.01,
            why="the transpose already sums the replicated parameters' gradients over the "
            "devices, and psum sums the sums once more: N times N.",
            hints=(
                equals(
                    n, "that is the pmean trap's ratio: psum multiplies by N once more."
                ),
                equals(
                    1,
                    "that would be right only if the gradients were not summed already: "
                    "remember chapter 04_gradients's trap.",
                ),
            ),
        ),
        3: Exercise(
            asks="the bytes each device sends (a number)",
            expected=ring,
            unit="bytes",
            why="a ring all-reduce is a reduce-scatter then an all-gather, each sending "
            "(N-1)/N of the gradients: 2 (N-1)/N in all.",
            hints=(
                factor(
                    0.5,
                    "that is one half of the ring: a reduce-scatter, then an all-gather, "
                    "each send (N-1)/N of the data.",
                ),
                equals(
                    resnet, "that is the whole gradient: a ring sends 2 (N-1)/N of it."
                ),
                equals(
                    2 * resnet,
                    "close to the whole round trip, but each step sends 1/N of the data, "
                    "N-1 times in each half.",
                ),
                factor(0.25, "count bytes, not parameters: a float32 is 4 bytes."),
                *BYTES_NOT_GB,
            ),
        ),
    }


CHAPTERS: dict[str, Callable[[Mapping[str, Any]], dict[int, Exercise]]] = {
    "01_why_distribute": _ch01,
    "02_device_mesh": _ch02,
    "03_sharding": _ch03,
    "04_gradients": _ch04,
}


class Checker:
    """``check(number, answer)`` for one chapter; the exercises are built on first use."""

    def __init__(self, chapter: str, context: Mapping[str, Any]):
        if chapter not in CHAPTERS:
            raise ValueError(
                f"no exercises for {chapter!r}; chapters: {sorted(CHAPTERS)}"
            )
        self.chapter = chapter
        self.context = dict(context)
        self._exercises: dict[int, Exercise] | None = None

    @property
    def exercises(self) -> dict[int, Exercise]:
        if self._exercises is None:
            self._exercises = CHAPTERS[self.chapter](self.context)
        return self._exercises

    def __call__(self, number: int, answer: Any = None) -> Verdict:
        if number not in self.exercises:
            raise ValueError(f"{self.chapter} has exercises {sorted(self.exercises)}")
        return judge(self.exercises[number], answer)


def checker(chapter: str, **context: Any) -> Checker:
    """The ``check`` function of ``chapter`` ("04_gradients"), given what its page computed."""
    return Checker(chapter, context)


# --- Chapters 05_resnet50 to 13_experts and the appendix ----------------------------------------------------------


def _names(ex_names: Any) -> frozenset[str]:
    if isinstance(ex_names, str):
        ex_names = re.split(r"[,;\s]+", ex_names)
    return frozenset(normalise(x) for x in ex_names if str(x).strip())


def _ch05(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import comms, memory

    state, n = ctx["state"], ctx["n"]
    whole = comms.tree_bytes(state)
    return {
        1: Exercise(
            asks="a number of parameters (an integer)",
            expected=memory.resnet_params(num_classes=10, base_width=16),
            rel_tol=0,
            why="a quarter of the width gives about a sixteenth of the convolutions' "
            "parameters, since a kernel grows with its input and output channels together.",
            hints=(
                equals(
                    memory.resnet_params(num_classes=10),
                    "that is the full-width model: width=0.25 makes the stem a quarter as wide.",
                    0,
                ),
                equals(
                    memory.resnet_params(base_width=16),
                    "that has a head of 1000 classes: count one of 10.",
                    0,
                ),
            ),
        ),
        2: Exercise(
            asks="the name of the kernel that must stay replicated (a string)",
            expected="conv_init",
            kind="name",
            aliases={
                "conv_init/kernel": "conv_init",
                "stem": "conv_init",
                "thestem": "conv_init",
                "params/conv_init/kernel": "conv_init",
            },
            why="the stem reads the image's 3 colour channels, which the tensor axis cannot "
            "split evenly.",
            hints=(
                Hint(
                    "the projection shortcuts and the blocks have many input channels; which "
                    "convolution reads the image itself?",
                    lambda a, e: "conv" in normalise(a) or "proj" in normalise(a),
                ),
                named(
                    ["head", "head/kernel"],
                    "the head's input features split well; which kernel has an input the "
                    "tensor axis cannot divide?",
                ),
            ),
        ),
        3: Exercise(
            asks="the bytes device 0 holds (a number)",
            expected=whole,
            unit="bytes",
            rel_tol=0.001,
            why="P() replicates: every device holds the whole state, parameters, optimizer "
            "moments and BatchNorm statistics.",
            hints=(
                equals(
                    comms.tree_bytes(state.params),
                    "that is the parameters only: the whole state is restored, optimizer "
                    "moments and BatchNorm statistics too.",
                    0.001,
                ),
                factor(1 / n, "P() splits nothing: every device holds all of it.", 0.01)
                if n > 1
                else equals(math.nan, ""),
                *BYTES_NOT_GB,
            ),
        ),
    }


def _ch06(ctx: Mapping[str, Any]) -> dict[int, Exercise]:

    from jaxdist_lessons import accumulate, benchmark, comms, zero

    n, mesh = ctx["n"], ctx["mesh"]
    work = benchmark.mlp_workload(
        n, width=512, depth=1, per_device_batch=4, in_features=100
    )
    kinds = zero.expected_collectives("fsdp", work.params, n)
    per_step = {
        name: accumulate.bytes_per_step(
            variant(ctx["loss_fn"], mesh, 8), ctx["params"], ctx["batch"], 8
        )
        for name, variant in accumulate.VARIANTS.items()
    }
    (scan_name, scan_bytes), (map_name, map_bytes) = per_step.items()
    params = ctx["gpt_params"]
    tx = ctx["tx"]
    held = zero.expected_state_bytes("fsdp", params, tx.init(params), 3)
    share = held / comms.tree_bytes((params, tx.init(params)))
    once = comms.tree_bytes(ctx["params"])
    return {
        1: Exercise(
            asks="a dict from each kind of collective ('all-gather', 'reduce-scatter', "
            "'all-reduce') to its bytes",
            expected={
                k: Exercise(asks="", expected=v, rel_tol=0.001)
                for k, v in kinds.items()
            },
            kind="dict",
            why="FSDP all-gathers the sharded weights, reduce-scatters their gradients, and "
            "all-reduces what it cannot shard (the parameters whose dimensions do not divide, "
            "and the loss).",
        ),
        2: Exercise(
            asks=f"(bytes per step of {scan_name!r}, bytes per step of {map_name!r})",
            expected=None,
            kind="tuple",
            why="under jit + scan the all-reduce sits in the loop body and runs once per "
            "micro-batch; shard_map accumulates locally and all-reduces once.",
            parts=(
                Exercise(
                    asks="bytes per step (a number)",
                    expected=scan_bytes,
                    unit="bytes",
                    hints=(
                        equals(
                            scan_bytes / 8,
                            "a collective in the scan's body runs once per micro-batch.",
                        ),
                        equals(
                            scan_bytes / 2,
                            "that is what four micro-batches send; this asks about eight.",
                        ),
                    ),
                ),
                Exercise(
                    asks="bytes per step (a number)",
                    expected=map_bytes,
                    unit="bytes",
                    hints=(
                        equals(
                            map_bytes * 8,
                            "shard_map sums the micro-batches locally: one all-reduce, after "
                            "the loop.",
                        ),
                        equals(
                            once * 8,
                            "shard_map sums the micro-batches locally: one all-reduce, after "
                            "the loop.",
                        ),
                    ),
                ),
            ),
        ),
        3: Exercise(
            asks="the fraction of the whole FSDP state that each of 3 devices holds (a "
            "number)",
            expected=share,
            rel_tol=0.01,
            why="the rule shards an array only along a dimension the device count divides; "
            "pick dimensions divisible by the device counts you will use.",
            hints=(
                equals(
                    1 / 3,
                    "that assumes every array splits in three: which of the decoder's "
                    "dimensions does 3 divide?",
                )
                if not math.isclose(share, 1 / 3)
                else equals(math.nan, ""),
            ),
        ),
    }


def _ch07(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import oom

    n, mesh = ctx["n"], ctx["mesh"]
    slices = (1, 4, 8, 16, 32, 64, 128, 256)

    def fits(chips: int) -> bool:
        return oom.fits(
            ctx["params_7b"], chips, "TPU v5e", strategy="fsdp", precision="mixed"
        ).ok

    fewest = next(k for k in range(1, slices[-1] + 1) if fits(k))
    smallest = next(k for k in slices if fits(k))
    return {
        1: Exercise(
            asks="(the axis name pmean must use, how many times the whole-batch update the "
            "renamed step's update is)",
            expected=None,
            kind="tuple",
            why="'batch' was the pmap's axis name and the mesh binds other names; renamed, the "
            "step still hits chapter 04_gradients's trap, so average the loss, not the gradients.",
            parts=(
                Exercise(
                    asks="an axis name",
                    expected=mesh.axis_names[0],
                    kind="name",
                    hints=(
                        named(
                            ["batch"],
                            "'batch' is the name the old pmap bound: which names does the "
                            "mesh bind?",
                        ),
                    ),
                ),
                Exercise(
                    asks="a ratio (a number)",
                    expected=n,
                    rel_tol=0.01,
                    hints=(
                        equals(
                            1,
                            "run it: renaming the axis alone leaves chapter 04_gradients's trap in place."
                            if n != 1
                            else "",
                        ),
                        equals(n * n, "the gradients are summed once, then averaged."),
                    ),
                ),
            ),
        ),
        2: Exercise(
            asks="the number of chips of the smallest v5e slice (an integer)",
            expected=smallest,
            rel_tol=0,
            why="FSDP divides the whole training state by the chips; the fewest chips that "
            "hold it round up to the next slice you can rent.",
            hints=(
                equals(
                    fewest,
                    "that many chips would hold it, but no v5e slice has that size.",
                    0,
                )
                if fewest != smallest
                else equals(math.nan, ""),
                Hint(
                    "that is not a v5e slice size.",
                    lambda a, e: _number(a) not in slices,
                ),
            ),
        ),
        3: Exercise(
            asks="a number of compilations (an integer)",
            expected=2,
            rel_tol=0,
            why="jit compiles once per input shape: the full batches share one program, the "
            "smaller last batch needs another.",
            hints=(
                equals(
                    1,
                    "the last batch has another shape, and jit compiles per shape.",
                    0,
                ),
                equals(4, "batches of the same shape reuse the compiled program.", 0),
            ),
        ),
    }


def _demo_all_reduce_bytes(n: int) -> tuple[int, int]:
    """(bytes the demo's data-parallel step all-reduces, its parameters' bytes) on ``n`` devices."""
    import jax
    import optax
    from jax.sharding import AxisType

    from jaxdist_lessons import comms, data, multihost_demo, train

    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    tx = optax.adam(3e-3)
    shape = multihost_demo.IMAGE_SHAPE
    no_rules = train.rule_shardings(mesh, [])
    state = train.create_train_state(
        multihost_demo.MODEL, tx, shape, no_rules, abstract=True
    )
    step, _ = train.make_steps(train.shardings_of(state), mesh)
    source = data.digits_source("train")
    batch = next(
        data.batches(source, 4 * n, mesh, preprocess=multihost_demo.PREPROCESS)
    )
    text = step.lower(state, batch).compile().as_text()
    return comms.total_bytes(text, "all-reduce"), comms.data_parallel_bytes(
        state.params
    )


def _ch08(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import comms

    n, links = ctx["n"], ctx["links"]
    reduced, params = _demo_all_reduce_bytes(n)
    ici, dcn = links.values()
    sent = comms.ring_all_reduce_bytes(100e6, 64)
    seconds = (
        factor(
            0.5,
            "a ring all-reduce sends 2 (N-1)/N of the data from each chip, not half.",
        ),
        factor(1e3, "give seconds, not milliseconds."),
        factor(8, "the DCN figure is in bits per second: 8 bits to a byte."),
        factor(1 / 8, "the DCN figure is in bits per second: 8 bits to a byte."),
    )
    return {
        1: Exercise(
            asks='"yes" or "no"',
            expected="yes",
            kind="name",
            why="each global batch holds the same rows wherever they are loaded, so the "
            "steps, and the losses, are the same.",
            hints=(
                named(
                    ["no"],
                    "run both: the global batches hold the same rows whichever process loads "
                    "them.",
                ),
            ),
        ),
        2: Exercise(
            asks="the bytes the step all-reduces (a number)",
            expected=reduced,
            unit="bytes",
            rel_tol=0.001,
            why="one gradient per parameter, plus the BatchNorm statistics averaged over the "
            "devices and the loss.",
            hints=(
                equals(
                    params,
                    "that is the gradients alone: what else does a BatchNorm model average "
                    "over the devices?",
                    0.0001,
                )
                if params != reduced
                else equals(math.nan, ""),
                Hint(
                    "that is what each device sends in a ring; the question asks the bytes "
                    "the all-reduce reduces, its operand.",
                    lambda a, e: (
                        _close(_number(a) or 0, comms.ring_all_reduce_bytes(e, n), 0.01)
                        and n > 1
                    ),
                ),
                *BYTES_NOT_GB,
            ),
        ),
        3: Exercise(
            asks="(seconds on ICI, seconds on DCN, bytes at which DCN takes as long as ICI "
            "for 100 MB)",
            expected=None,
            kind="tuple",
            why="each chip sends 2 (N-1)/N of the data, and the time is bytes over bandwidth; "
            "DCN is slower by the ratio of the bandwidths, so it matches with that much less "
            "data.",
            parts=(
                Exercise(
                    asks="seconds (a number)",
                    expected=sent / ici,
                    unit="seconds",
                    hints=seconds,
                ),
                Exercise(
                    asks="seconds (a number)",
                    expected=sent / dcn,
                    unit="seconds",
                    hints=seconds,
                ),
                Exercise(
                    asks="bytes (a number)",
                    expected=100e6 * dcn / ici,
                    unit="bytes",
                    hints=(
                        equals(
                            100e6 * ici / dcn,
                            "DCN is the slower link: it needs less data.",
                        ),
                        *BYTES_NOT_GB,
                    ),
                ),
            ),
        ),
    }


def _ch09(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    import flax.linen as nn

    rules = (("batch", "data"), ("embed", ("data", "tensor")), ("mlp", "data"))
    up = nn.get_partition_spec(ctx["abstract"])["params"]["Block_0"]["mlp"]["up"]
    return {
        1: Exercise(
            asks="a PartitionSpec",
            expected=nn.logical_to_mesh_axes(up["kernel"], rules),
            kind="spec",
            why="the kernel's logical axes are ('embed', 'mlp'): the rules translate each to "
            "mesh axes, and an axis already used by an earlier dimension is left out.",
            hints=(
                named(
                    [("data", "tensor"), "P(('data', 'tensor'), 'data')"],
                    "a mesh axis can shard only one dimension of an array: the second "
                    "dimension cannot reuse 'data'.",
                ),
            ),
        ),
    }


def _ch10_lm(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import hardware

    rows, lm_config = ctx["rows"], ctx["lm_config"]

    def fitting(chip: str) -> frozenset[str]:
        limit = hardware.chip(chip).memory_bytes / 1e9
        return frozenset(
            r["model"]
            for r in rows
            if r["devices"] == 8
            and r["strategy"] in ("FSDP", "FSDP+TP")
            and r["total"] <= limit
        )

    h100, h200 = fitting("H100 80GB"), fitting("H200 141GB")
    models = {r["model"] for r in rows}
    flops = lm_config.flops_per_token(lm_config.PRESETS["8b"], 4096) * 32 * 4096
    peak = hardware.chip("H100 80GB").peak_bf16_flops
    step = flops / (16 * peak * 0.4)
    too_many = Hint(
        "one of those needs more memory than a node of 8 holds: read its total per device.",
        lambda a, e: bool(_names(a) - _names(e)) and _names(a) <= _names(models),
    )
    too_few = Hint(
        "one more model fits: read the totals per device of the 8-device rows.",
        lambda a, e: _names(a) < _names(e),
    )
    return {
        1: Exercise(
            asks="(the models that fit on H100s, those that fit on H200s), e.g. "
            "(['name', ...], ['name', ...])",
            expected=None,
            kind="tuple",
            why="a model fits if one of its 8-device rows totals no more than the chip's "
            "memory; the largest needs more than one node either way.",
            parts=(
                Exercise(
                    asks="model names",
                    expected=h100,
                    kind="names",
                    hints=(too_many, too_few),
                ),
                Exercise(
                    asks="model names",
                    expected=h200,
                    kind="names",
                    hints=(too_many, too_few),
                ),
            ),
        ),
        2: Exercise(
            asks="the step number of the first step line (an integer)",
            expected=21,
            rel_tol=0,
            why="the run restores the last checkpoint and its data iterator, then trains only "
            "the steps still to do.",
            hints=(
                equals(
                    1, "the run finds the checkpoint in its directory and resumes.", 0
                ),
                equals(20, "that step is done and saved: the next one comes first.", 0),
            ),
        ),
        3: Exercise(
            asks="seconds per step (a number)",
            expected=step,
            unit="seconds",
            rel_tol=0.03,
            why="flops per token times tokens per step, over the devices' peak times the MFU.",
            hints=(
                factor(
                    16, "that is one device's time for the whole batch: there are 16."
                ),
                factor(
                    0.16, "MFU is the fraction of the peak you reach: divide by it."
                ),
                factor(
                    1 / 3,
                    "a training step is forward and backward: about three times "
                    "the forward's flops.",
                ),
                factor(1e3, "give seconds, not milliseconds."),
            ),
        ),
    }


def _layout(data: int, tensor: int) -> Any:
    from jaxdist_lessons.planning import costmodel

    return costmodel.Layout(data=data, tensor=tensor)


def _crossing(hw: str) -> int:
    from jaxdist_lessons.planning import costmodel, roofline

    fine = list(range(8, 1025, 8))
    values = roofline.speedups_over_batch(
        costmodel.MODELS["ViT-L/16"], _layout(8, 1), _layout(4, 2), hw, fine
    )
    return max(b // 8 for b, v in zip(fine, values) if v > 1)


def _ch11_pipe(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import pipeline

    m = next(m for m in range(1, 1000) if pipeline.bubble_fraction(4, m) <= 0.1)
    h100, a100 = _crossing("H100 80GB"), _crossing("A100 40GB")
    return {
        1: Exercise(
            asks="a number of microbatches (an integer)",
            expected=m,
            rel_tol=0,
            why="the bubble is (S-1)/(M+S-1): at most a tenth when M is at least nine times "
            "(S-1).",
            hints=(
                equals(
                    next(m for m in range(1, 1000) if 3 / m <= 0.1),
                    "the bubble is (S-1)/(M+S-1), not (S-1)/M.",
                    0,
                ),
                Hint(
                    "that leaves a bubble over 10%.", lambda a, e: (_number(a) or 0) < e
                ),
            ),
        ),
        2: Exercise(
            asks='(the per-GPU batch of the crossing on H100, "up" or "down")',
            expected=None,
            kind="tuple",
            why="the H100 has about three times the A100's flops but only about one and a half "
            "times its NVLink bandwidth: communication weighs more, so the crossing moves to "
            "larger batches.",
            parts=(
                Exercise(
                    asks="a per-GPU batch (an integer)",
                    expected=h100,
                    rel_tol=0.05,
                    hints=(
                        equals(a100, "that is the A100's crossing: use the H100.", 0)
                        if a100 != h100
                        else equals(math.nan, ""),
                        factor(8, "per GPU: divide the global batch by 8.", 0.05),
                    ),
                ),
                Exercise(
                    asks='"up" or "down"',
                    expected="up" if h100 > a100 else "down",
                    kind="name",
                    hints=(
                        named(
                            ["up", "down"],
                            "compare how much faster the H100's compute is than its links.",
                        ),
                    ),
                ),
            ),
        ),
    }


def _ch12(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import sequence

    work = sequence.causal_work(8, "contiguous")
    fraction = work[0] / work[-1]
    sent = {
        name: sequence.predicted_bytes(name, 1, 131072, 8, 128, 8, itemsize=2)["sent"]
        for name in sequence.ATTENTIONS
    }
    fp32 = factor(2, "bf16 takes 2 bytes per element, not 4.")
    return {
        1: Exercise(
            asks="a fraction (a number between 0 and 1)",
            expected=fraction,
            rel_tol=0.01,
            why="under the causal mask the first block attends to half a block and the last "
            "to almost all of them.",
            hints=(
                factor(
                    1 / fraction**2, "that is slowest over fastest: invert it.", 0.01
                ),
                equals(
                    1 / 8,
                    "the causal mask makes the work grow along the sequence: the "
                    "devices' shares of the work are not equal.",
                    0.01,
                ),
            ),
        ),
        2: Exercise(
            asks="a number of devices (an integer)",
            expected=8,
            rel_tol=0,
            why="Ulysses gives each device whole heads, and K and V have as many heads as "
            "there are key-value heads; beyond that, add ring attention over a second axis, "
            "or repeat the KV heads.",
            hints=(
                equals(32, "the queries have more heads, but K and V do not.", 0),
                Hint(
                    "more devices still each get whole key-value heads.",
                    lambda a, e: (_number(a) or 0) < e,
                ),
            ),
        ),
        3: Exercise(
            asks="a dict from each form's name "
            f"({', '.join(map(repr, sequence.ATTENTIONS))}) to its bytes",
            expected={
                k: Exercise(asks="", expected=v, unit="bytes", hints=(fp32,))
                for k, v in sent.items()
            },
            kind="dict",
            why="ring and all-gather move the keys and values of the other devices; Ulysses "
            "moves each tensor's 7/8 in all-to-alls.",
        ),
    }


def _ch13(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import experts

    c = experts.capacity(4096, 64, 2, 1.25)
    nbytes = experts.all_to_all_bytes(64, c, 4096, itemsize=2)
    choices = (
        "forward dispatch",
        "forward combine",
        "backward dispatch",
        "backward combine",
    )
    return {
        1: Exercise(
            asks="(C, bytes per all-to-all)",
            expected=None,
            kind="tuple",
            why="C is k tokens' worth of slots times the capacity factor, shared by the "
            "experts and rounded up; each all-to-all carries E x C rows of D values.",
            parts=(
                Exercise(
                    asks="a capacity (an integer)",
                    expected=c,
                    rel_tol=0,
                    hints=(
                        equals(
                            experts.capacity(4096, 64, 1, 1.25),
                            "each token goes to k experts: count k slots per token.",
                            0,
                        ),
                        equals(
                            experts.capacity(4096, 64, 2, 1.0),
                            "the capacity factor gives the experts room to spare.",
                            0,
                        ),
                    ),
                ),
                Exercise(
                    asks="bytes (a number)",
                    expected=nbytes,
                    unit="bytes",
                    hints=(
                        factor(2, "bf16 takes 2 bytes per element, not 4."),
                        *BYTES_NOT_GB,
                    ),
                ),
            ),
        ),
        2: Exercise(
            asks=f"which all-to-all is gone, one of {', '.join(map(repr, choices))}",
            expected="backward dispatch",
            kind="name",
            aliases={normalise(c): normalise(c) for c in choices},
            why="the dispatch tensor is a constant one-hot, so the gradient that the "
            "dispatch's transpose carries home is needed only for the input's; without it, "
            "XLA removes that all-to-all as dead code.",
            hints=(
                named(
                    choices[:2],
                    "the forward pass is the same whichever gradient you take.",
                ),
                named(
                    choices[3:],
                    "the experts' weights need the output's gradient brought to the experts.",
                ),
            ),
        ),
    }


def _runs(fn: Callable[[], Any]) -> bool:
    fn()
    return True


def _appendix(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    return {
        1: Exercise(
            asks="(the exception's class name, the chapter's number)",
            expected=None,
            kind="tuple",
            why="Explicit axes need the sharding of every ambiguous result stated; chapter 05_resnet50 "
            "shows it, and Auto axes (or out_sharding=) fix it.",
            parts=(
                Exercise(
                    asks="an exception class name",
                    expected="ShardingTypeError",
                    kind="name",
                    aliases={"jax.sharding.shardingtypeerror": "shardingtypeerror"},
                    hints=(
                        named(
                            ["ValueError", "TypeError", "AssertionError"],
                            "run it and read the last line of the traceback.",
                        ),
                    ),
                ),
                Exercise(asks="a chapter number", expected=5, rel_tol=0),
            ),
        ),
        2: Exercise(
            asks="(all-reduces executed per step under jit + scan, under shard_map)",
            expected=None,
            kind="tuple",
            why="under jit + scan the all-reduce is in the loop body and runs once per "
            "micro-batch; shard_map all-reduces once, after the loop.",
            parts=(
                Exercise(
                    asks="a count (an integer)",
                    expected=4,
                    rel_tol=0,
                    hints=(
                        equals(
                            1,
                            "the program text holds it once, but it sits in the loop body.",
                            0,
                        ),
                    ),
                ),
                Exercise(
                    asks="a count (an integer)",
                    expected=1,
                    rel_tol=0,
                    hints=(
                        Hint(
                            "shard_map accumulates the micro-batches locally first.",
                            lambda a, e: (_number(a) or 0) > 1,
                        ),
                    ),
                ),
            ),
        ),
        3: Exercise(
            asks="a function that runs your fixed snippet, taking no arguments",
            expected=_runs,
            kind="callable",
            why="your fixed snippet runs. Compare its output with what the post claims.",
        ),
    }


CHAPTERS.update(
    {
        "05_resnet50": _ch05,
        "06_performance": _ch06,
        "07_troubleshooting": _ch07,
        "08_multi_host": _ch08,
        "09_flax_partitioning": _ch09,
        "10_language_model": _ch10_lm,
        "11_pipelines_mesh_shape": _ch11_pipe,
        "12_long_sequences": _ch12,
        "13_experts": _ch13,
        "appendix_seed_errata": _appendix,
    }
)
