"""The exercises of ``book/05_resnet50.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    BYTES_NOT_GB,
    Exercise,
    Hint,
    equals,
    factor,
    named,
    normalise,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import comms, memory

    state, n = ctx["state"], ctx["n"]
    whole = comms.tree_bytes(state)
    return {
        1: Exercise(
            asks="a number of parameters (an integer)",
            expected=memory.resnet_params(num_classes=10, base_width=16),
            rel_tol=0,
            why="a quarter of the width gives about a sixteenth of the convolutions' "
            "parameters, since a kernel grows with its input and output channels together.",
            hints=(
                equals(
                    memory.resnet_params(num_classes=10),
                    "that is the full-width model: width=0.25 makes the stem a quarter as wide.",
                    0,
                ),
                equals(
                    memory.resnet_params(base_width=16),
                    "that has a head of 1000 classes: count one of 10.",
                    0,
                ),
            ),
        ),
        2: Exercise(
            asks="the name of the kernel that must stay replicated (a string)",
            expected="conv_init",
            kind="name",
            aliases={
                "conv_init/kernel": "conv_init",
                "stem": "conv_init",
                "thestem": "conv_init",
                "params/conv_init/kernel": "conv_init",
            },
            why="the stem reads the image's 3 colour channels, which the tensor axis cannot "
            "split evenly.",
            hints=(
                Hint(
                    "the projection shortcuts and the blocks have many input channels; which "
                    "convolution reads the image itself?",
                    lambda a, e: "conv" in normalise(a) or "proj" in normalise(a),
                ),
                named(
                    ["head", "head/kernel"],
                    "the head's input features split well; which kernel has an input the "
                    "tensor axis cannot divide?",
                ),
            ),
        ),
        3: Exercise(
            asks="the bytes device 0 holds (a number)",
            expected=whole,
            unit="bytes",
            rel_tol=0.001,
            why="P() replicates: every device holds the whole state, parameters, optimizer "
            "moments and BatchNorm statistics.",
            hints=(
                equals(
                    comms.tree_bytes(state.params),
                    "that is the parameters only: the whole state is restored, optimizer "
                    "moments and BatchNorm statistics too.",
                    0.001,
                ),
                factor(1 / n, "P() splits nothing: every device holds all of it.", 0.01)
                if n > 1
                else equals(math.nan, ""),
                *BYTES_NOT_GB,
            ),
        ),
    }
