"""The exercises of ``book/09_flax_partitioning.md``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    Exercise,
    named,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    import flax.linen as nn

    rules = (("batch", "data"), ("embed", ("data", "tensor")), ("mlp", "data"))
    up = nn.get_partition_spec(ctx["abstract"])["params"]["Block_0"]["mlp"]["up"]
    return {
        1: Exercise(
            asks="a PartitionSpec",
            expected=nn.logical_to_mesh_axes(up["kernel"], rules),
            kind="spec",
            why="the kernel's logical axes are ('embed', 'mlp'): the rules translate each to "
            "mesh axes, and an axis already used by an earlier dimension is left out.",
            hints=(
                named(
                    [("data", "tensor"), "P(('data', 'tensor'), 'data')"],
                    "a mesh axis can shard only one dimension of an array: the second "
                    "dimension cannot reuse 'data'.",
                ),
            ),
        ),
    }
