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

The judging is in ``checking``; each chapter's exercises are in the module named after its
file (``ch04_gradients`` for ``book/04_gradients.md``).
"""

from jaxdist_lessons.exercises.checking import (
    CHAPTERS,
    Checker,
    Exercise,
    Hint,
    Verdict,
    checker,
    judge,
    normalise,
)

__all__ = [
    "CHAPTERS",
    "Checker",
    "Exercise",
    "Hint",
    "Verdict",
    "checker",
    "judge",
    "normalise",
]
