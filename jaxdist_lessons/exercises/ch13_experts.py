"""The exercises of ``book/13_experts.md``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    BYTES_NOT_GB,
    Exercise,
    equals,
    factor,
    named,
    normalise,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
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
