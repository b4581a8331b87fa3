"""Dropless experts: every token's choices sorted by expert, the experts' MLPs run as
grouped matrix products (jax.lax.ragged_dot), nothing dropped.

GShard's dispatch (experts.Experts with --dispatch capacity) gives each expert a fixed
number of slots and drops the choices that find it full. Here each device sorts its
(token, choice) pairs by expert and multiplies each expert's contiguous rows by that
expert's weights in one grouped GEMM, the layout of MegaBlocks (Gale et al. 2022,
arXiv:2211.15841), MaxText's ragged MoE and Megatron-LM's grouped GEMM.

Across an 'expert' axis the pairs go to the devices that hold their experts, and come
back, in one of two exchanges. "ragged" (GPUs and TPUs): jax.lax.ragged_all_to_all
sends each device only the rows it gets. "padded" (XLA:CPU, which does not have
ragged_all_to_all): an all_to_all of worst-case-sized buffers, each device sending every
other one room for all of its pairs (a device's tokens may all choose one device's
experts), 'expert' times the pairs. Either way the receiving buffer has that worst-case
size.

Shape suffixes as in model.py's legend (T a batch's tokens flattened, R a token's
routes, E experts, D and F the widths), and the book's for the exchange: X the devices
of the 'expert' axis, L the experts on one device (E = X L), U the (token, route) pairs
flattened, T R of them; Y the rows a device can receive, X U (room for every device's
pairs).
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
    y_TRD = y_UD[jnp.argsort(order_U)].reshape(T, R, -1)  # back in token order
    return jnp.einsum("trd,tr->td", y_TRD, gates_TR.astype(y_TRD.dtype))


def padded_experts(
    x_TD, experts_TR, gates_TR, w_gate_EDF, w_up_EDF, w_down_EFD, axis: str
):
    """local_experts with the experts split over ``axis``: this device holds experts
    i L ... (i + 1) L - 1 of E = X L, X the devices of ``axis``. Its pairs go to their
    experts' devices in an all_to_all of worst-case buffers, are computed there, and
    come back in a second."""
    X = jax.lax.axis_size(axis)
    T, R = experts_TR.shape
    U, L = T * R, w_gate_EDF.shape[0]
    experts_U = experts_TR.reshape(-1)
    order_U, sizes_E = sort_by_expert(experts_U, L * X)
    to_U = experts_U[order_U] // L  # each sorted pair's device
    per_device = sizes_E.reshape(X, L).sum(1)
    row_U = jnp.arange(U) - (jnp.cumsum(per_device) - per_device)[to_U]
    send_XUD = jnp.zeros((X, U, x_TD.shape[1]), x_TD.dtype)
    send_XUD = send_XUD.at[to_U, row_U].set(x_TD[order_U // R])
    local_XU = jnp.full((X, U), L, jnp.int32)  # L: an empty row
    local_XU = local_XU.at[to_U, row_U].set(experts_U[order_U] % L)
    got_XUD = jax.lax.all_to_all(send_XUD, axis, 0, 0)  # got[x]: device x's pairs
    got_experts = jax.lax.all_to_all(local_XU, axis, 0, 0).reshape(-1)
    order, sizes = sort_by_expert(got_experts, L + 1)  # the empty rows last
    y = grouped_mlp(
        got_XUD.reshape(X * U, -1)[order],
        sizes[:L],
        w_gate_EDF,
        w_up_EDF,
        w_down_EFD,
    )
    y_XUD = y[jnp.argsort(order)].reshape(X, U, -1)
    back_XUD = jax.lax.all_to_all(y_XUD, axis, 0, 0)  # back[x]: from device x
    y_UD = back_XUD[to_U, row_U]  # sorted by expert, as sent
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
    """padded_experts with ragged_all_to_all (``exchange``): each device's pairs, sorted
    by expert and so by device, are sent as one slice a device; device x writes the
    slices it gets one after another in source order (the offsets come from an
    all_to_all of the counts), sorts them by its experts, and sends the outputs back
    to where their pairs came from."""
    X = jax.lax.axis_size(axis)
    T, R = experts_TR.shape
    U, L = T * R, w_gate_EDF.shape[0]
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
    experts_U = experts_TR.reshape(-1)
    order_U, sizes_E = sort_by_expert(experts_U, L * X)
    sizes_XL = sizes_E.reshape(X, L)  # pairs for each device's experts
    sent_X = sizes_XL.sum(1)
    starts_X = jnp.cumsum(sent_X) - sent_X  # where each device's slice starts here
    got_XL = jax.lax.all_to_all(sizes_XL, axis, 0, 0)  # got[x, l]: from device x
    got_X = got_XL.sum(1)
    at_X = jnp.cumsum(got_X) - got_X  # where device x's slice starts on this one
    lands_X = jax.lax.all_to_all(at_X, axis, 0, 0, tiled=True)  # where ours land
    room_YD = jnp.zeros((X * U, x_TD.shape[1]), x_TD.dtype)  # Y = X U: worst case
    x_UD = x_TD[order_U // R]  # sorted by expert
    got_YD = exchange(x_UD, room_YD, starts_X, sent_X, lands_X, got_X, axis_name=axis)
    # Each received row's expert: slices in source order, within each by expert;
    # L for the rows past them.
    segments = jnp.append(jnp.tile(jnp.arange(L), X), L)
    lengths = jnp.append(got_XL.reshape(-1), X * U - got_X.sum())
    local_Y = jnp.repeat(segments, lengths, total_repeat_length=X * U)
    order_Y = jnp.argsort(local_Y, stable=True)
    y_YD = grouped_mlp(got_YD[order_Y], got_XL.sum(0), *weights)
    y_YD = y_YD[jnp.argsort(order_Y)]  # back in the order received
    back_X = jax.lax.all_to_all(starts_X, axis, 0, 0, tiled=True)  # as they were sent
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
    """One device's share, in a jax.shard_map over the mesh (experts.py): its
    tokens; the weights gathered over ``width_axis`` (FSDP); the experts split over
    ``expert_axis``, exchanged "padded" or "ragged"; the MLP width split over
    ``mlp_axis`` (tensor parallelism: the partial outputs summed after). The tokens,
    gates and weights come in float32 and are computed with in ``dtype``."""
    x_BTD, gates_BTR = (in_compute_type(a, dtype) for a in (x_BTD, gates_BTR))
    weights = [in_compute_type(w, dtype) for w in (w_gate_EDF, w_up_EDF, w_down_EFD)]
    if width_axis:  # the width's dimension: 1 in gate and up (E, D, F), 2 in down
        weights = [gathered(w, width_axis, dim) for w, dim in zip(weights, (1, 1, 2))]
    flat = flat_tokens(x_BTD, experts_BTR, gates_BTR)
    if expert_axis:
        exchanged = {"padded": padded_experts, "ragged": ragged_experts}[exchange]
        y_TD = exchanged(*flat, *weights, axis=expert_axis)
    else:
        y_TD = local_experts(*flat, *weights)
    if mlp_axis:  # summed in float32 (see in_compute_type)
        y_TD = jax.lax.psum(y_TD.astype(jnp.float32), mlp_axis).astype(dtype)
    return y_TD.reshape(x_BTD.shape)


def in_compute_type(a_f32, dtype):
    """A float32 input, made varying over the manual axes that do not split it while
    still float32, then cast: the sums over devices of its gradient that shard_map's
    transpose writes (one for each such axis) run in float32. XLA:CPU cannot compile
    a bfloat16 one ("Invalid binary instruction opcode copy"), and a float32 sum of
    gradients is what FSDP's reduce_dtype asks for."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    missing = tuple(a for a in manual if a not in jax.typeof(a_f32).mat.varying)
    return jax.lax.pcast(a_f32, missing, to="varying").astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gathered(w, axis: str, dim: int):
    """FSDP's gather of a weight's shards along ``dim``, in the weight's type; its
    gradient reduce-scattered in float32 (as in_compute_type's sums)."""
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
