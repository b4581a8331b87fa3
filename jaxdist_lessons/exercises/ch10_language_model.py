"""The exercises of ``book/10_language_model.md``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    Exercise,
    Hint,
    _names,
    equals,
    factor,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
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
