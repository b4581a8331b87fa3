"""The LM recipe's ``Block`` (``jaxdist_lm/model.py``, Flax NNX) written in Flax Linen.

For a team whose code is still in Linen, and for the measurement that compares the two
APIs (``benchmarks/linen_nnx.py``): the recipe's block as it was written before the
recipe moved to NNX, with the same parameter paths and logical axis names, and for the
same weights the same output (``tests/models/test_linen_block.py``); chapter
10_language_model shows it. Only the modules differ: the arithmetic is the recipe's own
functions (``rope``, ``constrain``, ``document_mask``), and the norm repeats the
recipe's three lines so that the two agree to the bit. Kept to the dense MLP and XLA's
attention; the recipe's other attentions and its experts are functions that a module
calls the same way.

The weights carry the recipe's logical names through ``nn.with_logical_partitioning``;
``nn.get_partition_spec`` reads them back and ``nn.logical_to_mesh_sharding`` maps them
by the recipe's rules, as ``nnx.get_partition_spec`` does for the NNX block. The paths
match, so weights move between the two as pure dicts: ``nnx.update(block, params)`` one
way, ``nnx.to_pure_dict(nnx.state(block))`` the other.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxdist_lm import attention as lm_attention
from jaxdist_lm import layers as lm_layers
from jaxdist_lm import model as lm_model
from jaxdist_lm.model_config import ModelConfig

constrain = lm_layers.constrain


def linen_weight(fan_in: int, names: tuple[str | None, ...]):
    """An initializer of a float32 weight drawn as the recipe draws it, N(0, 1/fan_in),
    named by axis."""
    return nn.with_logical_partitioning(nn.initializers.normal(fan_in**-0.5), names)


class LinenRMSNorm(nn.Module):
    """The recipe's RMSNorm: statistics in float32, output in the compute type."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        scale = self.param("scale", ones, x_BTD.shape[-1:], jnp.float32)
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale).astype(self.dtype)


class LinenAttention(nn.Module):
    """Grouped-query attention with RoPE; the heads split by column, ``out`` by row."""

    config: ModelConfig
    dtype: jnp.dtype

    def project(self, name: str, shape: tuple[int, ...], names, fan_in: int):
        init = linen_weight(fan_in, names)
        return self.param(name, init, shape, jnp.float32).astype(self.dtype)

    @nn.compact
    def __call__(
        self, x_BTD: jax.Array, positions_T: jax.Array, starts_BT: jax.Array | None
    ) -> jax.Array:
        c = self.config
        D, N, K, A = c.width, c.num_heads, c.num_kv_heads, c.head_width
        # RoPE counts from each document's start, if documents are masked
        at = positions_T if starts_BT is None else positions_T - starts_BT
        rotate = lambda x: lm_model.rope(x, at, c.rope_theta, c.rope_scaling)
        w_DNA = self.project("query", (D, N, A), ("embed", "heads", "head_dim"), D)
        w_DKA = self.project("k", (D, K, A), ("embed", "kv_heads", "head_dim"), D)
        w_DKA_v = self.project("v", (D, K, A), ("embed", "kv_heads", "head_dim"), D)
        q_BTNA = rotate(jnp.einsum("btd,dna->btna", x_BTD, w_DNA))
        k_BTKA = rotate(jnp.einsum("btd,dka->btka", x_BTD, w_DKA))
        v_BTKA = jnp.einsum("btd,dka->btka", x_BTD, w_DKA_v)
        heads = ("batch", "act_seq", "act_heads", None)
        kv_heads = ("batch", "act_seq", "act_kv_heads", None)
        q_BTNA = constrain(q_BTNA, heads)
        k_BTKA, v_BTKA = constrain(k_BTKA, kv_heads), constrain(v_BTKA, kv_heads)
        out_BTNA = jax.nn.dot_product_attention(
            q_BTNA,
            k_BTKA,
            v_BTKA,
            mask=lm_attention.document_mask(starts_BT),
            is_causal=True,
        )
        out_BTNA = constrain(out_BTNA, heads)
        w_NAD = self.project("out", (N, A, D), ("heads", "head_dim", "embed"), N * A)
        return jnp.einsum("btna,nad->btd", out_BTNA, w_NAD)


class LinenMLP(nn.Module):
    """The recipe's dense SwiGLU MLP: ``gate``, ``up`` by column, ``down`` by row."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        D, F = self.config.width, self.config.mlp_width
        dense = functools.partial(
            nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32
        )
        up_init = linen_weight(D, ("embed", "mlp"))
        gate_BTF = dense(F, kernel_init=up_init, name="gate")(x_BTD)
        up_BTF = dense(F, kernel_init=up_init, name="up")(x_BTD)
        h_BTF = constrain(nn.silu(gate_BTF) * up_BTF, ("batch", "act_seq", "act_mlp"))
        down_init = linen_weight(F, ("mlp", "embed"))
        return dense(D, kernel_init=down_init, name="down")(h_BTF)


class LinenBlock(nn.Module):
    """The recipe's Block in Linen: the parts are made where they are used."""

    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(
        self,
        x_BTD: jax.Array,
        positions_T: jax.Array,
        starts_BT: jax.Array | None = None,
    ) -> jax.Array:
        c, whole, residual = self.config, lm_model.WHOLE, lm_model.RESIDUAL
        # the name that --offload activations sends to the host
        x_BTD = checkpoint_name(x_BTD, lm_model.LAYER_INPUT)
        norm = LinenRMSNorm(c.norm_eps, self.dtype, name="attention_norm")
        attention = LinenAttention(c, self.dtype, name="attention")
        h = constrain(norm(x_BTD), whole)
        x_BTD = constrain(x_BTD + attention(h, positions_T, starts_BT), residual)
        mlp_norm = LinenRMSNorm(c.norm_eps, self.dtype, name="mlp_norm")
        h = constrain(mlp_norm(x_BTD), whole)
        return constrain(x_BTD + LinenMLP(c, self.dtype, name="mlp")(h), residual)
