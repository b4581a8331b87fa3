"""The exercises of ``book/07_troubleshooting.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    Exercise,
    Hint,
    _number,
    equals,
    named,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
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
