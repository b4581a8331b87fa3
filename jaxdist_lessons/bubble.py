"""A pipeline's bubble: the share of a step its stages sit idle, as a formula.

Standard library only, so that the planner (``planning``) also runs in the browser, in the
"Plan your run" page's Pyodide; ``pipeline`` (the schedules, run with JAX) imports it from here.
"""

from __future__ import annotations

from jaxdist_lessons._checks import positive_int


def bubble_fraction(num_stages: int, num_microbatches: int, virtual: int = 1) -> float:
    """The idle share of a GPipe or 1F1B step, ``(S - 1) / (v M + S - 1)`` (``v = 1``: ``(S - 1) / (M + S - 1)``)."""
    positive_int("num_stages", num_stages)
    positive_int("num_microbatches", num_microbatches)
    positive_int("virtual", virtual)
    return (num_stages - 1) / (virtual * num_microbatches + num_stages - 1)
