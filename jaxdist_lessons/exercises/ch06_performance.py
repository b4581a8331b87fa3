"""The exercises of ``book/06_performance.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    Exercise,
    equals,
)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:

    from jaxdist_lessons import accumulate, benchmark, comms, zero

    n, mesh = ctx["n"], ctx["mesh"]
    work = benchmark.mlp_workload(
        n, width=512, depth=1, per_device_batch=4, in_features=100
    )
    kinds = zero.expected_collectives("fsdp", work.params, n)
    per_step = {
        name: accumulate.bytes_per_step(
            variant(ctx["loss_fn"], mesh, 8), ctx["params"], ctx["batch"], 8
        )
        for name, variant in accumulate.VARIANTS.items()
    }
    (scan_name, scan_bytes), (map_name, map_bytes) = per_step.items()
    params = ctx["gpt_params"]
    tx = ctx["tx"]
    held = zero.expected_state_bytes("fsdp", params, tx.init(params), 3)
    share = held / comms.tree_bytes((params, tx.init(params)))
    once = comms.tree_bytes(ctx["params"])
    return {
        1: Exercise(
            asks="a dict from each kind of collective ('all-gather', 'reduce-scatter', "
            "'all-reduce') to its bytes",
            expected={
                k: Exercise(asks="", expected=v, rel_tol=0.001)
                for k, v in kinds.items()
            },
            kind="dict",
            why="FSDP all-gathers the sharded weights, reduce-scatters their gradients, and "
            "all-reduces what it cannot shard (the parameters whose dimensions do not divide, "
            "and the loss).",
        ),
        2: Exercise(
            asks=f"(bytes per step of {scan_name!r}, bytes per step of {map_name!r})",
            expected=None,
            kind="tuple",
            why="under jit + scan the all-reduce sits in the loop body and runs once per "
            "micro-batch; shard_map accumulates locally and all-reduces once.",
            parts=(
                Exercise(
                    asks="bytes per step (a number)",
                    expected=scan_bytes,
                    unit="bytes",
                    hints=(
                        equals(
                            scan_bytes / 8,
                            "a collective in the scan's body runs once per micro-batch.",
                        ),
                        equals(
                            scan_bytes / 2,
                            "that is what four micro-batches send; this asks about eight.",
                        ),
                    ),
                ),
                Exercise(
                    asks="bytes per step (a number)",
                    expected=map_bytes,
                    unit="bytes",
                    hints=(
                        equals(
                            map_bytes * 8,
                            "shard_map sums the micro-batches locally: one all-reduce, after "
                            "the loop.",
                        ),
                        equals(
                            once * 8,
                            "shard_map sums the micro-batches locally: one all-reduce, after "
                            "the loop.",
                        ),
                    ),
                ),
            ),
        ),
        3: Exercise(
            asks="the fraction of the whole FSDP state that each of 3 devices holds (a "
            "number)",
            expected=share,
            rel_tol=0.01,
            why="the rule shards an array only along a dimension the device count divides; "
            "pick dimensions divisible by the device counts you will use.",
            hints=(
                equals(
                    1 / 3,
                    "that assumes every array splits in three: which of the decoder's "
                    "dimensions does 3 divide?",
                )
                if not math.isclose(share, 1 / 3)
                else equals(math.nan, ""),
            ),
        ),
    }
