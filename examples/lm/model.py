"""A Llama-style decoder in Flax Linen; each weight and activation names its axes.

RMSNorm, rotary positions (RoPE), grouped-query attention four ways (XLA's reference
jax.nn.dot_product_attention; cuDNN's fused kernel on NVIDIA GPUs; splash, JAX's Pallas
kernel for TPUs (splash.py); or chunked: blocks of an online softmax in plain JAX,
memory linear in the sequence) or, with the sequence split over devices, ring
attention, whose steps use the chunked blocks; a SwiGLU MLP
or a mixture of SwiGLU experts; and a scan over the layers with a rematerialisation
policy. The names ("embed", "mlp", "heads", ...) say what an axis means; the rules in
layout.py say which mesh axis, if any, splits it.

Shape suffixes (one letter per axis; lowercase in einsum subscripts), the book's legend
for the letters used here:

    B  batch (examples in a batch)
    T  tokens: positions in a sequence; also a batch's tokens flattened, or a routing
       group's tokens
    S  key/value positions in attention, where they differ from the queries' T
    D  model width (embedding width)
    N  attention (query) heads
    K  key/value heads (grouped-query attention; K = N without it)
    Q  query heads that share one key/value head (N = K * Q)
    A  width of one attention head
    F  MLP hidden width
    V  vocabulary
    E  experts
    M  slots per expert (its capacity)
    R  a token's routes: its top-k expert choices
    G  routing groups (tokens routed together)
"""

import dataclasses
import functools
import math

import dropless
import flax.linen as nn
import jax
import jax.numpy as jnp
import splash
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from model_config import ModelConfig, RopeScaling

REMAT_POLICIES = {
    "none": None,  # keep every activation for the backward pass
    "full": jax.checkpoint_policies.nothing_saveable,  # keep each layer's input only
    # keep the matmuls' outputs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
# --offload activations: full remat, with each layer's input (the one activation that
# full remat keeps) moved to the host's pinned memory in the forward pass and back for
# the backward (JAX's memory kinds, the policy of the JAX docs' "Gradient
# checkpointing" page). Block names its input LAYER_INPUT for it.
LAYER_INPUT = "layer_input"
OFFLOADED = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[LAYER_INPUT],
    offload_src="device",
    offload_dst="pinned_host",
)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's layout by its logical axes (no-op outside the rules)."""
    return nn.with_logical_constraint(x, names)


def weight(init, names: tuple[str, ...]):
    return nn.with_logical_partitioning(init, names)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", weight(nn.initializers.ones, ("embed",)), x_BTD.shape[-1:]
        )
        # the statistics in float32, whatever the compute type
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale).astype(self.dtype)


