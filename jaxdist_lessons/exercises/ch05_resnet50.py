"""The exercises of ``book/05_resnet50.md``, and the answers the page includes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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


# --- The answers ----------------------------------------------------------------------


def answer_1(image_shape: tuple[int, ...]) -> int:
    """ResNet50's parameters at width 0.25 with 10 classes, counted and predicted."""
    from jaxdist_lessons import memory
    from jaxdist_lessons.models import resnet

    quarter = resnet.ResNet50(num_classes=10, width=0.25)
    example = jnp.zeros((1, *image_shape))
    # Shapes only: eval_shape creates no parameter.
    shapes = jax.eval_shape(quarter.init, jax.random.key(0), example)["params"]
    counted = sum(x.size for x in jax.tree.leaves(shapes))
    # Width 0.25 makes the stem 64 * 0.25 = 16 channels wide.
    predicted = memory.resnet_params(num_classes=10, base_width=16)
    print(f"1. counted on the model: {counted:,}; resnet_params: {predicted:,}")
    return counted


def block_bytes(shapes: Any, shardings: Any) -> int:
    """Bytes of each leaf's block on one device, from its sharding: none is created."""
    leaves = zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True)
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in leaves)


def answer_2(abstract: Any, mesh: Mesh, output_rules: list[tuple[str, P]]) -> str:
    """Input-channel rules: the stem refused, and the parameter bytes on device 0."""
    from jaxdist_lessons import sharding
    from jaxdist_lessons.tables import Table, human_bytes

    input_rules = [
        (r"(Conv_\d+|proj_conv)/kernel$", P(None, None, "tensor", None)),
        (r"head/kernel$", P("tensor", None)),
    ]
    if mesh.shape["tensor"] > 1:
        stem = [(r"conv_init/kernel$", P(None, None, "tensor", None)), *input_rules]
        try:
            sharding.shardings_from_rules(abstract, mesh, stem)
            raise AssertionError("the stem's 3 input channels split over 'tensor'")
        except sharding.ShardingError:
            print("2. conv_init/kernel split on its 3 input channels: refused")
    rows = []
    for name, rules in [
        ("data parallel", []),
        ("output channels", output_rules),
        ("input channels", input_rules),
    ]:
        shardings = sharding.shardings_from_rules(abstract, mesh, rules)
        rows.append([name, human_bytes(block_bytes(abstract.params, shardings.params))])
    title = f"2. mesh {dict(mesh.shape)}"
    print(Table(["rules", "params on device 0"], rows, title=title))
    return "conv_init"


def answer_3(directory: str, abstract: Any, mesh: Mesh) -> int:
    """Bytes on device 0 with the latest checkpoint restored, every leaf replicated."""
    from jaxdist_lessons import sharding, train
    from jaxdist_lessons.tables import human_bytes

    everywhere = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
    full_copy, _ = train.restore_latest(directory, abstract, everywhere)
    held = sharding.bytes_per_device(full_copy)[jax.devices()[0].id]
    print("3.", human_bytes(held))
    return held
