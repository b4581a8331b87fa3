"""Mixture of experts: a top-k router with a capacity, dispatch by einsum or by all-to-all (chapter 13_experts).

Shape suffixes: see jaxdist_lessons.models.

- ``route`` picks each token's top-k experts and a slot in each, dropping what is beyond capacity
  (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021); the slots are the
  recipe's ``expert_slots`` (``jaxdist_lm/experts.py``), one group of tokens at a time;
- ``moe_einsum`` dispatches and combines with one-hot tensors on one device (or under ``jit``'s
  own partitioning); ``moe_all_to_all`` does it with ``jax.lax.all_to_all`` in ``jax.shard_map``
  over an ``expert`` mesh axis, each device holding E/n experts;
- ``moe_reference`` runs every token through its chosen experts with no capacity: the two layers
  must equal it when no token is dropped.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


class Routing(NamedTuple):
    """Where each token goes, with what weight, and the router's statistics (for one token group)."""

    dispatch_TEM: jax.Array  # 1 where token t takes slot m of expert e
    combine_TEM: jax.Array  # the token's gate at the same places
    dropped: jax.Array  # (token, choice) pairs that found their expert full
    # share of the (token, choice) pairs that chose expert e (Switch's f)
    fraction_E: jax.Array
    mean_prob_E: jax.Array  # the router's mean probability for expert e (Switch's P)
    z_loss: jax.Array


class MoeStats(NamedTuple):
    """A layer's auxiliary losses and its count of dropped (token, choice) pairs."""

    balance_loss: jax.Array
    z_loss: jax.Array
    dropped: jax.Array


def capacity(
    num_tokens: int, num_experts: int, top_k: int, capacity_factor: float
) -> int:
    """Slots per expert: ``ceil(k * tokens * capacity_factor / experts)``."""
    return math.ceil(top_k * num_tokens * capacity_factor / num_experts)


def init_params(key: jax.Array, width: int, mlp_width: int, num_experts: int) -> dict:
    """A router and ``num_experts`` two-layer MLPs, in float32."""
    k_router, k_in, k_out = jax.random.split(key, 3)
    return {
        "router_DE": jax.random.normal(k_router, (width, num_experts))
        / math.sqrt(width),
        "w_in_EDF": jax.random.normal(k_in, (num_experts, width, mlp_width))
        / math.sqrt(width),
        "w_out_EFD": jax.random.normal(k_out, (num_experts, mlp_width, width))
        / math.sqrt(mlp_width),
    }


def top_k_gates(logits_TE: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Each token's ``top_k`` experts and their gates: softmax probabilities (renormalised for k > 1)."""
    gates_TR, experts_TR = jax.lax.top_k(jax.nn.softmax(logits_TE, axis=-1), top_k)
    if top_k > 1:  # GShard's top-2: the two gates sum to 1
        gates_TR = gates_TR / gates_TR.sum(axis=-1, keepdims=True)
    return gates_TR, experts_TR


def route(logits_TE: jax.Array, top_k: int, capacity: int) -> Routing:
    """Top-k routing with ``capacity`` slots per expert; first choices take slots before
    second ones."""
    num_tokens, num_experts = logits_TE.shape
    gates_TR, experts_TR = top_k_gates(logits_TE, top_k)
    choice_RTE = jax.nn.one_hot(experts_TR.T, num_experts)
    # The recipe's slots (jaxdist_lm/experts.py): first come, first served, per expert.
    from jaxdist_lm.experts import expert_slots as slots

    dispatch_TEM, combine_TEM, kept_RT = slots(choice_RTE, gates_TR, capacity)
    return Routing(
        dispatch_TEM=dispatch_TEM,
        combine_TEM=combine_TEM,
        dropped=(~kept_RT).sum(),
        fraction_E=choice_RTE.mean(axis=(0, 1)),
        mean_prob_E=jax.nn.softmax(logits_TE, axis=-1).mean(axis=0),
        z_loss=jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2),
    )


def balance_loss(fraction_E: jax.Array, mean_prob_E: jax.Array) -> jax.Array:
    """Switch Transformer's load-balancing loss ``E * sum_e f_e P_e`` (1 when the load is uniform)."""
    return fraction_E.shape[0] * jnp.sum(fraction_E * mean_prob_E)


def expert_mlp(params: dict, x_EMD: jax.Array) -> jax.Array:
    """Each expert's MLP on its own slots."""
    h_EMF = jax.nn.gelu(jnp.einsum("emd,edf->emf", x_EMD, params["w_in_EDF"]))
    return jnp.einsum("emf,efd->emd", h_EMF, params["w_out_EFD"])


