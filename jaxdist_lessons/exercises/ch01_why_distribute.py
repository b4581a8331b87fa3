"""The exercises of ``book/01_why_distribute.md``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    BYTES_NOT_GB,
    Exercise,
    Hint,
    equals,
    normalise,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
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
