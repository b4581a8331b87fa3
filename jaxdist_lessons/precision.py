"""Mixed precision: which dtype the weights are stored, computed and communicated in (chapter 06_performance).

A ``Policy`` names three dtypes:

- ``param_dtype``: how the weights (and so the optimizer's view of them) are stored;
- ``compute_dtype``: what the forward and backward passes run in;
- ``reduce_dtype``: what the gradients are all-reduced in.

The gradient of a float32 weight is float32, whatever the compute dtype, so bf16 compute alone
does not shrink the all-reduce. ``data_parallel_grads`` casts the gradients to ``reduce_dtype``
before its explicit ``pmean``, which is where the bytes are saved, and back afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms
from jaxdist_lessons.tables import Table


@dataclasses.dataclass(frozen=True)
class Policy:
    """Storage, compute and gradient-communication dtypes."""

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    reduce_dtype: Any = jnp.float32

    def cast(self, tree: Any, dtype: Any) -> Any:
        """Every floating-point leaf of ``tree`` as ``dtype``; integer leaves untouched."""
        return jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            tree,
        )

    def to_compute(self, tree: Any) -> Any:
        """``tree`` in the compute dtype."""
        return self.cast(tree, self.compute_dtype)

    def to_param(self, tree: Any) -> Any:
        """``tree`` in the storage dtype."""
        return self.cast(tree, self.param_dtype)

    def to_reduce(self, tree: Any) -> Any:
        """``tree`` in the dtype the gradients travel in."""
        return self.cast(tree, self.reduce_dtype)


POLICIES: dict[str, Policy] = {
    "fp32": Policy(),
    "bf16 compute": Policy(compute_dtype=jnp.bfloat16),
    "bf16 compute and all-reduce": Policy(
        compute_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16
    ),
    "bf16 everything": Policy(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
}


def policy(name: str) -> Policy:
    """The policy called ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in POLICIES:
        raise ValueError(
            f"unknown precision policy {name!r}; allowed: {', '.join(POLICIES)}"
        )
    return POLICIES[name]


def data_parallel_grads(
    loss_fn: Callable[[Any, Any], jax.Array],
    policy: Policy,
    mesh: Mesh,
    data_axis: str = "data",
) -> Callable[[Any, Any], tuple[jax.Array, Any]]:
    """``grads_fn(params, batch) -> (loss, grads)`` under ``shard_map``, all-reducing in
    ``policy.reduce_dtype``.

    The loss runs on the parameters cast to the compute dtype; the gradients come back
    in the parameters' own dtype.
    """

    def grads_fn(params, batch):
        # local gradients, reduced once below
        local_params = lax.pcast(params, data_axis, to="varying")
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(policy.to_compute(p), batch)
        )(local_params)
        grads = lax.pmean(policy.to_reduce(grads), data_axis)
        return lax.pmean(loss, data_axis), jax.tree.map(
            lambda g, p: g.astype(p.dtype), grads, params
        )

    return jax.jit(
        jax.shard_map(
            grads_fn, mesh=mesh, in_specs=(P(), P(data_axis)), out_specs=(P(), P())
        )
    )


def wire_table(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    mesh: Mesh,
    data_axis: str = "data",
) -> Table:
    """The gradient all-reduce of ``data_parallel_grads`` under each of ``POLICIES``: its dtype and bytes.

    Read twice: in the lowered program (what JAX asks for) and in the compiled one (what this
    backend runs). The lowered columns leave out the scalar loss. ``table.values`` holds the rows.
    """
    rows = []
    for name, policy in POLICIES.items():
        placed = jax.device_put(policy.to_param(params), NamedSharding(mesh, P()))
        lowered = data_parallel_grads(loss_fn, policy, mesh, data_axis).lower(
            placed, batch
        )
        asked = [
            c
            for c in comms.collectives(lowered.as_text(dialect="hlo"))
            if c.elements > 1
        ]
        run = comms.collectives(lowered.compile().as_text())
        rows.append(
            [
                name,
                ",".join(sorted({c.dtype for c in asked})),
                sum(c.bytes for c in asked),
                ",".join(sorted({c.dtype for c in run})),
                sum(c.bytes for c in run),
            ]
        )
    headers = ["policy", "lowered dtype", "lowered bytes"]
    headers += [f"compiled ({jax.default_backend()}) dtype", "compiled bytes"]
    return Table(headers, rows, title="The gradient all-reduce, asked for and compiled")
