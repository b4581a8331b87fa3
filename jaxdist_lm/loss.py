"""The next-token loss: cross-entropy that keeps a split vocabulary split, and a fused
form that computes the logits a chunk of columns at a time, so that no device holds
all of them. Shapes as in model.py's legend."""

import jax
import jax.numpy as jnp


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token loss in float32, written so a split vocabulary stays split."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    # A one-hot product picks the target's logit: an index would gather all V logits
    # onto each device. logsumexp reduces over V with partial maxima and sums.
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
    """cross_entropy(logits_fn(head, x_BTD), targets_BT), ``chunks`` columns at a time,
    so that no device holds all the logits; ``layout`` lays out the head's gradient."""
    if chunks == 1:
        return cross_entropy(logits_fn(head, x_BTD), targets_BT)
    layout = layout or (lambda tree: tree)
    B, T = targets_BT.shape
    count = B * T

    # (B, T, ...) -> (chunks, B, T / chunks, ...). Chunk c holds columns c, c + chunks,
    # ...: a split sequence stays split.
    def split(a):
        return jnp.moveaxis(a.reshape(B, T // chunks, chunks, *a.shape[2:]), 2, 0)

    # the chunk's loss, summed over its tokens
    def chunk_loss(head, x_BtD, targets_Bt):
        return cross_entropy(logits_fn(head, x_BtD), targets_Bt) * targets_Bt.size

    @jax.custom_vjp
    def loss(head, x_BTD, targets_BT):
        def add(total, xs):
            return total + chunk_loss(head, *xs), None

        chunks_ = (split(x_BTD), split(targets_BT))
        return jax.lax.scan(add, jnp.zeros((), jnp.float32), chunks_)[0] / count

    # Each chunk's logits, their gradient and its share of the head's and the inputs'
    # gradients are computed together here (three matrix products a chunk, nothing
    # recomputed); the backward pass only scales them.
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
