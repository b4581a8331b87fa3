"""Dropless experts: every token's choices sorted by expert, the experts' MLPs run as
grouped matrix products (jax.lax.ragged_dot), nothing dropped.

GShard's dispatch (model.Experts with --dispatch capacity) gives each expert a fixed
number of slots and drops the choices that find it full. Here each device sorts its
(token, choice) pairs by expert and multiplies each expert's contiguous rows by that
expert's weights in one grouped GEMM, the layout of MegaBlocks (Gale et al. 2022,
arXiv:2211.15841), MaxText's ragged MoE and Megatron-LM's grouped GEMM.

Across an 'expert' axis the pairs go to the devices that hold their experts with an
all_to_all of worst-case-sized buffers: each device sends every other one room for all
of its pairs (a device's tokens may all choose one device's experts), so the buffers
are 'expert' times the pairs. jax.lax.ragged_all_to_all sends only the rows there are;
XLA:CPU, where this recipe is tested, does not have it, so it is not used yet.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def grouped_mlp(x_SD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD):
    """SwiGLU experts on rows sorted by expert: rows sizes_E[0] first go through expert
    0, the next sizes_E[1] through expert 1, ... (rows past the sum: zeros)."""
    gate_SF = jax.lax.ragged_dot(x_SD, w_gate_EDF, sizes_E)
    up_SF = jax.lax.ragged_dot(x_SD, w_up_EDF, sizes_E)
    return jax.lax.ragged_dot(nn.silu(gate_SF) * up_SF, w_down_EFD, sizes_E)


def sort_by_expert(experts_S, num_experts: int):
    """-> (the order that sorts the pairs by expert, the pairs per expert)."""
    order_S = jnp.argsort(experts_S, stable=True)
    return order_S, jnp.bincount(experts_S, length=num_experts)


def local_experts(x_ND, experts_NR, gates_NR, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Each token's output, sum_r gate_r expert_r(x), every expert on this device."""
    N, R = experts_NR.shape  # noqa: N806
    order_S, sizes_E = sort_by_expert(experts_NR.reshape(-1), w_gate_EDF.shape[0])
    y_SD = grouped_mlp(x_ND[order_S // R], sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD)
    y_NRD = y_SD[jnp.argsort(order_S)].reshape(N, R, -1)  # back in token order
    return jnp.einsum("nrd,nr->nd", y_NRD, gates_NR.astype(y_NRD.dtype))


def exchanged_experts(
    x_ND, experts_NR, gates_NR, w_gate_EDF, w_up_EDF, w_down_EFD, axis: str
):
    """local_experts with the experts split over ``axis``: this device holds experts
    i E_l ... (i + 1) E_l - 1 of E = E_l x devices. Its pairs go to their experts'
    devices in an all_to_all of worst-case buffers, are computed there, and come back
    in a second."""
    devices = jax.lax.axis_size(axis)
    N, R = experts_NR.shape  # noqa: N806
    S, E_l = N * R, w_gate_EDF.shape[0]  # noqa: N806
    experts_S = experts_NR.reshape(-1)
    order_S, sizes_E = sort_by_expert(experts_S, E_l * devices)
    to_S = experts_S[order_S] // E_l  # each sorted pair's device
    per_device = sizes_E.reshape(devices, E_l).sum(1)
    row_S = jnp.arange(S) - (jnp.cumsum(per_device) - per_device)[to_S]
    send_ISD = jnp.zeros((devices, S, x_ND.shape[1]), x_ND.dtype)
    send_ISD = send_ISD.at[to_S, row_S].set(x_ND[order_S // R])
    local_IS = jnp.full((devices, S), E_l, jnp.int32)  # E_l: an empty row
    local_IS = local_IS.at[to_S, row_S].set(experts_S[order_S] % E_l)
    got_ISD = jax.lax.all_to_all(send_ISD, axis, 0, 0)  # got[i]: device i's pairs
    got_experts = jax.lax.all_to_all(local_IS, axis, 0, 0).reshape(-1)
    order, sizes = sort_by_expert(got_experts, E_l + 1)  # the empty rows last
    y = grouped_mlp(
        got_ISD.reshape(devices * S, -1)[order], sizes[:E_l],
        w_gate_EDF, w_up_EDF, w_down_EFD,
    )  # fmt: skip
    y_ISD = y[jnp.argsort(order)].reshape(devices, S, -1)
    back_ISD = jax.lax.all_to_all(y_ISD, axis, 0, 0)  # back[i]: from device i
    y_SD = back_ISD[to_S, row_S]  # sorted by expert, as sent
    y_NRD = y_SD[jnp.argsort(order_S)].reshape(N, R, -1)
    return jnp.einsum("nrd,nr->nd", y_NRD, gates_NR.astype(y_NRD.dtype))


def on_device(
    x_BTD, experts_BTR, gates_BTR, w_gate_EDF, w_up_EDF, w_down_EFD,
    expert_axis=None, width_axis=None, mlp_axis=None,
):  # fmt: skip
    """One device's share, in a jax.shard_map over the mesh (model.Experts): its
    tokens; the weights gathered over ``width_axis`` (FSDP); the experts split over
    ``expert_axis``; the MLP width split over ``mlp_axis`` (tensor parallelism: the
    partial outputs summed after)."""
    if width_axis:
        gather = lambda w, dim: jax.lax.all_gather(w, width_axis, axis=dim, tiled=True)
        w_gate_EDF, w_up_EDF = gather(w_gate_EDF, 1), gather(w_up_EDF, 1)
        w_down_EFD = gather(w_down_EFD, 2)
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
    flat = flat_tokens(x_BTD, experts_BTR, gates_BTR)
    if expert_axis:
        y_ND = exchanged_experts(*flat, *weights, axis=expert_axis)
    else:
        y_ND = local_experts(*flat, *weights)
    if mlp_axis:
        y_ND = jax.lax.psum(y_ND, mlp_axis)
    return y_ND.reshape(x_BTD.shape)


def flat_tokens(x_BTD, experts_BTR, gates_BTR):
    """(B, T, ...) -> (B T, ...)."""
    R = experts_BTR.shape[-1]  # noqa: N806
    return (
        x_BTD.reshape(-1, x_BTD.shape[-1]),
        experts_BTR.reshape(-1, R),
        gates_BTR.reshape(-1, R),
    )
