"""Dropless experts: each token's choices sorted by expert and run as grouped matrix
products (jax.lax.ragged_dot), nothing dropped; MegaBlocks' layout (arXiv:2211.15841).

Across an 'expert' axis the pairs travel by jax.lax.ragged_all_to_all ("ragged") or,
on XLA:CPU, by an all_to_all of worst-case buffers ("padded"). Shapes as in model.py,
plus X the 'expert' axis's devices, L experts a device (E = X L), U (token, route)
pairs (T R), Y = X U the rows a device can receive.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp


def grouped_mlp(x_UD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD):
    """SwiGLU experts on rows sorted by expert: rows sizes_E[0] first go through expert
    0, the next sizes_E[1] through expert 1, ... (rows past the sum: zeros)."""
    gate_UF = jax.lax.ragged_dot(x_UD, w_gate_EDF, sizes_E)
    up_UF = jax.lax.ragged_dot(x_UD, w_up_EDF, sizes_E)
    return jax.lax.ragged_dot(nn.silu(gate_UF) * up_UF, w_down_EFD, sizes_E)


def sort_by_expert(experts_U, num_experts: int):
    """-> (the order that sorts the pairs by expert, the pairs per expert)."""
    order_U = jnp.argsort(experts_U, stable=True)
    return order_U, jnp.bincount(experts_U, length=num_experts)


def local_experts(x_TD, experts_TR, gates_TR, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Each token's output, sum_r gate_r expert_r(x), every expert on this device."""
    T, R = experts_TR.shape
    order_U, sizes_E = sort_by_expert(experts_TR.reshape(-1), w_gate_EDF.shape[0])
    y_UD = grouped_mlp(x_TD[order_U // R], sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD)
    # back in token order
    y_TRD = y_UD[jnp.argsort(order_U)].reshape(T, R, -1)
    return jnp.einsum("trd,tr->td", y_TRD, gates_TR.astype(y_TRD.dtype))


def padded_experts(
    x_TD, experts_TR, gates_TR, w_gate_EDF, w_up_EDF, w_down_EFD, axis: str
):
    """local_experts with the experts split over ``axis`` (device i holds experts i L
    to (i + 1) L - 1); the pairs go and return in all_to_alls of worst-case buffers."""
    X = jax.lax.axis_size(axis)
    T, R = experts_TR.shape
    U, L = T * R, w_gate_EDF.shape[0]
    experts_U = experts_TR.reshape(-1)
    order_U, sizes_E = sort_by_expert(experts_U, L * X)
    # each sorted pair's device
    to_U = experts_U[order_U] // L
    per_device = sizes_E.reshape(X, L).sum(1)
    row_U = jnp.arange(U) - (jnp.cumsum(per_device) - per_device)[to_U]
    send_XUD = jnp.zeros((X, U, x_TD.shape[1]), x_TD.dtype)
    send_XUD = send_XUD.at[to_U, row_U].set(x_TD[order_U // R])
    # expert L marks an empty row
    local_XU = jnp.full((X, U), L, jnp.int32)
    local_XU = local_XU.at[to_U, row_U].set(experts_U[order_U] % L)
    # got_XUD[x]: the pairs device x sent here
    got_XUD = jax.lax.all_to_all(send_XUD, axis, 0, 0)
    got_experts = jax.lax.all_to_all(local_XU, axis, 0, 0).reshape(-1)
    # the empty rows (expert L) sort last
    order, sizes = sort_by_expert(got_experts, L + 1)
    y = grouped_mlp(
        got_XUD.reshape(X * U, -1)[order],
        sizes[:L],
        w_gate_EDF,
        w_up_EDF,
        w_down_EFD,
    )
    y_XUD = y[jnp.argsort(order)].reshape(X, U, -1)
    # back_XUD[x]: the outputs device x computed; read in the order sent (by expert)
    back_XUD = jax.lax.all_to_all(y_XUD, axis, 0, 0)
    y_UD = back_XUD[to_U, row_U]
    y_TRD = y_UD[jnp.argsort(order_U)].reshape(T, R, -1)
    return jnp.einsum("trd,tr->td", y_TRD, gates_TR.astype(y_TRD.dtype))


def ragged_experts(
    x_TD,
    experts_TR,
    gates_TR,
    w_gate_EDF,
    w_up_EDF,
    w_down_EFD,
    axis: str,
    exchange=jax.lax.ragged_all_to_all,
):
    """padded_experts with ragged_all_to_all (``exchange``): one slice of sorted pairs
    to each device, written there in source order at offsets from an all_to_all of
    the counts; the outputs return the same way."""
    X = jax.lax.axis_size(axis)
    T, R = experts_TR.shape
    U, L = T * R, w_gate_EDF.shape[0]
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
    experts_U = experts_TR.reshape(-1)
    order_U, sizes_E = sort_by_expert(experts_U, L * X)
    # sizes_XL[x, l]: this device's pairs for expert l of device x
    sizes_XL = sizes_E.reshape(X, L)
    sent_X = sizes_XL.sum(1)
    # where each device's slice starts in this device's sorted pairs
    starts_X = jnp.cumsum(sent_X) - sent_X
    # got_XL[x, l]: the pairs device x sends for this device's expert l
    got_XL = jax.lax.all_to_all(sizes_XL, axis, 0, 0)
    got_X = got_XL.sum(1)
    # where device x's slice starts in this device's receiving buffer
    at_X = jnp.cumsum(got_X) - got_X
    # where this device's slices land on the others
    lands_X = jax.lax.all_to_all(at_X, axis, 0, 0, tiled=True)
    # Y = X U rows: the worst case, every device's pairs all sent here
    room_YD = jnp.zeros((X * U, x_TD.shape[1]), x_TD.dtype)
    x_UD = x_TD[order_U // R]
    got_YD = exchange(x_UD, room_YD, starts_X, sent_X, lands_X, got_X, axis_name=axis)
    # Each received row's expert: slices in source order, within each by expert;
    # L for the rows past them.
    segments = jnp.append(jnp.tile(jnp.arange(L), X), L)
    lengths = jnp.append(got_XL.reshape(-1), X * U - got_X.sum())
    local_Y = jnp.repeat(segments, lengths, total_repeat_length=X * U)
    order_Y = jnp.argsort(local_Y, stable=True)
    y_YD = grouped_mlp(got_YD[order_Y], got_XL.sum(0), *weights)
    # back in the order received
    y_YD = y_YD[jnp.argsort(order_Y)]
    # The outputs return to where their pairs were sent from.
    back_X = jax.lax.all_to_all(starts_X, axis, 0, 0, tiled=True)
    room_UD = jnp.zeros((U, y_YD.shape[1]), y_YD.dtype)
    y_UD = exchange(y_YD, room_UD, at_X, got_X, back_X, sent_X, axis_name=axis)
    y_TRD = y_UD[jnp.argsort(order_U)].reshape(T, R, -1)
    return jnp.einsum("trd,tr->td", y_TRD, gates_TR.astype(y_TRD.dtype))


def on_device(
    x_BTD,
    experts_BTR,
    gates_BTR,
    w_gate_EDF,
    w_up_EDF,
    w_down_EFD,
    expert_axis=None,
    width_axis=None,
    mlp_axis=None,
    exchange="padded",
    dtype=jnp.float32,
):
    """One device's share of the experts' output, inside experts.py's jax.shard_map;
    float32 inputs, computed with in ``dtype``."""
    # The weights are gathered over width_axis (FSDP), the experts split over
    # expert_axis and the MLP width over mlp_axis (tensor parallelism).
    x_BTD, gates_BTR = (in_compute_type(a, dtype) for a in (x_BTD, gates_BTR))
    weights = [in_compute_type(w, dtype) for w in (w_gate_EDF, w_up_EDF, w_down_EFD)]
    # The width D is dimension 1 of gate and up (E, D, F) and 2 of down (E, F, D).
    if width_axis:
        weights = [gathered(w, width_axis, dim) for w, dim in zip(weights, (1, 1, 2))]
    flat = flat_tokens(x_BTD, experts_BTR, gates_BTR)
    if expert_axis:
        exchanged = {"padded": padded_experts, "ragged": ragged_experts}[exchange]
        y_TD = exchanged(*flat, *weights, axis=expert_axis)
    else:
        y_TD = local_experts(*flat, *weights)
    # The partial outputs are summed in float32, as in in_compute_type.
    if mlp_axis:
        y_TD = jax.lax.psum(y_TD.astype(jnp.float32), mlp_axis).astype(dtype)
    return y_TD.reshape(x_BTD.shape)


def in_compute_type(a_f32, dtype):
    """``a_f32`` cast to ``dtype``, made varying over the manual axes first."""
    # pcast while still float32: the gradient's sums over those axes, which shard_map's
    # transpose writes, then run in float32, as FSDP's reduce_dtype asks; XLA:CPU
    # cannot compile a bfloat16 one ("Invalid binary instruction opcode copy").
    manual = jax.sharding.get_abstract_mesh().manual_axes
    missing = tuple(a for a in manual if a not in jax.typeof(a_f32).mat.varying)
    return jax.lax.pcast(a_f32, missing, to="varying").astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gathered(w, axis: str, dim: int):
    """FSDP's gather of a weight's shards; its gradient reduce-scattered in float32."""
    return jax.lax.all_gather(w, axis, axis=dim, tiled=True)


def _gathered_forward(w, axis, dim):
    return gathered(w, axis, dim), None


def _gathered_backward(axis, dim, _, g):
    g32 = jax.lax.psum_scatter(
        g.astype(jnp.float32), axis, scatter_dimension=dim, tiled=True
    )
    return (g32.astype(g.dtype),)


gathered.defvjp(_gathered_forward, _gathered_backward)


def flat_tokens(x_BTD, experts_BTR, gates_BTR):
    """(B, T, ...) -> (B T, ...): the batch's tokens flattened."""
    R = experts_BTR.shape[-1]
    return (
        x_BTD.reshape(-1, x_BTD.shape[-1]),
        experts_BTR.reshape(-1, R),
        gates_BTR.reshape(-1, R),
    )
