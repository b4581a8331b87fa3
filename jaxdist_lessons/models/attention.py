"""Scaled dot-product attention, the part that the decoder (chapter 06_performance) and the ViT (chapter 09_flax_partitioning) share.

The two models differ in their projections (Flax's ``DenseGeneral`` in the decoder, one einsum
with logically named kernels in the ViT) and in the mask (causal in the decoder, none in the
ViT); what happens between the projections is this function.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Dtype = Any


def head_dim(hidden: int, num_heads: int) -> int:
    """The size of each head when ``hidden`` features are split over ``num_heads`` heads."""
    if hidden % num_heads:
        raise ValueError(
            f"hidden size {hidden} is not divisible by num_heads={num_heads}"
        )
    return hidden // num_heads


def attend(
    q_BTNA: jax.Array,
    k_BSNA: jax.Array,
    v_BSNA: jax.Array,
    *,
    causal: bool,
    dtype: Dtype,
) -> jax.Array:
    """``softmax(q k^T / sqrt(head_dim)) v`` per head: ``(B, T, N, A)`` queries to ``(B, T, N, A)``.

    With ``causal``, query ``t`` sees keys ``0..t`` only. The softmax runs in float32 whatever
    ``dtype`` is: bf16's 7 explicit mantissa bits are too coarse for its sums.
    """
    head_dim = q_BTNA.shape[-1]
    scores_BNTS = jnp.einsum("btna,bsna->bnts", q_BTNA, k_BSNA) / jnp.sqrt(
        head_dim
    ).astype(dtype)
    if causal:
        t, s = scores_BNTS.shape[-2:]
        visible_TS = jnp.tril(jnp.ones((t, s), bool))
        scores_BNTS = jnp.where(
            visible_TS, scores_BNTS, jnp.finfo(scores_BNTS.dtype).min
        )
    weights_BNTS = jax.nn.softmax(scores_BNTS.astype(jnp.float32), axis=-1).astype(
        dtype
    )
    return jnp.einsum("bnts,bsna->btna", weights_BNTS, v_BSNA)
