"""The exercises of ``book/06_performance.md``, and the answers the page includes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons.exercises.checking import (
    Exercise,
    equals,
)


def _on_mesh(work: Any, mesh: Mesh) -> tuple[Any, Any]:
    """A workload's parameters replicated on ``mesh``, its batch split over ``data``."""
    return (
        jax.device_put(work.params, NamedSharding(mesh, P())),
        jax.device_put(work.batch, NamedSharding(mesh, P("data"))),
    )


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:

    from jaxdist_lessons import accumulate, benchmark, comms, zero

    n, mesh, mlp = ctx["n"], ctx["mesh"], ctx["mlp"]
    work = benchmark.mlp_workload(
        n, width=512, depth=1, per_device_batch=4, in_features=100
    )
    kinds = zero.expected_collectives("fsdp", work.params, n)
    params, batch = _on_mesh(mlp, mesh)
    per_step = {
        name: accumulate.bytes_per_step(variant(mlp.loss_fn, mesh, 8), params, batch, 8)
        for name, variant in accumulate.VARIANTS.items()
    }
    (scan_name, scan_bytes), (map_name, map_bytes) = per_step.items()
    gpt_params, tx = ctx["gpt"].params, ctx["tx"]
    held = zero.expected_state_bytes("fsdp", gpt_params, tx.init(gpt_params), 3)
    share = held / comms.tree_bytes((gpt_params, tx.init(gpt_params)))
    once = comms.tree_bytes(mlp.params)
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


# --- The answers ----------------------------------------------------------------------


def answer_1(n: int, mesh: Mesh, tx: optax.GradientTransformation) -> dict[str, int]:
    """The FSDP step's collective bytes on an MLP of widths (100, 512, 10): predicted,
    then measured on the compiled ``shard_map`` step."""
    from jaxdist_lessons import benchmark, comms, zero

    # kernels (100, 512) and (512, 10), biases 512 and 10
    work = benchmark.mlp_workload(
        n, width=512, depth=1, per_device_batch=4, in_features=100
    )
    state = (work.params, tx.init(work.params))
    step = zero.make_step("fsdp", work.loss_fn, tx, mesh, *state)
    state = zero.copy_to(state, zero.state_specs("fsdp", *state, mesh), mesh)
    batch = jax.device_put(work.batch, NamedSharding(mesh, P("data")))
    measured = comms.bytes_by_kind(comms.compiled_text(step, *state, batch))
    predicted = zero.expected_collectives("fsdp", work.params, n)
    print(f"1. predicted {predicted}, measured {measured}")
    return measured


def answer_2(mlp: Any, mesh: Mesh, num_micro: int = 8) -> list[int]:
    """Bytes per step of each accumulation variant with ``num_micro`` micro-batches."""
    from jaxdist_lessons import accumulate

    params = jax.device_put(mlp.params, NamedSharding(mesh, P()))
    batch = jax.device_put(mlp.batch, NamedSharding(mesh, P("data")))
    per_step = []
    for name, variant in accumulate.VARIANTS.items():
        grads_fn = variant(mlp.loss_fn, mesh, num_micro)
        per_step.append(accumulate.bytes_per_step(grads_fn, params, batch, num_micro))
        print(f"2. {name}: {per_step[-1]:,} B per step")
    return per_step


def answer_3(params: Any, tx: optax.GradientTransformation, devices: int = 3) -> float:
    """The share of the whole FSDP state (parameters and optimizer state) that each of
    ``devices`` devices holds."""
    from jaxdist_lessons import comms, zero

    dims = sorted({d for x in jax.tree.leaves(params) for d in x.shape})
    divided = [d for d in dims if d % devices == 0] or "none of them"
    print(f"3. the decoder's dimensions: {dims}; {devices} divides {divided}")
    state = (params, tx.init(params))
    per_device = zero.expected_state_bytes("fsdp", *state, devices)
    total = comms.tree_bytes(state)
    share = per_device / total
    print(f"   each device holds {per_device:,} B of {total:,} ({share:.0%})")
    return share
