"""Judging a reader's answers: the exercise and hint types, how answers are read and
compared, and the checker each chapter makes (its exercises live in the module named after
the chapter file, listed in ``CHAPTERS``)."""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
        # within the page's column: one message is a paragraph or two
        return "\n".join(
            textwrap.fill(line, 88, break_on_hyphens=False, break_long_words=False)
            for line in self.message.splitlines()
        )

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


# Each chapter file's exercises, in the module of this package named after it.
CHAPTERS: dict[str, str] = {
    "01_why_distribute": "ch01_why_distribute",
    "02_device_mesh": "ch02_device_mesh",
    "03_sharding": "ch03_sharding",
    "04_gradients": "ch04_gradients",
    "05_resnet50": "ch05_resnet50",
    "06_performance": "ch06_performance",
    "07_troubleshooting": "ch07_troubleshooting",
    "08_multi_host": "ch08_multi_host",
    "09_flax_partitioning": "ch09_flax_partitioning",
    "10_language_model": "ch10_language_model",
    "11_pipelines_mesh_shape": "ch11_pipelines_mesh_shape",
    "12_long_sequences": "ch12_long_sequences",
    "13_experts": "ch13_experts",
    "appendix_seed_errata": "appendix_seed_errata",
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
            module = importlib.import_module(f"{__package__}.{CHAPTERS[self.chapter]}")
            self._exercises = module.exercises(self.context)
        return self._exercises

    def __call__(self, number: int, answer: Any = None) -> Verdict:
        if number not in self.exercises:
            raise ValueError(f"{self.chapter} has exercises {sorted(self.exercises)}")
        return judge(self.exercises[number], answer)


def checker(chapter: str, **context: Any) -> Checker:
    """The ``check`` function of ``chapter`` ("04_gradients"), given what its page computed."""
    return Checker(chapter, context)


def _names(ex_names: Any) -> frozenset[str]:
    if isinstance(ex_names, str):
        ex_names = re.split(r"[,;\s]+", ex_names)
    return frozenset(normalise(x) for x in ex_names if str(x).strip())


def _runs(fn: Callable[[], Any]) -> bool:
    fn()
    return True
