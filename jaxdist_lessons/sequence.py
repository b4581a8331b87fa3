"""Long sequences: context parallelism over a ``sequence`` mesh axis, and what it costs.

Three ways to run causal attention when the sequence is split over devices, each a function of
one device's shards, to be run under ``jax.shard_map`` (``over_sequence``):

- ``ring_attention``: keys and values travel around the ring with ``jax.lax.ppermute``; each
  device folds one block at a time into an online softmax (running max and sum), so no device
  ever holds the whole sequence's keys (Liu et al. 2023, arXiv:2310.01889).
- ``gathered_kv_attention``: all-gather the keys and values, attend locally.
- ``ulysses_attention``: two all-to-alls turn a split over the sequence into a split over heads,
  each device attends over the whole sequence for its heads, and one all-to-all turns it back
  (Jacobs et al. 2023, arXiv:2309.14509).

All three take the sequence in the *zigzag* layout (``zigzag``, the recipe's
``layout.zigzag``): cut into ``2n`` chunks, device ``i`` holds chunks ``i`` and ``2n-1-i``, so
that under a causal mask every device has the same work (``causal_work``). The functions know each token's position from the layout and mask
with it. Inside ``shard_map``, T is a device's share of the sequence; ``q_BTNA`` is the layout
of ``jax.nn.dot_product_attention``. Shape suffixes: see jaxdist_lessons.models.

The reference computes every block and masks; a production kernel skips blocks that are wholly
masked, which is where the balance of ``causal_work`` pays.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist_lessons._checks import positive_int
from jaxdist_lm.attention import MASKED as MASKED
from jaxdist_lm.layout import zigzag as zigzag

# The recipe's own: ring attention's token order (zigzag), and MASKED, a finite score so
# that a row with nothing unmasked yet gives no NaN.


def _positions(local_len: int, axis_name: str, device=None) -> jax.Array:
    """The global positions of a device's tokens in the zigzag layout (this device's by default)."""
    n = jax.lax.axis_size(axis_name)
    i = jax.lax.axis_index(axis_name) if device is None else device
    chunk = local_len // 2
    first, second = i * chunk, (2 * n - 1 - i) * chunk
    return jnp.concatenate([first + jnp.arange(chunk), second + jnp.arange(chunk)])


def _fold_block(q, k, v, mask, carry):
    """Fold one block of keys and values into the online softmax (running max, sum,
    output)."""
    m, total, o = carry  # m, total: (B, N, T); o: (B, T, N, A)
    s = jnp.einsum("btna,bsna->bnts", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(mask, s, MASKED)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    rescale = jnp.exp(m - m_new)
    l_new = total * rescale + p.sum(-1)
    o_new = o * rescale.transpose(0, 2, 1)[..., None] + jnp.einsum(
        "bnts,bsna->btna", p, v
    )
    return m_new, l_new, o_new


def ring_attention(q_BTNA, k_BTNA, v_BTNA, axis_name: str = "sequence") -> jax.Array:
    """Causal attention with K, V passed around the ring: n blocks, n-1 ``ppermute``s of
    K and V."""
    n, i = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    B, T, N, A = q_BTNA.shape
    q_pos = _positions(T, axis_name)
    carry = (
        jnp.full((B, N, T), MASKED, q_BTNA.dtype),
        jnp.zeros((B, N, T), q_BTNA.dtype),
        jnp.zeros_like(q_BTNA),
    )
    to_next = [(j, (j + 1) % n) for j in range(n)]
    k, v = k_BTNA, v_BTNA
    for step in range(n):  # unrolled: each permute can overlap the next block's compute
        # whose K, V we hold now
        kv_pos = _positions(T, axis_name, device=(i - step) % n)
        carry = _fold_block(q_BTNA, k, v, q_pos[:, None] >= kv_pos[None, :], carry)
        if step < n - 1:
            k, v = (jax.lax.ppermute(x, axis_name, to_next) for x in (k, v))
    _, total, o = carry
    return o / total.transpose(0, 2, 1)[..., None]


def gathered_kv_attention(
    q_BTNA, k_BTNA, v_BTNA, axis_name: str = "sequence"
) -> jax.Array:
    """Causal attention after an all-gather of K and V over the sequence axis."""
    T = q_BTNA.shape[1]
    q_pos = _positions(T, axis_name)
    k, v = (
        jax.lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (k_BTNA, v_BTNA)
    )
    kv_pos = jnp.asarray(
        zigzag(T * jax.lax.axis_size(axis_name), jax.lax.axis_size(axis_name))
    )
    mask = q_pos[:, None] >= kv_pos[None, :]
    return jax.nn.dot_product_attention(q_BTNA, k, v, mask=mask[None, None])


def ulysses_attention(q_BTNA, k_BTNA, v_BTNA, axis_name: str = "sequence") -> jax.Array:
    """Causal attention with heads split, not the sequence: all-to-all in (q, k, v), and
    out."""
    to_heads = lambda x: jax.lax.all_to_all(x, axis_name, 2, 1, tiled=True)
    q, k, v = to_heads(q_BTNA), to_heads(k_BTNA), to_heads(v_BTNA)  # (B, T_all, N/n, A)
    n = jax.lax.axis_size(axis_name)
    # the whole sequence, zigzag order
    pos = jnp.asarray(zigzag(q_BTNA.shape[1] * n, n))
    mask = pos[:, None] >= pos[None, :]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
    return jax.lax.all_to_all(out, axis_name, 1, 2, tiled=True)  # back to (B, T, N, A)


ATTENTIONS: dict[str, Callable] = {
    "ring": ring_attention,
    "all-gather KV": gathered_kv_attention,
    "Ulysses": ulysses_attention,
}


def over_sequence(attention: Callable, mesh: Mesh, axis: str = "sequence") -> Callable:
    """``attention`` of one device's shards, as a function of whole (zigzag-ordered)
    arrays."""
    spec = P(None, axis)
    return jax.shard_map(
        lambda q, k, v: attention(q, k, v, axis),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )


def causal_work(num_devices: int, layout: str) -> list[float]:
    """Work per device of causal attention, in blocks of (T/n)^2 scores that must be computed.

    ``layout`` is ``"contiguous"`` (device i holds the i-th n-th of the sequence) or ``"zigzag"``.
    A block below the diagonal counts 1, one on the diagonal 1/2 (half of it is masked).
    """
    positive_int("num_devices", num_devices)
    n = num_devices
    if layout == "contiguous":
        owned, size = [[i] for i in range(n)], 1.0
    elif layout == "zigzag":
        owned, size = [[i, 2 * n - 1 - i] for i in range(n)], 0.5
    else:
        raise ValueError(f"unknown layout {layout!r}; allowed: contiguous, zigzag")
    # chunk q sees every chunk before it whole, and half of itself
    return [sum((c + 0.5) * size * size for c in chunks) for chunks in owned]


def kv_bytes(
    batch: int, seq_len: int, heads: int, head_dim: int, itemsize: int = 4
) -> int:
    """Bytes of K and V together for the whole sequence."""
    return 2 * batch * seq_len * heads * head_dim * itemsize


def predicted_bytes(
    kind: str,
    batch: int,
    seq_len: int,
    heads: int,
    head_dim: int,
    num_devices: int,
    itemsize: int = 4,
) -> dict[str, float]:
    """What one device's forward pass moves, by theory: the collective kind -> bytes of its results, and sent.

    ``"result"`` is what ``comms.bytes_by_kind`` reads (the size of each op's result); ``"sent"``
    is what a ring algorithm puts on the wire from each device.
    """
    n = num_devices
    full_kv = kv_bytes(batch, seq_len, heads, head_dim, itemsize)
    if kind == "ring":  # n-1 steps, each passes on this device's current K, V chunk
        moved = (n - 1) * full_kv / n
        return {"collective-permute": moved, "sent": moved}
    if kind == "all-gather KV":  # the gathered K and V
        return {"all-gather": full_kv, "sent": (n - 1) / n * full_kv}
    # q, k, v in and out back: 4 local blocks, (n-1)/n of each leaves
    if kind == "Ulysses":
        block = full_kv / 2 / n
        return {"all-to-all": 4 * block, "sent": 4 * (n - 1) / n * block}
    raise ValueError(f"unknown attention {kind!r}; allowed: {', '.join(ATTENTIONS)}")


def megatron_bytes(
    batch: int, seq_len: int, width: int, tensor: int, itemsize: int = 4
) -> dict[str, dict[str, float]]:
    """Bytes of one row-parallel block's collectives per device: tensor parallel vs sequence parallel.

    Each entry maps a kind to its result's bytes, and ``"sent"`` to what a ring sends: an
    all-reduce sends 2(t-1)/t of the activation; an all-gather plus a reduce-scatter (t-1)/t each.
    """
    full = batch * seq_len * width * itemsize
    share = (tensor - 1) / tensor * full
    return {
        "tensor": {"all-reduce": full, "sent": 2 * share},
        "tensor + sequence": {
            "all-gather": full,
            "reduce-scatter": full / tensor,
            "sent": 2 * share,
        },
    }
