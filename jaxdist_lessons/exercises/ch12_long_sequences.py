"""The exercises of ``book/12_long_sequences.md``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    Exercise,
    Hint,
    _number,
    equals,
    factor,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
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
