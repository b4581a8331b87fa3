"""The exercises of ``book/04_gradients.md``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    BYTES_NOT_GB,
    Exercise,
    equals,
    factor,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
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