def moe_einsum(
    params: dict, x_TD: jax.Array, top_k: int, capacity_factor: float
) -> tuple[jax.Array, MoeStats]:
    """The layer with one-hot dispatch and combine tensors (GShard/Switch style)."""
    logits_TE = x_TD @ params["router_DE"]
    num_tokens, num_experts = logits_TE.shape
    r = route(
        logits_TE, top_k, capacity(num_tokens, num_experts, top_k, capacity_factor)
    )
    x_EMD = jnp.einsum("tem,td->emd", r.dispatch_TEM.astype(x_TD.dtype), x_TD)
    y_EMD = expert_mlp(params, x_EMD)
    y_TD = jnp.einsum("tem,emd->td", r.combine_TEM.astype(x_TD.dtype), y_EMD)
    return y_TD, MoeStats(
        balance_loss(r.fraction_E, r.mean_prob_E), r.z_loss, r.dropped
    )


def moe_reference(params: dict, x_TD: jax.Array, top_k: int) -> jax.Array:
    """Every token through its chosen experts, weighted by its gates, with no capacity limit."""
    gates_TR, experts_TR = top_k_gates(x_TD @ params["router_DE"], top_k)
    num_experts = params["router_DE"].shape[1]
    weights_TE = jnp.einsum(
        "tr,tre->te", gates_TR, jax.nn.one_hot(experts_TR, num_experts)
    )
    y_ETD = expert_mlp(params, jnp.broadcast_to(x_TD, (num_experts, *x_TD.shape)))
    return jnp.einsum("te,etd->td", weights_TE, y_ETD)


def moe_all_to_all(
    params: dict, x_TD: jax.Array, top_k: int, capacity_factor: float, mesh: Mesh
) -> tuple[jax.Array, MoeStats]:
    """The layer over an ``expert`` mesh axis: tokens go to their expert's device and
    come back.

    Tokens are split over every axis of ``mesh`` (``expert``, and ``data`` if there is
    one); each device routes its own tokens, with a capacity computed from its own token
    count.
    """
    token_axes = tuple(mesh.axis_names)
    n = mesh.shape["expert"]

    def per_device(params, x_TD):
        logits_TE = x_TD @ params["router_DE"]
        num_tokens, num_experts = logits_TE.shape
        cap = capacity(num_tokens, num_experts, top_k, capacity_factor)
        r = route(logits_TE, top_k, cap)
        # in the activations' dtype: a float32 one-hot would double a bf16 buffer
        x_EMD = jnp.einsum("tem,td->emd", r.dispatch_TEM.astype(x_TD.dtype), x_TD)
        # Block s of the experts goes to device s; what comes back is stacked by sender.
        x_XLMD = jax.lax.all_to_all(
            x_EMD.reshape(n, -1, cap, x_TD.shape[1]), "expert", 0, 0, tiled=True
        )
        x_LMD = x_XLMD.transpose(1, 0, 2, 3).reshape(num_experts // n, n * cap, -1)
        y_XLMD = (
            expert_mlp(params, x_LMD)
            .reshape(-1, n, cap, x_TD.shape[1])
            .transpose(1, 0, 2, 3)
        )
        y_EMD = jax.lax.all_to_all(y_XLMD, "expert", 0, 0, tiled=True).reshape(
            x_EMD.shape
        )
        y_TD = jnp.einsum("tem,emd->td", r.combine_TEM.astype(x_TD.dtype), y_EMD)
        fraction_E, mean_prob_E, z_loss = jax.lax.pmean(
            (r.fraction_E, r.mean_prob_E, r.z_loss), token_axes
        )
        stats = MoeStats(
            balance_loss(fraction_E, mean_prob_E),
            z_loss,
            jax.lax.psum(r.dropped, token_axes),
        )
        return y_TD, stats

    specs = {"router_DE": P(), "w_in_EDF": P("expert"), "w_out_EFD": P("expert")}
    # arrays carry their sharding: place them first
    if AxisType.Explicit in mesh.axis_types:
        params = jax.reshard(
            params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        )
        x_TD = jax.reshard(x_TD, NamedSharding(mesh, P(token_axes)))
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(specs, P(token_axes)),
        out_specs=(P(token_axes), P()),
    )(params, x_TD)


def dropped_fraction(logits_TE: jax.Array, top_k: int, capacity_factor: float) -> float:
    """Share of the (token, choice) pairs that ``route`` drops at this capacity factor."""
    num_tokens, num_experts = logits_TE.shape
    slots = capacity(num_tokens, num_experts, top_k, capacity_factor)
    dropped = jax.jit(route, static_argnums=(1, 2))(logits_TE, top_k, slots).dropped
    return float(dropped) / (top_k * num_tokens)


def router_logits(
    key: jax.Array, num_tokens: int, num_experts: int, skew: float = 0.0
) -> jax.Array:
    """Random router logits; ``skew > 0`` adds ``-skew * log(1 + e)`` so that low experts are favoured."""
    bias_E = -skew * jnp.log1p(jnp.arange(num_experts, dtype=jnp.float32))
    return jax.random.normal(key, (num_tokens, num_experts)) + bias_E


def all_to_all_bytes(
    num_experts: int, capacity: int, width: int, itemsize: int = 4
) -> int:
    """Bytes of one all-to-all's result on each device: the local capacity buffer ``E * M * D``."""
    return num_experts * capacity * width * itemsize