def rope_frequencies(
    half: int, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """Angle per position of each feature pair: theta^(-i/half), i < half; with Llama
    3.1's scaling, as Hugging Face's _compute_llama3_parameters computes it
    (transformers/modeling_rope_utils.py; Meta's apply_scaling in llama-models)."""
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return frequencies
    s = scaling
    wavelengths = 2 * math.pi / frequencies
    # 0 at the long wavelength's bound (divided by factor), 1 at the short one (kept)
    blend = (s.original_context / wavelengths - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - blend) * frequencies / s.factor + blend * frequencies
    long = wavelengths > s.original_context / s.low_freq_factor
    short = wavelengths < s.original_context / s.high_freq_factor
    scaled = jnp.where(long, frequencies / s.factor, blended)
    return jnp.where(short, frequencies, scaled)


def rope(
    x_BTNA: jax.Array,
    positions: jax.Array,
    theta: float,
    scaling: RopeScaling | None = None,
) -> jax.Array:
    """Rotate each pair of features by an angle proportional to the token's position:
    ``positions`` per column (T) or, where each row's documents restart, per row (B, T).

    A pair is feature i and feature i + A/2 (the two halves of the head), as in Hugging
    Face's rotate_half; Meta's original code pairs neighbours (2i, 2i + 1), which
    Hugging Face's checkpoints undo by permuting q and k's rows (convert.py says more).
    """
    half = x_BTNA.shape[-1] // 2
    frequencies = rope_frequencies(half, theta, scaling)
    angles = positions[..., None].astype(jnp.float32) * frequencies  # T or B, T; A/2
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]
    first, second = jnp.split(x_BTNA.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate(
        [first * cos - second * sin, second * cos + first * sin], -1
    )
    return rotated.astype(x_BTNA.dtype)


MASKED = -1e30  # finite: a row with nothing unmasked yet gives no NaN
BLOCK = 512  # chunked attention's largest query and key/value block (block_size)
ATTENTIONS = ("xla", "cudnn", "splash", "chunked")


def document_starts(tokens_BT: jax.Array, eod_id: int) -> jax.Array:
    """Each token's document start: the position of the first token of its document,
    where a document ends with ``eod_id`` (the tokens in text order). Given these,
    attention stays inside each document and RoPE counts from each document's start, so
    a row packed with documents computes what each document would alone."""
    after_eod_BT = jnp.pad(tokens_BT[:, :-1] == eod_id, ((0, 0), (1, 0)))
    columns_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    return jax.lax.cummax(jnp.where(after_eod_BT, columns_BT, 0), axis=1)


def same_document(q_starts_BT: jax.Array, kv_starts_BS: jax.Array) -> jax.Array:
    """Whether each query and key are in one document: (B, T, S)."""
    return q_starts_BT[:, :, None] == kv_starts_BS[:, None, :]


def visible(q_positions_T, kv_positions_S, q_starts_BT=None, kv_starts_BS=None):
    """Which keys each query sees, to broadcast against B K Q T S scores: the causal
    mask by positions (any order of the tokens works, such as layout.py's zigzag) and,
    given document starts, the same document only."""
    causal_TS = q_positions_T[:, None] >= kv_positions_S[None, :]
    if q_starts_BT is None:
        return causal_TS
    return (causal_TS & same_document(q_starts_BT, kv_starts_BS))[:, None, None]


def attend_block(carry, q_BTKQA, k_BSKA, v_BSKA, mask):
    """Fold one block of keys and values into an online softmax over a block of queries
    (queries already scaled; ``mask`` from visible): ``carry`` is the unnormalised
    output and each query's running maximum and sum of exponentials, all float32."""
    out_BTKQA, max_BKQT, sum_BKQT = carry
    k_BSKA, v_BSKA = k_BSKA.astype(jnp.float32), v_BSKA.astype(jnp.float32)
    s_BKQTS = jnp.where(mask, jnp.einsum("btkqa,bska->bkqts", q_BTKQA, k_BSKA), MASKED)
    new_max_BKQT = jnp.maximum(max_BKQT, s_BKQTS.max(-1))
    p_BKQTS = jnp.where(mask, jnp.exp(s_BKQTS - new_max_BKQT[..., None]), 0.0)
    rescale_BKQT = jnp.exp(max_BKQT - new_max_BKQT)  # the earlier blocks' share
    sum_BKQT = sum_BKQT * rescale_BKQT + p_BKQTS.sum(-1)
    out_BTKQA = out_BTKQA * rescale_BKQT.transpose(0, 3, 1, 2)[..., None] + jnp.einsum(
        "bkqts,bska->btkqa", p_BKQTS, v_BSKA
    )
    return out_BTKQA, new_max_BKQT, sum_BKQT


def finalise(carry) -> tuple[jax.Array, jax.Array]:
    """The carry -> (the normalised output, each query's log-sum-exp). A query that saw
    no key (masked everywhere) gets output 0 and log-sum-exp MASKED, so that merging
    it with another part gives that part."""
    out_BTKQA, max_BKQT, sum_BKQT = carry
    seen_BKQT = sum_BKQT > 0
    safe_sum_BKQT = jnp.where(seen_BKQT, sum_BKQT, 1.0)
    lse_BKQT = jnp.where(seen_BKQT, max_BKQT + jnp.log(safe_sum_BKQT), MASKED)
    return out_BTKQA / safe_sum_BKQT.transpose(0, 3, 1, 2)[..., None], lse_BKQT


def blocks(x, size: int, axis: int) -> jax.Array:
    """Cut ``axis`` into blocks of ``size``: a new leading axis, the blocks'."""
    shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def unblocks(x, axis: int) -> jax.Array:
    """blocks' inverse: the leading axis of blocks back into ``axis``."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


def block_size(length: int, block: int) -> int:
    """The block chunked attention cuts ``length`` into: the largest size up to
    ``block`` that divides it (768 in blocks of 512 -> 2 of 384), so any length runs."""
    return next(size for size in range(min(block, length), 0, -1) if length % size == 0)


def can_see(q_positions_T, kv_positions_S, q_starts_BT=None) -> jax.Array:
    """Whether any query of a block may see any key of a block: if not, skip the pair
    (the causal upper triangle, in whatever order the positions come, and, given
    document starts, keys before the documents of all the block's queries)."""
    causal = q_positions_T.max() >= kv_positions_S.min()
    if q_starts_BT is None:
        return causal
    return causal & (q_starts_BT.min() <= kv_positions_S.max())


def blocks_of(x, size: int, axis: int) -> jax.Array | None:
    """blocks, passing None (no document starts) through."""
    return None if x is None else blocks(x, size, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def attention_part(
    q_BTKQA,
    k_BSKA,
    v_BSKA,
    q_positions_T,
    kv_positions_S,
    q_starts_BT,
    kv_starts_BS,
    block,
):
    """Causal attention of (scaled) queries on one part of the keys, in blocks of
    ``block`` queries x ``block`` keys: (output, log-sum-exp), float32. The document
    starts (document_starts; None: one document) keep each query in its document.
    Memory O(T x block), forward and backward: the backward keeps only the output and
    log-sum-exp and recomputes each block's probabilities from them (FlashAttention-2's
    backward: Dao 2023, arXiv:2307.08691)."""
    return attention_part_forward(
        q_BTKQA,
        k_BSKA,
        v_BSKA,
        q_positions_T,
        kv_positions_S,
        q_starts_BT,
        kv_starts_BS,
        block,
    )[0]


def attention_part_forward(
    q_BTKQA,
    k_BSKA,
    v_BSKA,
    q_positions_T,
    kv_positions_S,
    q_starts_BT,
    kv_starts_BS,
    block,
):
    tb, sb = block_size(q_BTKQA.shape[1], block), block_size(k_BSKA.shape[1], block)
    # Tied to the queries, the positions count as values to recompute: otherwise, under
    # remat in a scan over layers, autodiff sees that the masks depend only on the
    # positions (the same for every layer) and keeps every block pair's mask, T x S.
    where = (q_positions_T, kv_positions_S, q_starts_BT, kv_starts_BS)
    q_BTKQA, where = jax.lax.optimization_barrier((q_BTKQA, where))
    q_positions_T, kv_positions_S, q_starts_BT, kv_starts_BS = where
    kv_blocks = (
        blocks(k_BSKA, sb, 1),
        blocks(v_BSKA, sb, 1),
        blocks(kv_positions_S, sb, 0),
        blocks_of(kv_starts_BS, sb, 1),
    )

    def one_query_block(args):
        q_BTKQA, q_positions_T, q_starts_BT = args
        # *_like: inside shard_map the carry varies over the mesh axes the queries do
        max_BKQT = jnp.full_like(q_BTKQA[..., 0], MASKED).transpose(0, 2, 3, 1)
        carry = jnp.zeros_like(q_BTKQA), max_BKQT, jnp.zeros_like(max_BKQT)

        def fold(carry, kv):
            k_BSKA, v_BSKA, kv_positions_S, kv_starts_BS = kv
            mask = lambda: visible(
                q_positions_T, kv_positions_S, q_starts_BT, kv_starts_BS
            )
            attend = lambda c: attend_block(c, q_BTKQA, k_BSKA, v_BSKA, mask())
            see = can_see(q_positions_T, kv_positions_S, q_starts_BT)
            return jax.lax.cond(see, attend, lambda c: c, carry), None

        return finalise(jax.lax.scan(fold, carry, kv_blocks)[0])

    q_blocks = (
        blocks(q_BTKQA, tb, 1),
        blocks(q_positions_T, tb, 0),
        blocks_of(q_starts_BT, tb, 1),
    )
    out_blocks, lse_blocks = jax.lax.map(one_query_block, q_blocks)
    out_BTKQA, lse_BKQT = unblocks(out_blocks, 1), unblocks(lse_blocks, 3)
    residuals = (q_BTKQA, k_BSKA, v_BSKA, *where)
    return (out_BTKQA, lse_BKQT), (*residuals, out_BTKQA, lse_BKQT)


def attention_part_backward(block, residuals, cotangents):
    q_BTKQA, k_BSKA, v_BSKA, q_positions_T, kv_positions_S = residuals[:5]
    q_starts_BT, kv_starts_BS, out_BTKQA, lse_BKQT = residuals[5:]
    d_out_BTKQA, d_lse_BKQT = cotangents
    tb, sb = block_size(q_BTKQA.shape[1], block), block_size(k_BSKA.shape[1], block)
    # d score = p (d p - rowsum(d out . out) + d lse): the softmax's gradient and the
    # log-sum-exp's, per query.
    row_BKQT = jnp.einsum("btkqa,btkqa->bkqt", d_out_BTKQA, out_BTKQA) - d_lse_BKQT
    kv_dtypes = k_BSKA.dtype, v_BSKA.dtype
    k_BSKA, v_BSKA = k_BSKA.astype(jnp.float32), v_BSKA.astype(jnp.float32)

    def one_query_block(d_kv, q_args):
        q_BTKQA, q_positions_T, q_starts_BT, lse_BKQT, row_BKQT, d_out_BTKQA = q_args

        def one_kv_block(d_q_BTKQA, kv_args):
            k_BSKA, v_BSKA, kv_positions_S, kv_starts_BS = kv_args

            def gradients(d_q_BTKQA):
                mask = visible(q_positions_T, kv_positions_S, q_starts_BT, kv_starts_BS)
                s_BKQTS = jnp.einsum("btkqa,bska->bkqts", q_BTKQA, k_BSKA)
                p_BKQTS = jnp.where(mask, jnp.exp(s_BKQTS - lse_BKQT[..., None]), 0)
                dp_BKQTS = jnp.einsum("btkqa,bska->bkqts", d_out_BTKQA, v_BSKA)
                ds_BKQTS = p_BKQTS * (dp_BKQTS - row_BKQT[..., None])
                d_q_BTKQA += jnp.einsum("bkqts,bska->btkqa", ds_BKQTS, k_BSKA)
                d_k_BSKA = jnp.einsum("bkqts,btkqa->bska", ds_BKQTS, q_BTKQA)
                d_v_BSKA = jnp.einsum("bkqts,btkqa->bska", p_BKQTS, d_out_BTKQA)
                return d_q_BTKQA, (d_k_BSKA, d_v_BSKA)

            skip = lambda d_q: (d_q, (jnp.zeros_like(k_BSKA), jnp.zeros_like(v_BSKA)))
            see = can_see(q_positions_T, kv_positions_S, q_starts_BT)
            return jax.lax.cond(see, gradients, skip, d_q_BTKQA)

        d_q_BTKQA, (d_k_blocks, d_v_blocks) = jax.lax.scan(
            one_kv_block, jnp.zeros_like(q_BTKQA), kv_blocks
        )
        d_k_BSKA, d_v_BSKA = d_kv
        d_kv = d_k_BSKA + unblocks(d_k_blocks, 1), d_v_BSKA + unblocks(d_v_blocks, 1)
        return d_kv, d_q_BTKQA

    kv_blocks = (
        blocks(k_BSKA, sb, 1),
        blocks(v_BSKA, sb, 1),
        blocks(kv_positions_S, sb, 0),
        blocks_of(kv_starts_BS, sb, 1),
    )
    q_blocks = (
        blocks(q_BTKQA, tb, 1),
        blocks(q_positions_T, tb, 0),
        blocks_of(q_starts_BT, tb, 1),
        blocks(lse_BKQT, tb, 3),
        blocks(row_BKQT, tb, 3),
        blocks(d_out_BTKQA, tb, 1),
    )
    (d_k_BSKA, d_v_BSKA), d_q_blocks = jax.lax.scan(
        one_query_block, (jnp.zeros_like(k_BSKA), jnp.zeros_like(v_BSKA)), q_blocks
    )
    d_q_BTKQA = unblocks(d_q_blocks, 1).astype(q_BTKQA.dtype)
    d_k_BSKA, d_v_BSKA = (d.astype(t) for d, t in zip((d_k_BSKA, d_v_BSKA), kv_dtypes))
    return d_q_BTKQA, d_k_BSKA, d_v_BSKA, None, None, None, None


attention_part.defvjp(attention_part_forward, attention_part_backward)


def merge(part_a, part_b) -> tuple[jax.Array, jax.Array]:
    """Two parts' (output, log-sum-exp) -> those of their union: each part's output
    weighted by its share of the union's sum of exponentials."""
    (out_a_BTKQA, lse_a_BKQT), (out_b_BTKQA, lse_b_BKQT) = part_a, part_b
    lse_BKQT = jnp.logaddexp(lse_a_BKQT, lse_b_BKQT)
    share = lambda part_BKQT: jnp.exp(part_BKQT - lse_BKQT).transpose(0, 3, 1, 2)
    out_BTKQA = (
        out_a_BTKQA * share(lse_a_BKQT)[..., None]
        + out_b_BTKQA * share(lse_b_BKQT)[..., None]
    )
    return out_BTKQA, lse_BKQT


def grouped(q_BTNA, num_kv_heads: int) -> jax.Array:
    """Queries -> float32, scaled by 1/sqrt(A), grouped by the key/value head used."""
    B, T, N, A = q_BTNA.shape
    K = num_kv_heads
    return q_BTNA.reshape(B, T, K, N // K, A).astype(jnp.float32) * A**-0.5


def chunked_attention(
    q_BTNA,
    k_BSKA,
    v_BSKA,
    q_positions_T,
    kv_positions_S,
    block: int = BLOCK,
    q_starts_BT=None,
    kv_starts_BS=None,
):
    """Causal attention in blocks, never forming the T x S scores: each query block
    folds in the key/value blocks it can see with an online softmax (a running maximum
    and sum: Milakov & Gimelshein 2018, arXiv:1805.02867; FlashAttention, Dao et al.
    2022, arXiv:2205.14135). Blocks of up to ``block``, the largest that divides each
    length (block_size). Given document starts, each query sees its own document only.
    Float32 inside; the output in the queries' dtype."""
    out_BTKQA, _ = attention_part(
        grouped(q_BTNA, k_BSKA.shape[2]),
        k_BSKA,
        v_BSKA,
        q_positions_T,
        kv_positions_S,
        q_starts_BT,
        kv_starts_BS,
        block,
    )
    return out_BTKQA.reshape(q_BTNA.shape).astype(q_BTNA.dtype)


def ring_attention(
    q_BTNA,
    k_BTKA,
    v_BTKA,
    positions_T,
    starts_BT=None,
    axis: str = "sequence",
    block: int = BLOCK,
):
    """Causal attention on one device's share of a sequence split over ``axis`` (inside
    jax.shard_map). Each device keeps its queries; the keys and values travel around the
    ring, one ppermute per step, and each step's part (chunked attention's blocks) is
    merged into the rest by log-sum-exp, so no device holds the whole sequence's keys
    (ring attention: Liu et al. 2023, arXiv:2310.01889). ``positions_T``, whole on every
    device, gives each column's position in the text; the mask compares positions, so
    any order of the tokens works, such as layout.py's load-balanced zigzag. Document
    starts (``starts_BT``), if given, come whole along the sequence too, in the tokens'
    order."""
    n, i = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    T = q_BTNA.shape[1]
    share = lambda device: jax.lax.dynamic_slice_in_dim(positions_T, device * T, T)
    row_share = lambda device: (
        None
        if starts_BT is None
        else jax.lax.dynamic_slice_in_dim(starts_BT, device * T, T, axis=1)
    )
    q_BTKQA = grouped(q_BTNA, k_BTKA.shape[2])
    k_BSKA, v_BSKA = k_BTKA, v_BTKA  # they travel in the compute dtype
    result = None
    for step in range(n):  # at this step, the block that started on device i - step
        source = (i - step) % n
        part = attention_part(
            q_BTKQA,
            k_BSKA,
            v_BSKA,
            share(i),
            share(source),
            row_share(i),
            row_share(source),
            block,
        )
        result = part if result is None else merge(result, part)
        if step < n - 1:  # pass the block on: device j sends to j + 1
            ring = [(j, (j + 1) % n) for j in range(n)]
            k_BSKA, v_BSKA = jax.lax.ppermute((k_BSKA, v_BSKA), axis, ring)
    return result[0].reshape(q_BTNA.shape).astype(q_BTNA.dtype)


def document_mask(starts_BT) -> jax.Array | None:
    """jax.nn.dot_product_attention's mask (B, 1, T, S) for document starts, or None."""
    return None if starts_BT is None else same_document(starts_BT, starts_BT)[:, None]


def cudnn_attention(q_BTNA, k_BTKA, v_BTKA, starts_BT=None):
    """cuDNN's fused causal attention (FlashAttention on NVIDIA GPUs), in bfloat16, the
    type its kernel takes; the output back in the queries' dtype. Given document starts,
    the mask goes to cuDNN as a T x S bias per row (jax.nn.dot_product_attention turns
    a mask into a bias; cuDNN's packed-document layout is not in that API in jax
    0.10.2), so memory is quadratic in the sequence again: chunked stays linear."""
    bf16 = lambda x: x.astype(jnp.bfloat16)
    out_BTNA = jax.nn.dot_product_attention(
        bf16(q_BTNA),
        bf16(k_BTKA),
        bf16(v_BTKA),
        mask=document_mask(starts_BT),
        is_causal=True,
        implementation="cudnn",
    )
    return out_BTNA.astype(q_BTNA.dtype)


def manual_axes(*specs: P) -> set[str]:
    """The mesh axes for a shard_map with these specs to make manual: those the specs
    name and those that split something (under the accumulation's vmap, 'data'), not
    the others, of size 1 (with the check off, shard_map's backward would sum the
    gradients over them: all-reduces that move nothing but that a compiled program
    still holds), nor those already manual (inside a pipeline stage, 'pipeline')."""
    mesh = jax.sharding.get_abstract_mesh()
    named = {
        a
        for spec in specs
        for part in spec
        if part
        for a in ((part,) if isinstance(part, str) else part)
    }
    split = named | {a for a, size in mesh.shape.items() if size > 1}
    return split - set(mesh.manual_axes)


def every_axis() -> set[str]:
    """The mesh's axes that are not manual already."""
    mesh = jax.sharding.get_abstract_mesh()
    return set(mesh.axis_names) - set(mesh.manual_axes)


def placed(attend, kernel: bool = False):
    """``attend(q_BTNA, k_BTKA, v_BTKA, *extra)`` run on each device's batch rows and
    heads (jax.shard_map over the mesh axes the rules give "batch" and the heads), the
    whole sequence on each device; of ``extra``, a 1-D array (positions) goes whole to
    every device and a 2-D one (document starts, B x T) by the rows: a kernel
    (cuDNN's custom call) or a loop of blocks then needs no partitioning by XLA. The
    heads split as the keys' heads do, so each device's query heads find their shared
    key/value heads on the same device. Inside a shard_map over all the mesh's axes, JAX
    lowers the cuDNN call as on one device, with the device's shapes (XLA's partitioning
    of the call has had bugs: jax-ml/jax#25986). Unwrapped outside a mesh.

    check_vma=False: under step.py's gradient accumulation, vmapped over the data
    replicas (spmd_axis_name), the queries vary over 'data' and the positions, a
    constant, do not, and the chunked loop's optimization barrier takes both; JAX's
    check of which values vary then fails. Nothing here communicates between devices,
    so there is nothing for the check to protect."""

    def call(q_BTNA, k_BTKA, v_BTKA, *extra):
        if jax.sharding.get_abstract_mesh().empty:
            return attend(q_BTNA, k_BTKA, v_BTKA, *extra)
        q_spec = nn.logical_to_mesh_axes(("batch", None, "act_heads", None))
        kv_spec = nn.logical_to_mesh_axes(("batch", None, "act_kv_heads", None))
        row_spec = nn.logical_to_mesh_axes(("batch", None))
        extra_specs = (P() if x.ndim == 1 else row_spec for x in extra)
        in_specs = (q_spec, kv_spec, kv_spec, *extra_specs)
        on_each = jax.shard_map(
            attend,
            in_specs=in_specs,
            out_specs=q_spec,
            # A kernel (Mosaic's, cuDNN's) must be manual over every axis: XLA cannot
            # partition its call, even over axes of size 1.
            axis_names=every_axis() if kernel else manual_axes(q_spec, kv_spec),
            check_vma=False,
        )
        return on_each(q_BTNA, k_BTKA, v_BTKA, *extra)

    return call


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    # the sequence is split over the 'sequence' mesh axis
    context_parallel: bool = False
    attention: str = "xla"  # one of ATTENTIONS (ring attention uses chunked blocks)

    def project(
        self, name: str, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int
    ):
        init = weight(nn.initializers.normal(fan_in**-0.5), names)
        return self.param(name, init, shape, jnp.float32).astype(self.dtype)

    @nn.compact
    def __call__(
        self, x_BTD: jax.Array, positions_T: jax.Array, starts_BT: jax.Array | None
    ) -> jax.Array:
        c = self.config
        D, N, K, A = c.width, c.num_heads, c.num_kv_heads, c.head_width
        # RoPE counts from each document's start, if documents are masked
        rope_positions = positions_T if starts_BT is None else positions_T - starts_BT
        # Column-parallel: each 'tensor' device computes its own heads, whole.
        w_DNA = self.project("query", (D, N, A), ("embed", "heads", "head_dim"), D)
        w_kv = [
            self.project(n, (D, K, A), ("embed", "kv_heads", "head_dim"), D)
            for n in "kv"
        ]
        q_BTNA = rope(
            jnp.einsum("btd,dna->btna", x_BTD, w_DNA),
            rope_positions,
            c.rope_theta,
            c.rope_scaling,
        )
        k_BTKA = rope(
            jnp.einsum("btd,dka->btka", x_BTD, w_kv[0]),
            rope_positions,
            c.rope_theta,
            c.rope_scaling,
        )
        v_BTKA = jnp.einsum("btd,dka->btka", x_BTD, w_kv[1])
        q_BTNA = constrain(q_BTNA, ("batch", "act_seq", "act_heads", None))
        k_BTKA = constrain(k_BTKA, ("batch", "act_seq", "act_kv_heads", None))
        v_BTKA = constrain(v_BTKA, ("batch", "act_seq", "act_kv_heads", None))
        # Document starts, if any: per row, whole along the sequence on each device
        documents = () if starts_BT is None else (starts_BT,)
        # Ring attention's blocks stay chunked, not splash: in the zigzag order a block
        # pair's causal mask is not a static lower triangle, and merging the parts needs
        # each part's log-sum-exp and its gradient: the kernel's backward takes the
        # output's gradient alone.
        if self.context_parallel:  # each device: its tokens, its heads, its batch rows
            spec = nn.logical_to_mesh_axes(("batch", "act_seq", "act_heads", None))
            row_spec = nn.logical_to_mesh_axes(("batch", None))
            ring = jax.shard_map(
                ring_attention,
                in_specs=(spec, spec, spec, P(), *(row_spec for _ in documents)),
                out_specs=spec,
                axis_names=manual_axes(spec, row_spec),
                check_vma=False,
            )
            out_BTNA = ring(q_BTNA, k_BTKA, v_BTKA, positions_T, *documents)
        elif self.attention == "chunked":  # blocks; the mask compares positions
            chunked = lambda q, k, v, at, *starts: chunked_attention(
                q, k, v, at, at, BLOCK, *starts, *starts
            )
            out_BTNA = placed(chunked)(q_BTNA, k_BTKA, v_BTKA, positions_T, *documents)
        elif self.attention == "cudnn":  # positions in order: the lower triangle
            out_BTNA = placed(cudnn_attention, kernel=True)(
                q_BTNA, k_BTKA, v_BTKA, *documents
            )
        elif self.attention == "splash":  # positions in order: the lower triangle
            attend = placed(splash.splash_attention, kernel=True)
            out_BTNA = attend(q_BTNA, k_BTKA, v_BTKA, *documents)
        elif self.attention == "xla":  # positions in order; the T x S scores in fp32
            out_BTNA = jax.nn.dot_product_attention(
                q_BTNA, k_BTKA, v_BTKA, mask=document_mask(starts_BT), is_causal=True
            )
        else:
            raise ValueError(f"attention {self.attention!r}: expected {ATTENTIONS}")
        out_BTNA = constrain(out_BTNA, ("batch", "act_seq", "act_heads", None))
        # Row-parallel: each device's heads give a partial sum, which the layout after
        # the block reduces (an all-reduce, or under sequence parallelism a
        # reduce-scatter).
        w_NAD = self.project("out", (N, A, D), ("heads", "head_dim", "embed"), N * A)
        return jnp.einsum("btna,nad->btd", out_BTNA, w_NAD)


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        c = self.config
        dense = functools.partial(
            nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32
        )
        up_init = weight(nn.initializers.normal(c.width**-0.5), ("embed", "mlp"))
        gate_BTF = dense(c.mlp_width, kernel_init=up_init, name="gate")(x_BTD)
        up_BTF = dense(c.mlp_width, kernel_init=up_init, name="up")(x_BTD)
        h_BTF = constrain(nn.silu(gate_BTF) * up_BTF, ("batch", "act_seq", "act_mlp"))
        down_init = weight(nn.initializers.normal(c.mlp_width**-0.5), ("mlp", "embed"))
        return dense(c.width, kernel_init=down_init, name="down")(h_BTF)


BALANCE_WEIGHT, Z_WEIGHT = 0.01, 0.001  # Switch Transformer's and ST-MoE's coefficients


def expert_slots(choice_RTE: jax.Array, gates_TR: jax.Array, capacity: int):
    """-> GShard's dispatch and combine (token, expert, slot), and the kept pairs.

    Each (choice, token) pair takes the next free slot of its expert, first choices
    before second ones: its slot is how many earlier pairs chose the same expert. A pair
    past ``capacity`` is dropped (its one-hot slot is all zero). Leading dimensions (a
    batch, groups) are carried through."""
    *lead, R, T, E = choice_RTE.shape
    flat = choice_RTE.reshape(*lead, R * T, E)
    slot_RT = ((jnp.cumsum(flat, axis=-2) - 1) * flat).sum(-1).reshape(*lead, R, T)
    slot_RTM = jax.nn.one_hot(slot_RT.astype(jnp.int32), capacity)
    dispatch_TEM = jnp.einsum("...rte,...rtm->...tem", choice_RTE, slot_RTM)
    combine_TEM = jnp.einsum(
        "...rte,...rtm,...tr->...tem", choice_RTE, slot_RTM, gates_TR
    )
    return dispatch_TEM, combine_TEM, slot_RT < capacity


class Experts(nn.Module):
    """E SwiGLU experts, a top-k router, a capacity; GShard's dispatch and combine.

    Each group of T tokens is routed on its own: a token's choices take the next free
    slot of their experts, first choices before second ones, and a choice that finds its
    expert full is dropped (the token keeps its residual). Weights and the routed tokens
    are split over the 'expert' mesh axis; between the two, XLA moves tokens to their
    experts' devices and back (all-to-alls). Dispatch and combine are einsums. Returns
    the output and the auxiliary loss: Switch's load balance E * sum_e f_e P_e (Fedus et
    al. 2021, arXiv:2101.03961) and ST-MoE's router z-loss (Zoph et al. 2022,
    arXiv:2202.08906). With config.dispatch "dropless", no capacity: every choice is
    computed, sorted by expert, in grouped matrix products (dropless_experts).
    """

    config: ModelConfig
    dtype: jnp.dtype

    def expert_weight(self, name: str, shape: tuple[int, ...], names: tuple[str, ...]):
        init = weight(nn.initializers.normal(shape[1] ** -0.5), names)
        return self.param(name, init, shape, jnp.float32).astype(self.dtype)

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        y_BTD, aux_loss = self.routed(x_BTD)
        if c.shared_experts:  # DeepSeekMoE's shared experts: every token, one MLP
            wide = dataclasses.replace(c, mlp_width=c.shared_experts * c.mlp_width)
            y_BTD += MLP(wide, self.dtype, name="shared")(x_BTD)
        return y_BTD, aux_loss

    def route(self, x_BGTD: jax.Array):
        """-> (gates, experts, the top-k mask, the auxiliary loss) of each token.

        With config.balance "bias" (DeepSeek-V3's auxiliary-loss-free balance, Liu et
        al. 2024, arXiv:2412.19437, section 2.1.2), a per-expert bias is added to the
        scores to choose the experts (not to the gates), and the auxiliary loss holds
        bias x (load - 1/E) in place of Switch's loss: its gradient, each expert's
        load above the mean, moves the bias by sign descent (step.make_optimizer):
        an overloaded expert's bias goes down by --bias-rate each step."""
        c = self.config
        D, E, R = x_BGTD.shape[-1], c.num_experts, c.top_k
        router_DE = self.param(
            "router",
            weight(nn.initializers.normal(D**-0.5), ("embed", None)),
            (D, E),
            jnp.float32,
        )
        logits_BGTE = jnp.einsum("bgtd,de->bgte", x_BGTD.astype(jnp.float32), router_DE)
        probs_BGTE = jax.nn.softmax(logits_BGTE, axis=-1)
        if c.balance == "bias":
            bias_E = self.param("router_bias", nn.initializers.zeros, (E,), jnp.float32)
            scores_BGTE = probs_BGTE + jax.lax.stop_gradient(bias_E)
            _, experts_BGTR = jax.lax.top_k(scores_BGTE, R)
            gates_BGTR = jnp.take_along_axis(probs_BGTE, experts_BGTR, axis=-1)
        else:
            gates_BGTR, experts_BGTR = jax.lax.top_k(probs_BGTE, R)
        gates_BGTR /= gates_BGTR.sum(-1, keepdims=True)  # k > 1: they sum to 1
        choice_BGRTE = jax.nn.one_hot(experts_BGTR.swapaxes(2, 3), E)
        load_E = choice_BGRTE.mean((0, 1, 2, 3))  # each expert's share of the choices
        z_loss = jnp.mean(jax.nn.logsumexp(logits_BGTE, axis=-1) ** 2)
        if c.balance == "bias":
            balance = jnp.sum(bias_E * jax.lax.stop_gradient(load_E - 1 / E))
            return gates_BGTR, experts_BGTR, choice_BGRTE, balance + Z_WEIGHT * z_loss
        balance = E * jnp.sum(load_E * probs_BGTE.mean((0, 1, 2)))
        aux_loss = BALANCE_WEIGHT * balance + Z_WEIGHT * z_loss
        return gates_BGTR, experts_BGTR, choice_BGRTE, aux_loss

    def routed(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The routed experts' output, and the auxiliary loss."""
        c = self.config
        B, length, D = x_BTD.shape
        E, R, F = c.num_experts, c.top_k, c.mlp_width
        T = min(c.group_size, length)
        G = length // T
        M = math.ceil(R * T * c.capacity_factor / E)
        x_BGTD = x_BTD.reshape(B, G, T, D)
        gates_BGTR, experts_BGTR, choice_BGRTE, aux_loss = self.route(x_BGTD)
        dispatch_BGTEM, combine_BGTEM, _ = expert_slots(choice_BGRTE, gates_BGTR, M)
        w_gate_EDF, w_up_EDF = (
            self.expert_weight(n, (E, D, F), ("experts", "embed", "mlp"))
            for n in ("gate", "up")
        )
        w_down_EFD = self.expert_weight("down", (E, F, D), ("experts", "mlp", "embed"))
        if c.dispatch == "dropless":  # every choice, sorted by expert (dropless.py)
            y_BTD = dropless_experts(
                x_BTD,
                experts_BGTR.reshape(B, length, R),
                gates_BGTR.reshape(B, length, R),
                w_gate_EDF,
                w_up_EDF,
                w_down_EFD,
                exchange=c.exchange,
            )
            return y_BTD, aux_loss
        # Each device fills its rows' slots, then the slots move to their experts'
        # devices: split by expert instead of by batch row (an all-to-all on 'expert').
        local, routed = (
            (None, "batch", "act_seq", None),
            ("act_experts", "expert_batch", "act_seq", None),
        )
        x_EBGMD = constrain(
            jnp.einsum("bgtem,bgtd->ebgmd", dispatch_BGTEM.astype(self.dtype), x_BGTD),
            (*local, None),
        )
        x_EBGMD = constrain(x_EBGMD, (*routed, None))
        h_EBGMF = nn.silu(
            jnp.einsum("ebgmd,edf->ebgmf", x_EBGMD, w_gate_EDF)
        ) * jnp.einsum("ebgmd,edf->ebgmf", x_EBGMD, w_up_EDF)
        h_EBGMF = constrain(h_EBGMF, (*routed, "act_mlp"))
        y_EBGMD = constrain(
            jnp.einsum("ebgmf,efd->ebgmd", h_EBGMF, w_down_EFD), (*routed, None)
        )
        # And back to their batch rows (the second all-to-all), weighted by their gates.
        y_EBGMD = constrain(y_EBGMD, (*local, None))
        y_BGTD = jnp.einsum(
            "bgtem,ebgmd->bgtd", combine_BGTEM.astype(self.dtype), y_EBGMD
        )
        return y_BGTD.reshape(x_BTD.shape), aux_loss


def only(spec: P, axes: set[str]) -> P:
    """``spec`` naming ``axes`` alone (the others: None)."""
    keep = lambda part: (
        (tuple(a for a in part if a in axes) or None)
        if isinstance(part, tuple)
        else (part if part in axes else None)
    )
    return P(*(keep(part) for part in spec))


def dropless_experts(
    x_BTD, experts_BTR, gates_BTR, w_gate_EDF, w_up_EDF, w_down_EFD, exchange="padded"
):
    """Every token's experts, nothing dropped (dropless.py), in a jax.shard_map over
    the mesh: each device's tokens as the rules split them ("batch", "act_seq"), the
    weights as they lie ("experts", "embed", "mlp"); across 'expert', ``exchange``
    "padded" or "ragged". Unwrapped outside a mesh."""
    # In float32, cast inside (dropless.in_compute_type): the sums of their gradients
    # over devices then run in float32.
    f32 = [
        a.astype(jnp.float32)
        for a in (x_BTD, gates_BTR, w_gate_EDF, w_up_EDF, w_down_EFD)
    ]
    args = (f32[0], experts_BTR, *f32[1:])
    if jax.sharding.get_abstract_mesh().empty:
        return dropless.on_device(*args, dtype=x_BTD.dtype)
    names = [
        ("batch", "act_seq", None),
        ("experts", "embed", "mlp"),
        ("experts", "mlp", "embed"),
    ]
    specs = [nn.logical_to_mesh_axes(n) for n in names]  # tokens, up, down
    # Manual over the axes that split something; the others left out of the specs, so
    # that no size-1 axis calls for a collective (check_vma holds the rest to account).
    sizes = jax.sharding.get_abstract_mesh().shape
    manual = {a for a in manual_axes(*specs) if sizes[a] > 1}
    tokens, up, down = (only(spec, manual) for spec in specs)
    expert_axis, width_axis, mlp_axis = up
    on_each = jax.shard_map(
        functools.partial(
            dropless.on_device,
            expert_axis=expert_axis,
            width_axis=width_axis,
            mlp_axis=mlp_axis,
            exchange=exchange,
            dtype=x_BTD.dtype,
        ),
        in_specs=(tokens, tokens, tokens, up, up, down),
        out_specs=tokens,
        axis_names=manual,
    )
    return on_each(*args)


# Between blocks the residual stream is split over the batch and, where the rules map
# "act_seq_residual" to 'tensor', over the sequence too (Megatron's sequence
# parallelism: the norms work on T/tensor tokens, and the all-reduces become all-gathers
# and reduce-scatters).
RESIDUAL = ("batch", "act_seq_residual", "act_embed")
WHOLE = ("batch", "act_seq", "act_embed")
# The embedding lookup's output as the table lies: the rows over the batch's replicas
# ("lookup_batch": 'pipeline', 'data' and 'expert'), the width as the table splits it
# ("embed").
LOOKUP = ("lookup_batch", None, "embed")
LOOKUPS = ("xla", "rows", "table")


class Block(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    context_parallel: bool = False
    attention: str = "xla"

    @nn.compact
    def __call__(
        self, x_BTD: jax.Array, positions_T: jax.Array, starts_BT: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        c = self.config
        x_BTD = checkpoint_name(x_BTD, LAYER_INPUT)  # what OFFLOADED sends to the host
        # Each block's input is gathered whole along the sequence (an all-gather where
        # the residual is split over 'tensor'), then split by heads or MLP columns.
        h = constrain(
            RMSNorm(c.norm_eps, self.dtype, name="attention_norm")(x_BTD), WHOLE
        )
        attention = Attention(
            c, self.dtype, self.context_parallel, self.attention, name="attention"
        )
        x_BTD = constrain(x_BTD + attention(h, positions_T, starts_BT), RESIDUAL)
        h = constrain(RMSNorm(c.norm_eps, self.dtype, name="mlp_norm")(x_BTD), WHOLE)
        if c.num_experts:
            y_BTD, aux_loss = Experts(c, self.dtype, name="experts")(h)
        else:
            y_BTD, aux_loss = MLP(c, self.dtype, name="mlp")(h), jnp.zeros(())
        return constrain(x_BTD + y_BTD, RESIDUAL), aux_loss  # nn.scan's (carry, output)


def embedding_stddev(config: ModelConfig) -> float:
    """The embedding table's initial standard deviation.

    Untied, 1: the table only feeds the first RMSNorm, which rescales it. Tied, the
    table is also the output projection, and the logits are the final norm's output
    (about unit size in each of D features) times it: N(0, 1) would give logits of
    standard deviation sqrt(D), 45 at D = 2048, and a first loss of hundreds of nats
    instead of ln V. 1/sqrt(D) gives logits of about unit size, as the unembedding's
    fan-in initialisation does untied; at Llama 3.2 1B's width it is 0.022, close to the
    0.02 of its published config (meta-llama/Llama-3.2-1B, config.json,
    "initializer_range": 0.02, which Hugging Face's LlamaPreTrainedModel._init_weights
    uses for the embedding).
    """
    return config.width**-0.5 if config.tie_embeddings else 1.0


class Transformer(nn.Module):
    """Token ids -> (logits, the experts' auxiliary loss over all layers; 0 if dense).

    ``positions_T``: each column's position in the text, if the tokens come in another
    order (layout.py's zigzag for ring attention); by default 0, 1, ..., T-1.
    ``starts_BT``: each token's document start (document_starts, in the same order as
    the tokens), to keep attention inside documents and start RoPE at each; by default
    None, one text per row.
    """

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32  # the compute type; weights stay float32
    remat: str = "full"
    # With remat "full": each layer's input kept in the host's memory (OFFLOADED).
    offload_activations: bool = False
    # Layers per loop iteration; num_layers leaves no loop (XLA's cost_analysis counts a
    # loop's body once, whatever its trip count).
    scan_unroll: int = 1
    context_parallel: bool = False  # ring attention over the 'sequence' mesh axis
    # "xla": jax.nn.dot_product_attention's reference (the T x S scores in float32);
    # "cudnn": cuDNN's fused kernel (NVIDIA GPUs, bfloat16); "splash": JAX's Pallas
    # kernel for TPUs (splash.py); "chunked": blocks of an online softmax in plain JAX,
    # memory linear in the sequence.
    attention: str = "xla"
    # The embedding lookup, one of LOOKUPS (layout.lookup says which). On a mesh whose
    # batch has replicas ('data' or 'expert'), left to XLA ("xla"), the lookup's
    # gradient asks XLA's partitioner to go from rows split over all devices to the
    # width split over 'fsdp' and rows whole, which it can only do by gathering the
    # whole array ("Involuntary full rematerialization"). "rows": the lookup's output is
    # laid out as the table (LOOKUP) before the residual's layout, so the activations
    # move to the table's shards and back in all-to-alls. "table": the table is
    # gathered over 'fsdp' first (as FSDP gathers a layer), so the tokens are looked up
    # where they are.
    lookup: str = "xla"

    def setup(self):
        c = self.config
        self.embed = nn.Embed(
            c.vocab_size,
            c.width,
            dtype=self.dtype,
            param_dtype=jnp.float32,
            embedding_init=weight(
                nn.initializers.normal(embedding_stddev(c)), ("vocab", "embed")
            ),
        )
        block = Block
        if self.offload_activations and self.remat != "full":
            raise ValueError(
                f"offloading activations is full remat with each layer's input in "
                f"host memory; remat is {self.remat!r}"
            )
        if self.remat != "none":
            policy = REMAT_POLICIES[self.remat]
            block = nn.remat(
                Block,
                policy=OFFLOADED if self.offload_activations else policy,
                prevent_cse=False,
            )
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=c.num_layers,
            unroll=self.scan_unroll,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, self.dtype, self.context_parallel, self.attention)
        self.final_norm = RMSNorm(c.norm_eps, self.dtype)
        if not c.tie_embeddings:
            self.unembed = nn.Dense(
                c.vocab_size,
                use_bias=False,
                dtype=self.dtype,
                param_dtype=jnp.float32,
                kernel_init=weight(
                    nn.initializers.normal(c.width**-0.5), ("embed", "vocab")
                ),
            )

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_T: jax.Array | None = None,
        starts_BT: jax.Array | None = None,
    ):
        x_BTD, aux_loss = self.features(tokens_BT, positions_T, starts_BT)
        return self.logits(x_BTD), aux_loss

    def features(
        self,
        tokens_BT: jax.Array,
        positions_T: jax.Array | None = None,
        starts_BT: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Token ids -> (the last layer's output, before the final norm; the experts'
        auxiliary loss): the model without its output projection, for a loss that
        computes the logits a chunk at a time (fused_cross_entropy)."""
        if positions_T is None:
            positions_T = jnp.arange(tokens_BT.shape[1])
        x_BTD = self.embed_tokens(tokens_BT)
        return self.run_layers(x_BTD, positions_T, starts_BT)

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        """Token ids -> the residual stream's first values, in its layout."""
        if self.lookup == "table":
            table_VD = constrain(self.embed.embedding, ("vocab", None))
            x_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(self.dtype)
        elif self.lookup in ("rows", "xla"):
            x_BTD = self.embed(tokens_BT)
        else:
            raise ValueError(f"lookup {self.lookup!r}: expected one of {LOOKUPS}")
        if self.lookup == "rows":
            x_BTD = constrain(x_BTD, LOOKUP)
        return constrain(x_BTD, RESIDUAL)

    def run_layers(
        self, x_BTD: jax.Array, positions_T: jax.Array, starts_BT: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """The residual stream through every layer (config.num_layers of them: a
        pipeline stage's model has its stage's count) -> (it, the experts' losses)."""
        x_BTD, aux_losses = self.layers(x_BTD, positions_T, starts_BT)
        return x_BTD, aux_losses.sum()

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """The final norm and the output projection: vocabulary-parallel logits, so
        that no device holds a row of all V logits."""
        x_BTD = self.final_norm(x_BTD)
        if self.config.tie_embeddings:
            logits_BTV = self.embed.attend(x_BTD)
        else:
            logits_BTV = self.unembed(x_BTD)
        return constrain(logits_BTV, ("batch", "act_seq", "act_vocab"))


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token loss in float32, written so that a split vocabulary stays split.

    logsumexp reduces over V with partial maxima and sums; the target's logit is picked
    by a one-hot product rather than an index, which would gather all V logits onto each
    device.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    one_hot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=jnp.float32)
    target_logit_BT = jnp.sum(logits_BTV * one_hot_BTV, axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit_BT)


# The most float32 logits a device holds at once in fused_cross_entropy (loss_chunks)
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunks(
    tokens: int, length: int, vocab: int, devices: int, budget: int | None = None
) -> int:
    """How many chunks fused_cross_entropy cuts each row into: the fewest, dividing
    ``length``, whose float32 logits (``tokens`` x ``vocab`` over ``devices``) keep
    within ``budget`` bytes a device (LOSS_CHUNK_BYTES; 1: all the logits at once)."""
    budget = budget or LOSS_CHUNK_BYTES
    per_device = 4 * tokens * vocab / devices
    fits = (c for c in range(1, length + 1) if length % c == 0)
    return next((c for c in fits if per_device / c <= budget), length)


def fused_cross_entropy(logits_fn, head, x_BTD, targets_BT, chunks: int, layout=None):
    """cross_entropy(logits_fn(head, x_BTD), targets_BT), computed ``chunks`` columns
    at a time, so that no device holds all the logits, in the forward pass or the
    backward: each chunk's logits, their gradient and its share of the head's and the
    inputs' gradients are computed together in the forward pass (three matrix
    products a chunk, as unchunked; nothing recomputed), and the backward pass only
    scales them. ``head``: the weights logits_fn uses; ``layout`` pins the running
    sum of their gradient to their layout (FSDP keeps 1/fsdp of it a device).

    Chunk c holds columns c, c + chunks, ...: a split sequence stays split."""
    if chunks == 1:
        return cross_entropy(logits_fn(head, x_BTD), targets_BT)
    layout = layout or (lambda tree: tree)
    B, T = targets_BT.shape
    count = B * T

    def split(a):  # (B, T, ...) -> (chunks, B, T / chunks, ...)
        return jnp.moveaxis(a.reshape(B, T // chunks, chunks, *a.shape[2:]), 2, 0)

    def chunk_loss(head, x_BtD, targets_Bt):  # the chunk's summed loss
        return cross_entropy(logits_fn(head, x_BtD), targets_Bt) * targets_Bt.size

    @jax.custom_vjp
    def loss(head, x_BTD, targets_BT):
        def add(total, xs):
            return total + chunk_loss(head, *xs), None

        chunks_ = (split(x_BTD), split(targets_BT))
        return jax.lax.scan(add, jnp.zeros((), jnp.float32), chunks_)[0] / count

    def forward(head, x_BTD, targets_BT):
        def add(carry, xs):
            total, d_head = carry
            x_BtD, targets_Bt = xs
            value, vjp = jax.vjp(lambda h, x: chunk_loss(h, x, targets_Bt), head, x_BtD)
            g_head, g_x_BtD = vjp(jnp.ones_like(value))
            d_head = layout(
                jax.tree.map(lambda d, g: d + g.astype(jnp.float32), d_head, g_head)
            )
            return (total + value, d_head), g_x_BtD

        zeros = layout(jax.tree.map(lambda h: jnp.zeros(h.shape, jnp.float32), head))
        start = (jnp.zeros((), jnp.float32), zeros)
        (total, d_head), g_x_CBtD = jax.lax.scan(
            add, start, (split(x_BTD), split(targets_BT))
        )
        g_x_BTD = jnp.moveaxis(g_x_CBtD, 0, 2).reshape(x_BTD.shape)
        return total / count, (d_head, g_x_BTD, head)

    def backward(saved, g):
        d_head, g_x_BTD, head = saved
        scale = g / count
        d_head = jax.tree.map(lambda d, h: (d * scale).astype(h.dtype), d_head, head)
        return d_head, (g_x_BTD * scale).astype(g_x_BTD.dtype), None

    loss.defvjp(forward, backward)
    return loss(head, x_BTD, targets_BT)
