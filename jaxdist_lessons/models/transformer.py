"""A small GPT-style decoder in Flax Linen: pre-LayerNorm blocks of causal self-attention and an MLP.

Chapter 06_performance measures its collectives and memory; chapter 09_flax_partitioning shards it by logical axis names.
The parameter count matches ``memory.transformer_params``: ``12 h^2 + 13 h`` per block, token and
position embeddings, a final LayerNorm, and an output projection tied to the token embedding.

Parameter paths (what sharding rules match against), for block ``i``::

    Block_i/attention/{query,key,value}/kernel   (hidden, heads, head_dim)
    Block_i/attention/{query,key,value}/bias     (heads, head_dim)
    Block_i/attention/out/kernel                 (heads, head_dim, hidden)
    Block_i/mlp/{up,down}/{kernel,bias}          (hidden, mlp) / (mlp, hidden)
    Block_i/{ln_attention,ln_mlp}/{scale,bias}   (hidden,)
    embed/embedding (vocab, hidden), position (max_len, hidden), ln_final/{scale,bias}

``dtype`` is the compute dtype and ``param_dtype`` the storage dtype, as in every Flax layer:
``dtype=jnp.bfloat16`` with the default ``param_dtype=jnp.float32`` is mixed precision.

``logical_axes=True`` (default ``False``, which leaves the parameters plain arrays) creates every
parameter through ``axes.named``, with ``models/axes.py``'s logical names, which chapter 09_flax_partitioning's rules
(``jaxdist_lessons.partitioning.RULES``) map to the mesh::

    embed/embedding ('vocab', 'embed'), position ('posn', 'embed')
    {query,key,value}/kernel ('embed', 'heads', 'kv'), bias ('heads', 'kv')
    out/kernel ('heads', 'kv', 'embed'), bias ('embed',)
    mlp/up/kernel ('embed', 'mlp'), bias ('mlp',); mlp/down/kernel ('mlp', 'embed'), bias ('embed',)
    every LayerNorm's scale and bias ('embed',)

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen.linear import default_embed_init

from jaxdist_lessons.models import attention, axes

Dtype = Any


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and the positions before it."""

    num_heads: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    logical_axes: bool = False

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        hidden = x_BTD.shape[-1]
        head_dim = attention.head_dim(hidden, self.num_heads)
        project = lambda name: nn.DenseGeneral(
            (self.num_heads, head_dim),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
            **axes.dense_inits(
                ("embed", "heads", "kv"), ("heads", "kv"), self.logical_axes
            ),
        )(x_BTD)
        q_BTNA, k_BTNA, v_BTNA = project("query"), project("key"), project("value")
        out_BTNA = attention.attend(
            q_BTNA, k_BTNA, v_BTNA, causal=True, dtype=self.dtype
        )
        return nn.DenseGeneral(
            hidden,
            axis=(-2, -1),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="out",
            **axes.dense_inits(("heads", "kv", "embed"), ("embed",), self.logical_axes),
        )(out_BTNA)


class MLP(nn.Module):
    """Two Dense layers with a GELU between: hidden to ``mlp_ratio * hidden`` and back."""

    mlp_ratio: int = 4
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    logical_axes: bool = False

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        hidden = x_BTD.shape[-1]
        names = {
            "up": (("embed", "mlp"), ("mlp",)),
            "down": (("mlp", "embed"), ("embed",)),
        }
        dense = lambda features, name: nn.Dense(
            features,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
            **axes.dense_inits(*names[name], self.logical_axes),
        )
        return dense(hidden, "down")(
            nn.gelu(dense(self.mlp_ratio * hidden, "up")(x_BTD))
        )


class Block(nn.Module):
    """One pre-LayerNorm Transformer block: ``x + attention(ln(x))``, then
    ``x + mlp(ln(x))``."""

    num_heads: int
    mlp_ratio: int = 4
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    logical_axes: bool = False

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        norm = lambda name: axes.layer_norm(
            name, self.dtype, self.param_dtype, self.logical_axes
        )
        x_BTD = x_BTD + CausalSelfAttention(
            self.num_heads,
            self.dtype,
            self.param_dtype,
            self.logical_axes,
            name="attention",
        )(norm("ln_attention")(x_BTD))
        return x_BTD + MLP(
            self.mlp_ratio, self.dtype, self.param_dtype, self.logical_axes, name="mlp"
        )(norm("ln_mlp")(x_BTD))


class Decoder(nn.Module):
    """Token and position embeddings, ``num_layers`` blocks, a final LayerNorm, tied output logits.

    ``remat_policy`` (a ``jax.checkpoint_policies`` function, or ``"full"`` to save nothing
    but each block's input) recomputes activations in the backward pass instead of storing them.
    """

    vocab_size: int
    num_layers: int
    hidden: int
    num_heads: int
    max_len: int
    mlp_ratio: int = 4
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: Callable | str | None = None
    logical_axes: bool = False

    @nn.compact
    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        length = tokens_BT.shape[1]
        if length > self.max_len:
            raise ValueError(
                f"sequence length {length} is longer than max_len={self.max_len}"
            )
        embed = nn.Embed(
            self.vocab_size,
            self.hidden,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="embed",
            embedding_init=axes.named(
                default_embed_init, "vocab", "embed", enabled=self.logical_axes
            ),
        )
        position_TD = self.param(
            "position",
            axes.named(
                nn.initializers.normal(0.02), "posn", "embed", enabled=self.logical_axes
            ),
            (self.max_len, self.hidden),
            self.param_dtype,
        )
        x_BTD = embed(tokens_BT) + position_TD[:length].astype(self.dtype)
        block = Block
        if self.remat_policy is not None:
            policy = None if self.remat_policy == "full" else self.remat_policy
            block = nn.remat(Block, policy=policy)
        for i in range(self.num_layers):
            x_BTD = block(
                self.num_heads,
                self.mlp_ratio,
                self.dtype,
                self.param_dtype,
                logical_axes=self.logical_axes,
                name=f"Block_{i}",
            )(x_BTD)
        x_BTD = axes.layer_norm(
            "ln_final", self.dtype, self.param_dtype, self.logical_axes
        )(x_BTD)
        return embed.attend(x_BTD).astype(jnp.float32)


def next_token_loss(model: nn.Module, params: Any, tokens_BT: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting each token from the ones before it."""
    logits_BTV = model.apply({"params": params}, tokens_BT[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BTV, tokens_BT[:, 1:]
    ).mean()


def random_tokens(
    rng: jax.Array, batch: int, length: int, vocab_size: int
) -> jax.Array:
    """A batch of uniformly random token ids, ``(batch, length)`` int32: enough to measure a step."""
    return jax.random.randint(rng, (batch, length), 0, vocab_size, dtype=jnp.int32)
