"""Attention's kernels and where they run: the causal mask with documents, chunked
blocks of an online softmax, ring attention, cuDNN's fused kernel, and the shard_map
that places a kernel (splash.py holds the TPU's). Shapes as in model.py's legend.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# A masked score: finite, so that a row with nothing unmasked yet gives no NaN.
MASKED = -1e30
# chunked attention's largest query and key/value block (block_size)
BLOCK = 512
ATTENTIONS = ("xla", "cudnn", "splash", "chunked")


def document_starts(tokens_BT: jax.Array, eod_id: int) -> jax.Array:
    """Each token's document start (the position of its document's first token), where
    a document ends with ``eod_id``; the tokens in text order."""
    after_eod_BT = jnp.pad(tokens_BT[:, :-1] == eod_id, ((0, 0), (1, 0)))
    columns_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    return jax.lax.cummax(jnp.where(after_eod_BT, columns_BT, 0), axis=1)


def same_document(q_starts_BT: jax.Array, kv_starts_BS: jax.Array) -> jax.Array:
    """Whether each query and key are in one document: (B, T, S)."""
    return q_starts_BT[:, :, None] == kv_starts_BS[:, None, :]


def visible(q_positions_T, kv_positions_S, q_starts_BT=None, kv_starts_BS=None):
    """Which keys each query sees, against B K Q T S scores: causal by positions (in
    any order, such as layout.py's zigzag) and, given starts, in the same document."""
    causal_TS = q_positions_T[:, None] >= kv_positions_S[None, :]
    if q_starts_BT is None:
        return causal_TS
    return (causal_TS & same_document(q_starts_BT, kv_starts_BS))[:, None, None]


def attend_block(carry, q_BTKQA, k_BSKA, v_BSKA, mask):
    """Fold one block of keys and values into a block of (scaled) queries' online
    softmax; ``carry``: the unnormalised output, running maximum and sum, float32."""
    out_BTKQA, max_BKQT, sum_BKQT = carry
    k_BSKA, v_BSKA = k_BSKA.astype(jnp.float32), v_BSKA.astype(jnp.float32)
    s_BKQTS = jnp.where(mask, jnp.einsum("btkqa,bska->bkqts", q_BTKQA, k_BSKA), MASKED)
    new_max_BKQT = jnp.maximum(max_BKQT, s_BKQTS.max(-1))
    p_BKQTS = jnp.where(mask, jnp.exp(s_BKQTS - new_max_BKQT[..., None]), 0.0)
    # rescales the earlier blocks' terms to the new maximum
    rescale_BKQT = jnp.exp(max_BKQT - new_max_BKQT)
    sum_BKQT = sum_BKQT * rescale_BKQT + p_BKQTS.sum(-1)
    out_BTKQA = out_BTKQA * rescale_BKQT.transpose(0, 3, 1, 2)[..., None] + jnp.einsum(
        "bkqts,bska->btkqa", p_BKQTS, v_BSKA
    )
    return out_BTKQA, new_max_BKQT, sum_BKQT


def finalise(carry) -> tuple[jax.Array, jax.Array]:
    """The carry -> (the normalised output, each query's log-sum-exp)."""
    # A query that saw no key gets output 0 and log-sum-exp MASKED, so that merging it
    # with another part gives that part.
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
    """The largest block up to ``block`` that divides ``length`` (768 -> 384)."""
    return next(size for size in range(min(block, length), 0, -1) if length % size == 0)


def can_see(q_positions_T, kv_positions_S, q_starts_BT=None) -> jax.Array:
    """Whether any query of a query block may see any key of a key block; if not, the
    pair is skipped (above the causal diagonal, or before all its queries' documents).
    """
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
    """Causal attention of (scaled) queries on one part of the keys, in blocks:
    (output, log-sum-exp), float32. Memory O(T x block), forward and backward."""
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
        # *_like: inside shard_map the carry varies over the mesh axes the queries do.
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


# FlashAttention-2's backward (Dao 2023, arXiv:2307.08691): keep only the output and
# log-sum-exp, and recompute each block's probabilities from them.
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
    """Causal attention in blocks with an online softmax, never forming the T x S
    scores (arXiv:1805.02867; FlashAttention, arXiv:2205.14135); float32 inside."""
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
    """Causal attention on one device's share of a sequence split over ``axis``, inside
    jax.shard_map (ring attention, arXiv:2310.01889). ``positions_T`` and ``starts_BT``
    come whole along the sequence, in the tokens' order (any, such as the zigzag)."""
    n, i = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    T = q_BTNA.shape[1]
    share = lambda device: jax.lax.dynamic_slice_in_dim(positions_T, device * T, T)
    row_share = lambda device: (
        None
        if starts_BT is None
        else jax.lax.dynamic_slice_in_dim(starts_BT, device * T, T, axis=1)
    )
    q_BTKQA = grouped(q_BTNA, k_BTKA.shape[2])
    # The keys and values travel around the ring in the compute dtype; each device
    # keeps its queries and merges each step's part by log-sum-exp.
    k_BSKA, v_BSKA = k_BTKA, v_BTKA
    result = None
    # At each step, the keys and values that started on device i - step.
    for step in range(n):
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
        # Pass the block on: device j sends to j + 1.
        if step < n - 1:
            ring = [(j, (j + 1) % n) for j in range(n)]
            k_BSKA, v_BSKA = jax.lax.ppermute((k_BSKA, v_BSKA), axis, ring)
    return result[0].reshape(q_BTNA.shape).astype(q_BTNA.dtype)


def document_mask(starts_BT) -> jax.Array | None:
    """jax.nn.dot_product_attention's mask (B, 1, T, S) for document starts, or None."""
    return None if starts_BT is None else same_document(starts_BT, starts_BT)[:, None]


def cudnn_attention(q_BTNA, k_BTKA, v_BTKA, starts_BT=None):
    """cuDNN's fused causal attention (NVIDIA GPUs), in bfloat16, the type its kernel
    takes; the output in the queries' dtype."""
    # Document starts go to cuDNN as a T x S bias per row (jax 0.10.2's API has no
    # packed-document layout): memory quadratic in the sequence again.
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
    """The mesh axes a shard_map with these specs makes manual: those named or of size
    over 1, less those already manual (inside a pipeline stage, 'pipeline')."""
    # Not the axes of size 1: with the check off, shard_map's backward would sum the
    # gradients over them, all-reduces that move nothing but stay in the program.
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
    """``attend(q_BTNA, k_BTKA, v_BTKA, *extra)`` run by jax.shard_map on each device's
    batch rows and heads, the whole sequence on each, so that XLA partitions no kernel
    call or loop of blocks (jax-ml/jax#25986); unwrapped outside a mesh."""

    def call(q_BTNA, k_BTKA, v_BTKA, *extra):
        if jax.sharding.get_abstract_mesh().empty:
            return attend(q_BTNA, k_BTKA, v_BTKA, *extra)
        q_spec = nn.logical_to_mesh_axes(("batch", None, "act_heads", None))
        kv_spec = nn.logical_to_mesh_axes(("batch", None, "act_kv_heads", None))
        row_spec = nn.logical_to_mesh_axes(("batch", None))
        # Positions (1-D) go whole to every device; document starts (B, T) by rows.
        # The query heads split as the key/value heads do, so each finds its shared
        # key/value head on its device.
        extra_specs = (P() if x.ndim == 1 else row_spec for x in extra)
        in_specs = (q_spec, kv_spec, kv_spec, *extra_specs)
        on_each = jax.shard_map(
            attend,
            in_specs=in_specs,
            out_specs=q_spec,
            # A kernel (Mosaic's, cuDNN's) must be manual over every axis: XLA cannot
            # partition its call, even over axes of size 1.
            axis_names=every_axis() if kernel else manual_axes(q_spec, kv_spec),
            # Under step.py's accumulation, vmapped over 'data', the queries vary over
            # 'data' and the positions do not, and the chunked loop's optimization
            # barrier takes both: JAX's check fails. Nothing here communicates.
            check_vma=False,
        )
        return on_each(q_BTNA, k_BTKA, v_BTKA, *extra)

    return call
