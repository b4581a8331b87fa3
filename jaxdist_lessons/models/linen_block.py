"""The LM recipe's ``Block`` (``jaxdist_lm/model.py``, Flax Linen) written in Flax NNX.

For a team that starts new code in NNX, as Flax's documentation advises: the same
weights under the same paths and logical axis names, and for the same weights the same
output (``tests/models/test_nnx_block.py``); chapter 10_language_model shows it. Only
the modules are new: the arithmetic is the recipe's own functions (``rope``,
``constrain``, ``document_mask``), and the norm repeats the recipe's three lines so that
the two agree to the bit (``nnx.RMSNorm`` orders its operations differently). Kept to
the dense MLP and XLA's attention; the recipe's other attentions and its experts are
functions that a module calls the same way.

The weights carry the recipe's logical names but are not sharded as they are created
(``eager_sharding=False``): NNX reads a name that no rule maps (``head_dim``) as a mesh
axis, where Linen leaves that dimension whole. ``nnx.get_partition_spec`` reads the
names back, and ``nn.logical_to_mesh_sharding`` maps them by the recipe's rules, as the
recipe's ``abstract_state`` does for its Linen model.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxdist_lm import attention as lm_attention
from jaxdist_lm import layers as lm_layers
from jaxdist_lm import model as lm_model

constrain = lm_layers.constrain


def nnx_weight(
    rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int
) -> nnx.Param:
    """A float32 weight drawn as the recipe draws it, N(0, 1/fan_in), named by axis."""
    init = nnx.initializers.normal(fan_in**-0.5)
    named = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(named(rngs.params(), shape, jnp.float32))


class NNXRMSNorm(nnx.Module):
    """The recipe's RMSNorm: statistics in float32, output in the compute type."""

    def __init__(self, width: int, eps: float, dtype: jnp.dtype):
        self.eps, self.dtype = eps, dtype
        ones = nnx.with_partitioning(jnp.ones, ("embed",), eager_sharding=False)
        self.scale = nnx.Param(ones((width,), jnp.float32))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...]).astype(self.dtype)


class NNXAttention(nnx.Module):
    """Grouped-query attention with RoPE; the heads split by column, ``out`` by row."""

    def __init__(self, config, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        c, self.config, self.dtype = config, config, dtype
        D, N, K, A = c.width, c.num_heads, c.num_kv_heads, c.head_width
        self.query = nnx_weight(rngs, (D, N, A), ("embed", "heads", "head_dim"), D)
        self.k = nnx_weight(rngs, (D, K, A), ("embed", "kv_heads", "head_dim"), D)
        self.v = nnx_weight(rngs, (D, K, A), ("embed", "kv_heads", "head_dim"), D)
        self.out = nnx_weight(rngs, (N, A, D), ("heads", "head_dim", "embed"), N * A)

    def __call__(
        self, x_BTD: jax.Array, positions_T: jax.Array, starts_BT: jax.Array | None
    ) -> jax.Array:
        c, cast = self.config, lambda w: w[...].astype(self.dtype)
        # RoPE counts from each document's start, if documents are masked
        at = positions_T if starts_BT is None else positions_T - starts_BT
        rotate = lambda x: lm_model.rope(x, at, c.rope_theta, c.rope_scaling)
        q_BTNA = rotate(jnp.einsum("btd,dna->btna", x_BTD, cast(self.query)))
        k_BTKA = rotate(jnp.einsum("btd,dka->btka", x_BTD, cast(self.k)))
        v_BTKA = jnp.einsum("btd,dka->btka", x_BTD, cast(self.v))
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
        return jnp.einsum("btna,nad->btd", out_BTNA, cast(self.out))


class NNXSwiGLU(nnx.Module):
    """The recipe's dense SwiGLU MLP: ``gate``, ``up`` by column, ``down`` by row."""

    def __init__(self, config, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        D, F = config.width, config.mlp_width

        def dense(d_in: int, d_out: int, names: tuple[str, str]) -> nnx.Linear:
            init = nnx.initializers.normal(d_in**-0.5)
            named = nnx.with_partitioning(init, names, eager_sharding=False)
            return nnx.Linear(
                d_in, d_out, use_bias=False, dtype=dtype, kernel_init=named, rngs=rngs
            )

        self.gate = dense(D, F, ("embed", "mlp"))
        self.up = dense(D, F, ("embed", "mlp"))
        self.down = dense(F, D, ("mlp", "embed"))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        h_BTF = nnx.silu(self.gate(x_BTD)) * self.up(x_BTD)
        return self.down(constrain(h_BTF, ("batch", "act_seq", "act_mlp")))


class NNXBlock(nnx.Module):
    """The recipe's Block in NNX: the parts are made in ``__init__``, used in order."""

    def __init__(self, config, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        self.attention_norm = NNXRMSNorm(config.width, config.norm_eps, dtype)
        self.attention = NNXAttention(config, dtype, rngs=rngs)
        self.mlp_norm = NNXRMSNorm(config.width, config.norm_eps, dtype)
        self.mlp = NNXSwiGLU(config, dtype, rngs=rngs)

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_T: jax.Array,
        starts_BT: jax.Array | None = None,
    ) -> jax.Array:
        whole, residual = lm_model.WHOLE, lm_model.RESIDUAL
        x_BTD = checkpoint_name(x_BTD, lm_model.LAYER_INPUT)  # for --offload
        h = constrain(self.attention_norm(x_BTD), whole)
        x_BTD = constrain(x_BTD + self.attention(h, positions_T, starts_BT), residual)
        h = constrain(self.mlp_norm(x_BTD), whole)
        return constrain(x_BTD + self.mlp(h), residual)
