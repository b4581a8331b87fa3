"""A GPipe-style pipeline over a ``'pipeline'`` mesh axis, with ``jax.shard_map`` and ``ppermute`` (chapter 10).

Naming a mesh axis ``'pipeline'`` pipelines nothing: JAX has no pipeline scheduler. Here is one.
The model is cut into ``S`` stages of the same shape (for example, transformer blocks); device
``s`` on the ``'pipeline'`` axis holds stage ``s``'s parameters. The batch is cut into ``M``
microbatches. At every tick each device applies its stage to what it holds, then passes the
result to the next device with ``jax.lax.ppermute``. Microbatch ``j`` enters stage 0 at tick
``j`` and leaves the last stage at tick ``j + S - 1``, so the whole batch takes ``M + S - 1``
ticks, of which each device works ``M``: the idle share, the *bubble*, is ``(S - 1) / (M + S - 1)``.

``jax.grad`` through ``pipeline_apply`` gives the backward pass, the same schedule in reverse
(the transpose of a ``ppermute`` is the opposite ``ppermute``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons._checks import positive_int

StageFn = Callable[[Any, jax.Array], jax.Array]


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The share of device time idle in a GPipe forward (or backward) pass: ``(S - 1) / (M + S - 1)``."""
    positive_int("num_stages", num_stages)
    positive_int("num_microbatches", num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def schedule(num_stages: int, num_microbatches: int) -> list[list[int | None]]:
    """Which microbatch each stage works on at each tick (``None``: idle), ``[tick][stage]``."""
    positive_int("num_stages", num_stages)
    positive_int("num_microbatches", num_microbatches)
    ticks = num_microbatches + num_stages - 1
    return [
        [t - s if 0 <= t - s < num_microbatches else None for s in range(num_stages)]
        for t in range(ticks)
    ]


def idle_fraction(table: list[list[int | None]]) -> float:
    """The share of (tick, stage) slots in a schedule with nothing to do."""
    slots = [slot for row in table for slot in row]
    return sum(slot is None for slot in slots) / len(slots)


def sequential_apply(stage_fn: StageFn, stage_params: Any, x: jax.Array) -> jax.Array:
    """The model without a pipeline: every stage in turn, on the whole batch, on one device."""
    num_stages = jax.tree.leaves(stage_params)[0].shape[0]
    for s in range(num_stages):
        x = stage_fn(jax.tree.map(lambda p, s=s: p[s], stage_params), x)
    return x


def pipeline_apply(
    stage_fn: StageFn,
    stage_params: Any,
    x: jax.Array,
    mesh: Mesh,
    num_microbatches: int,
    axis: str = "pipeline",
) -> jax.Array:
    """``sequential_apply`` run as a GPipe pipeline: stage ``s`` on device ``s`` of ``axis``.

    ``stage_params`` has a leading dimension of size ``mesh.shape[axis]`` (one slice per stage);
    ``stage_fn(params, x)`` must return an array shaped like ``x``. ``x``'s leading (batch)
    dimension is cut into ``num_microbatches`` microbatches. Other mesh axes hold copies.
    """
    num_stages = mesh.shape[axis]
    leading = {p.shape[0] for p in jax.tree.leaves(stage_params)}
    if leading != {num_stages}:
        raise ValueError(
            f"stage_params must have a leading dimension of {num_stages} (the size of mesh axis "
            f"{axis!r}), one slice per stage; got leading sizes {sorted(leading)}"
        )
    positive_int("num_microbatches", num_microbatches)
    if x.shape[0] % num_microbatches:
        raise ValueError(
            f"batch of {x.shape[0]} cannot be cut into {num_microbatches} equal microbatches"
        )
    micro_MBX = x.reshape(num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:])
    forward = [(s, s + 1) for s in range(num_stages - 1)]  # the last stage sends nothing on

    def per_device(params: Any, micro_MBX: jax.Array) -> jax.Array:
        params = jax.tree.map(lambda p: p[0], params)  # this device's stage
        stage = jax.lax.axis_index(axis)
        is_first, is_last = stage == 0, stage == num_stages - 1

        def tick(
            carry: tuple[jax.Array, jax.Array], t: jax.Array
        ) -> tuple[tuple[jax.Array, jax.Array], None]:
            held, outputs = carry
            # Stage 0 takes the next microbatch; the others work on what the previous stage sent.
            fresh = jax.lax.dynamic_index_in_dim(
                micro_MBX, jnp.minimum(t, num_microbatches - 1), keepdims=False
            )
            out = stage_fn(params, jnp.where(is_first, fresh, held))
            done = t - (num_stages - 1)  # the microbatch leaving the last stage now, if any
            written = jax.lax.dynamic_update_index_in_dim(
                outputs, out, jnp.maximum(done, 0), 0
            )
            outputs = jnp.where(is_last & (done >= 0), written, outputs)
            return (jax.lax.ppermute(out, axis, forward), outputs), None

        ticks = jnp.arange(num_microbatches + num_stages - 1)
        # The carry differs from device to device ("varies" over the axis): say so from the start.
        start = jax.lax.pcast(
            (jnp.zeros_like(micro_MBX[0]), jnp.zeros_like(micro_MBX)), (axis,), to="varying"
        )
        (_, outputs), _ = jax.lax.scan(tick, start, ticks)
        # Only the last stage holds the results; a sum over the axis hands them to every device.
        return jax.lax.psum(jnp.where(is_last, outputs, 0.0), axis)

    if (
        AxisType.Explicit in mesh.axis_types
    ):  # arrays carry their sharding in their type: place them first
        stage_params = jax.reshard(stage_params, NamedSharding(mesh, P(axis)))
        micro_MBX = jax.reshard(micro_MBX, NamedSharding(mesh, P()))
    out_MBX = jax.shard_map(per_device, mesh=mesh, in_specs=(P(axis), P()), out_specs=P())(
        stage_params, micro_MBX
    )
    return out_MBX.reshape(x.shape)


def stack_stages(
    init_fn: Callable[[jax.Array], Any], rng: jax.Array, num_stages: int
) -> Any:
    """Parameters for ``num_stages`` stages, stacked on a new leading axis: ``init_fn(rng)`` per stage."""
    positive_int("num_stages", num_stages)
    return jax.vmap(init_fn)(jax.random.split(rng, num_stages))
