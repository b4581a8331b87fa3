"""Gradient accumulation over micro-batches, two ways, and how often each one communicates (chapter 06_performance).

Both compute the gradient of the mean loss over the whole global batch, split into ``num_micro``
micro-batches that ``lax.scan`` visits one after the other:

- ``naive_grads``: written for the global batch and jitted with the batch sharded over ``data``.
  Every micro-step's gradient is a mean over a sharded dimension, so the compiler puts the
  all-reduce **inside the loop**: one all-reduce per micro-batch.
- ``local_grads``: ``shard_map``; each device accumulates the gradients of *its own* rows, then
  one ``pmean`` after the loop: one all-reduce per step, however many micro-batches.

Each returns ``grads_fn(params, batch) -> (loss, grads)``, jitted, for a ``loss_fn(params, batch)``
that returns a mean over the batch's leading dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, data
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.tables import Table

LossFn = Callable[[Any, Any], jax.Array]
GradsFn = Callable[[Any, Any], tuple[jax.Array, Any]]


def split_micro(batch: Any, num_micro: int, devices: int = 1) -> Any:
    """Every leaf ``(B, ...)`` as ``(num_micro, B // num_micro, ...)``; micro-batch ``i`` holds rows ``i, i+k, ...``.

    Taking every ``k``-th row (not ``k`` contiguous blocks) keeps each micro-batch spread over all
    devices when the rows are sharded, so no row has to move. Inside ``shard_map`` the batch is one
    device's rows: ``devices`` (the devices sharing the global batch) makes the error say so.
    """
    positive_int("num_micro", num_micro)
    return data.split_rows(
        batch, num_micro, strided=True, devices=devices, what="micro-batches"
    )


def _accumulate(
    loss_fn: LossFn, params: Any, micro: Any, num_micro: int
) -> tuple[jax.Array, Any]:
    """Mean loss and mean gradient over the micro-batches, summed in a ``lax.scan``."""

    def body(grads_sum, micro_batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, micro_batch)
        return jax.tree.map(jnp.add, grads_sum, grads), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads_sum, losses = lax.scan(body, zeros, micro)
    return losses.mean(), jax.tree.map(lambda g: g / num_micro, grads_sum)


def naive_grads(
    loss_fn: LossFn, mesh: Mesh, num_micro: int, data_axis: str = "data"
) -> GradsFn:
    """Accumulation under plain ``jit``: the compiler all-reduces each micro-batch's
    gradient, in the loop."""
    positive_int("num_micro", num_micro)

    def grads_fn(params, batch):
        return _accumulate(loss_fn, params, split_micro(batch, num_micro), num_micro)

    replicated = NamedSharding(mesh, P())
    return jax.jit(
        grads_fn,
        in_shardings=(replicated, NamedSharding(mesh, P(data_axis))),
        out_shardings=(replicated, replicated),
    )


def local_grads(
    loss_fn: LossFn, mesh: Mesh, num_micro: int, data_axis: str = "data"
) -> GradsFn:
    """Accumulation in ``shard_map``: local gradients summed on each device, then one
    ``pmean``."""
    positive_int("num_micro", num_micro)

    def grads_fn(params, batch):
        # Differentiate a per-device ("varying") copy: the gradient of a replicated
        # input would be summed over devices by autodiff, at every micro-step.
        local_params = lax.pcast(params, data_axis, to="varying")
        micro = split_micro(batch, num_micro, devices=mesh.shape[data_axis])
        loss, grads = _accumulate(loss_fn, local_params, micro, num_micro)
        return lax.pmean(loss, data_axis), lax.pmean(grads, data_axis)

    return jax.jit(
        jax.shard_map(
            grads_fn, mesh=mesh, in_specs=(P(), P(data_axis)), out_specs=(P(), P())
        )
    )


VARIANTS: dict[str, Callable[..., GradsFn]] = {
    "jit + scan": naive_grads,
    "shard_map, local": local_grads,
}


COMPARISON_HEADERS = [
    "variant",
    "all-reduces",
    "of them in the loop",
    "gradients sent per step",
    "bytes per step",
    "max |grad - full-batch grad|",
]


def bytes_per_step(grads_fn: GradsFn, params: Any, batch: Any, num_micro: int) -> int:
    """Collective bytes per device one call sends: a collective in the loop body counts ``num_micro`` times."""
    found = comms.collectives(comms.compiled_text(grads_fn, params, batch))
    return sum(c.bytes * (num_micro if c.in_loop else 1) for c in found)


def comparison_table(
    loss_fn: LossFn, params: Any, batch: Any, mesh: Mesh, num_micro: int
) -> Table:
    """Each of ``VARIANTS`` on ``mesh``: its all-reduces (in the loop or not), bytes per step, and error.

    The error is the largest difference from the gradient one device computes on the whole batch.
    ``table.values`` holds the numbers, one row per variant under ``COMPARISON_HEADERS``.
    """
    # one device, the whole batch: the reference
    whole = jax.device_get((params, batch))
    reference = jax.jit(jax.grad(loss_fn))(*whole)
    rows = []
    for name, variant in VARIANTS.items():
        grads_fn = variant(loss_fn, mesh, num_micro)
        found = comms.collectives(comms.compiled_text(grads_fn, params, batch))
        grads = grads_fn(params, batch)[1]
        error = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference))
        )
        per_step = sum(c.bytes * (num_micro if c.in_loop else 1) for c in found)
        rows.append(
            [
                name,
                len(found),
                sum(c.in_loop for c in found),
                per_step // comms.tree_bytes(params),
                per_step,
                error,
            ]
        )
    title = f"{num_micro} micro-batches, {mesh.size} devices"
    return Table(COMPARISON_HEADERS, rows, title=title)
