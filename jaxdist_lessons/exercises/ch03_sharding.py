"""The exercises of ``book/03_sharding.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    BYTES_NOT_GB,
    Exercise,
    equals,
    factor,
    named,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxdist_lessons import sharding

    mesh, variables, rules = ctx["mesh"], ctx["variables"], ctx["rules"]
    data_axis, tp = mesh.axis_names[0], mesh.axis_names[-1]
    column = P(None, tp)
    block = sharding.shard_shape((1024, 4096), mesh, column)
    shape = (5040, 5040)
    both = sharding.expected_bytes_per_device(
        shape, jnp.bfloat16, mesh, P((data_axis, tp))
    )
    only = sharding.expected_bytes_per_device(shape, jnp.bfloat16, mesh, column)
    whole = 5040 * 5040 * 2

    def held(rule_list: Any) -> int:
        specs = sharding.specs_from_rules(variables, mesh, rule_list)
        return sum(
            sharding.expected_bytes_per_device(x.shape, x.dtype, mesh, s)
            for x, s in zip(jax.tree.leaves(variables), jax.tree.leaves(specs))
        )

    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(variables))
    kernels = held([rule for rule in rules if "kernel" in rule[0]])
    everything = held(rules)
    bf16 = (
        factor(2, "bfloat16 takes 2 bytes per element, not 4."),
        factor(0.5, "count bytes, not elements: bfloat16 takes 2 bytes each."),
        equals(
            whole,
            "that is the whole array: divide by the devices the spec splits it over.",
        ),
    )
    return {
        1: Exercise(
            asks="(the spec, the block shape each device holds), e.g. (P(...), (rows, cols))",
            expected=None,
            kind="tuple",
            why="column-parallel: every device holds all input rows and its slice of the "
            "output columns, so the matmul needs no communication.",
            parts=(
                Exercise(
                    asks="a PartitionSpec",
                    expected=column,
                    kind="spec",
                    hints=(
                        named(
                            [P(tp), P(tp, None)],
                            "that splits the input features (row-parallel, the second layer of "
                            "a Megatron pair): shard the output features.",
                        ),
                        named(
                            [P(None, data_axis), P(data_axis)],
                            f"{data_axis!r} splits the batch: shard the features over the "
                            "tensor axis.",
                        ),
                    ),
                ),
                Exercise(
                    asks="a shape (rows, cols)",
                    expected=block,
                    kind="spec",
                    hints=(
                        named(
                            [(1024, 4096)],
                            "that is the whole kernel: each device holds one block.",
                        ),
                        named(
                            [(block[1] * 1024 // 4096, 4096)],
                            "that splits the rows: the spec splits the output columns.",
                        ),
                    ),
                ),
            ),
        ),
        2: Exercise(
            asks="(bytes per device with the first spec, bytes per device with the second)",
            expected=None,
            kind="tuple",
            why="bytes per element times the elements of one block: the first spec splits "
            "rows over every device, the second splits columns over the tensor axis alone.",
            parts=(
                Exercise(
                    asks="bytes per device (a number)",
                    expected=both,
                    unit="bytes",
                    hints=bf16,
                ),
                Exercise(
                    asks="bytes per device (a number)",
                    expected=only,
                    unit="bytes",
                    hints=(
                        *bf16,
                        equals(
                            both,
                            "P(None, 'tensor') splits over the tensor axis only; the data axis "
                            "holds copies.",
                        )
                        if both != only
                        else equals(math.nan, ""),
                    ),
                ),
            ),
        ),
        3: Exercise(
            asks="the bytes per device your rules save compared with full replication (a "
            "number)",
            expected=total - kernels,
            unit="bytes",
            why="the kernels hold almost all the bytes: splitting them saves nearly what the "
            "full rule list saves, while the small BatchNorm vectors stay whole.",
            hints=(
                equals(
                    total - everything,
                    "that is what the full rule list saves, BatchNorm split too: with BatchNorm "
                    "replicated the saving is a little smaller.",
                    0.0005,
                ),
                equals(
                    kernels,
                    "that is what each device holds: the question asks what it saves.",
                    0.0005,
                ),
                *BYTES_NOT_GB,
            ),
            rel_tol=0.0002,
        ),
    }
