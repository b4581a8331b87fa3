"""The exercises of ``book/11_pipelines_mesh_shape.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    Exercise,
    Hint,
    _number,
    equals,
    factor,
    named,
)


def crossing(hw: str) -> int:
    """The largest per-GPU batch at which (4,2) beats (8,1) for ViT-L/16 on ``hw``."""
    from jaxdist_lessons.planning import costmodel, roofline

    # Global batches of 8 to 1024, a step of one image per GPU.
    fine = list(range(8, 1025, 8))
    speedups = roofline.speedups_over_batch(
        costmodel.MODELS["ViT-L/16"],
        costmodel.Layout(data=8),
        costmodel.Layout(data=4, tensor=2),
        hw,
        fine,
    )
    return max(b // 8 for b, v in zip(fine, speedups) if v > 1)


def answer_1(num_stages: int = 4, most: float = 0.1) -> int:
    """The fewest microbatches that keep a GPipe bubble at or below ``most``."""
    from jaxdist_lessons import pipeline

    m = next(
        m for m in range(1, 1000) if pipeline.bubble_fraction(num_stages, m) <= most
    )
    print(f"1. {m} microbatches: bubble {pipeline.bubble_fraction(num_stages, m):.1%}")
    return m


def answer_2() -> tuple[int, str]:
    """ViT-L/16's crossing on H100, and whether it lies above ("up") the A100's."""
    from jaxdist_lessons import hardware

    fast, slow = hardware.chip("H100 80GB"), hardware.chip("A100 40GB")
    flops = fast.peak_bf16_flops / slow.peak_bf16_flops
    links = fast.link_bytes_per_s / slow.link_bytes_per_s
    print(f"2. H100 / A100: {flops:.1f}x the flops, {links:.1f}x the link bandwidth")
    a100, h100 = crossing("A100 40GB"), crossing("H100 80GB")
    print(f"   (4,2) beats (8,1) up to {a100} images per GPU on A100, {h100} on H100")
    return h100, "up" if h100 > a100 else "down"


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import pipeline

    m = next(m for m in range(1, 1000) if pipeline.bubble_fraction(4, m) <= 0.1)
    h100, a100 = crossing("H100 80GB"), crossing("A100 40GB")
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
