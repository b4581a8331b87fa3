"""A Llama-style decoder in Flax Linen, with a logical axis name on every weight and activation.

RMSNorm, rotary positions (RoPE), grouped-query attention through jax.nn.dot_product_attention
(which can take cuDNN's fused kernel on GPUs), a SwiGLU MLP, and a scan over the layers with a
rematerialisation policy. The names ("embed", "mlp", "heads", ...) say what an axis means; the
rules in train.py say which mesh axis, if any, splits it.

Shape suffixes: B batch, T sequence, D model width, N query heads, K key/value heads, H head
width, F MLP width, V vocabulary, L layers.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    num_layers: int
    width: int  # D
    num_heads: int  # N
    num_kv_heads: int  # K; N/K query heads share each key/value head (GQA)
    mlp_width: int  # F
    rope_theta: float = 10_000.0
    tie_embeddings: bool = False  # the output projection reuses the embedding table
    norm_eps: float = 1e-5

    @property
    def head_width(self) -> int:  # H
        return self.width // self.num_heads


# Published shapes: Llama 3.2 1B (meta-llama/Llama-3.2-1B, config.json: 16 layers, width 2048,
# 32 heads, 8 KV heads, MLP 8192, tied embeddings) and Llama 3 8B and 70B ("The Llama 3 Herd of
# Models", arXiv:2407.21783, Table 3). All three use a 128,256-token vocabulary and RoPE base
# 500,000. "tiny" and "125m" are ours: tiny trains on a CPU in minutes; 125m has GPT-3 Small's
# depth and width.
PRESETS = {
    "tiny": ModelConfig(2048, 4, 128, 4, 2, 384),
    "125m": ModelConfig(32_768, 12, 768, 12, 4, 2048),
    "1b": ModelConfig(128_256, 16, 2048, 32, 8, 8192, 500_000.0, tie_embeddings=True),
    "8b": ModelConfig(128_256, 32, 4096, 32, 8, 14_336, 500_000.0),
    "70b": ModelConfig(128_256, 80, 8192, 64, 8, 28_672, 500_000.0),
}

REMAT_POLICIES = {
    "none": None,  # keep every activation for the backward pass
    "full": jax.checkpoint_policies.nothing_saveable,  # keep each layer's input only
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's layout by its logical axes (a no-op outside the rules' context)."""
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
        x = x_BTD.astype(
            jnp.float32
        )  # the statistics in float32, whatever the compute type
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale).astype(self.dtype)


def rope(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotate each pair of features by an angle proportional to the token's position."""
    half = x_BTNH.shape[-1] // 2
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_BTH = positions_BT[..., None].astype(jnp.float32) * frequencies
    sin, cos = jnp.sin(angles_BTH)[:, :, None, :], jnp.cos(angles_BTH)[:, :, None, :]
    first, second = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
    return rotated.astype(x_BTNH.dtype)


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    def project(
        self, name: str, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int
    ):
        init = weight(nn.initializers.normal(fan_in**-0.5), names)
        return self.param(name, init, shape, jnp.float32).astype(self.dtype)

    @nn.compact
    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
        c = self.config
        D, N, K, H = c.width, c.num_heads, c.num_kv_heads, c.head_width  # noqa: N806
        # Column-parallel: each 'tensor' device computes its own heads, whole.
        w_DNH = self.project("query", (D, N, H), ("embed", "heads", "head_dim"), D)
        w_kv = [
            self.project(n, (D, K, H), ("embed", "kv_heads", "head_dim"), D) for n in "kv"
        ]
        q_BTNH = rope(jnp.einsum("btd,dnh->btnh", x_BTD, w_DNH), positions_BT, c.rope_theta)
        k_BTKH = rope(
            jnp.einsum("btd,dkh->btkh", x_BTD, w_kv[0]), positions_BT, c.rope_theta
        )
        v_BTKH = jnp.einsum("btd,dkh->btkh", x_BTD, w_kv[1])
        q_BTNH = constrain(q_BTNH, ("batch", "act_seq", "act_heads", None))
        k_BTKH = constrain(k_BTKH, ("batch", "act_seq", "act_kv_heads", None))
        v_BTKH = constrain(v_BTKH, ("batch", "act_seq", "act_kv_heads", None))
        out_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True)
        out_BTNH = constrain(out_BTNH, ("batch", "act_seq", "act_heads", None))
        # Row-parallel: each device's heads give a partial sum, which the layout after the
        # block reduces (an all-reduce, or a reduce-scatter under sequence parallelism).
        w_NHD = self.project("out", (N, H, D), ("heads", "head_dim", "embed"), N * H)
        return jnp.einsum("btnh,nhd->btd", out_BTNH, w_NHD)


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        c = self.config
        dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype,
                                  param_dtype=jnp.float32)  # fmt: skip
        up_init = weight(nn.initializers.normal(c.width**-0.5), ("embed", "mlp"))
        gate_BTF = dense(c.mlp_width, kernel_init=up_init, name="gate")(x_BTD)
        up_BTF = dense(c.mlp_width, kernel_init=up_init, name="up")(x_BTD)
        h_BTF = constrain(nn.silu(gate_BTF) * up_BTF, ("batch", "act_seq", "act_mlp"))
        down_init = weight(nn.initializers.normal(c.mlp_width**-0.5), ("mlp", "embed"))
        return dense(c.width, kernel_init=down_init, name="down")(h_BTF)


# Between blocks the residual stream is split over the batch and, where the rules map
# "act_seq_residual" to 'tensor', over the sequence too (Megatron's sequence parallelism: the
# norms work on T/tensor tokens, and the all-reduces become all-gathers and reduce-scatters).
RESIDUAL = ("batch", "act_seq_residual", "act_embed")
WHOLE = ("batch", "act_seq", "act_embed")


class Block(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, None]:
        c = self.config
        # Each block's input is gathered whole along the sequence (an all-gather where the
        # residual is split over 'tensor'), then split by heads or MLP columns.
        h = constrain(RMSNorm(c.norm_eps, self.dtype, name="attention_norm")(x_BTD), WHOLE)
        x_BTD = constrain(x_BTD + Attention(c, self.dtype, name="attention")(h, positions_BT),
                          RESIDUAL)  # fmt: skip
        h = constrain(RMSNorm(c.norm_eps, self.dtype, name="mlp_norm")(x_BTD), WHOLE)
        x_BTD = constrain(x_BTD + MLP(c, self.dtype, name="mlp")(h), RESIDUAL)
        return x_BTD, None  # nn.scan's (carry, output)


class Transformer(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32  # the compute type; weights stay float32
    remat: str = "full"
    # Layers per loop iteration; num_layers leaves no loop (XLA's cost_analysis counts a
    # loop's body once, whatever its trip count).
    scan_unroll: int = 1

    @nn.compact
    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        c = self.config
        embed = nn.Embed(c.vocab_size, c.width, dtype=self.dtype, param_dtype=jnp.float32,
                         embedding_init=weight(nn.initializers.normal(1.0), ("vocab", "embed")),
                         name="embed")  # fmt: skip
        x_BTD = constrain(embed(tokens_BT), RESIDUAL)
        positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        block = Block
        if self.remat != "none":
            block = nn.remat(Block, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=nn.broadcast, length=c.num_layers, unroll=self.scan_unroll,
                         metadata_params={nn.PARTITION_NAME: "layers"})  # fmt: skip
        x_BTD, _ = layers(c, self.dtype, name="layers")(x_BTD, positions_BT)
        x_BTD = RMSNorm(c.norm_eps, self.dtype, name="final_norm")(x_BTD)
        if c.tie_embeddings:
            logits_BTV = embed.attend(x_BTD)
        else:
            logits_BTV = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype,
                                  param_dtype=jnp.float32, name="unembed",
                                  kernel_init=weight(nn.initializers.normal(c.width**-0.5),
                                                     ("embed", "vocab")))(x_BTD)  # fmt: skip
        # Vocabulary-parallel logits: no device holds a row of all V logits.
        return constrain(logits_BTV, ("batch", "act_seq", "act_vocab"))


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token loss in float32, written so that a split vocabulary stays split.

    logsumexp reduces over V with partial maxima and sums; the target's logit is picked by a
    one-hot product rather than an index, which would gather all V logits onto each device.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    one_hot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=jnp.float32)
    target_logit_BT = jnp.sum(logits_BTV * one_hot_BTV, axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit_BT)


def count_params(config: ModelConfig) -> int:
    """Parameters of a preset, from its shape alone."""
    c, per_layer = config, 0
    per_layer += (
        c.width * c.head_width * (c.num_heads * 2 + c.num_kv_heads * 2)
    )  # q, out, k, v
    per_layer += 3 * c.width * c.mlp_width + 2 * c.width  # gate, up, down; two norms
    embeddings = c.vocab_size * c.width * (1 if c.tie_embeddings else 2)
    return c.num_layers * per_layer + embeddings + c.width


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training flops per token: 6 per weight used in a matmul, plus attention's scores.

    The standard estimate (Kaplan et al. 2020, arXiv:2001.08361, §2.1; PaLM, arXiv:2204.02311,
    App. B): 2 flops per multiply-add, times 3 for the forward and the two backward matmuls. The
    embedding lookup is no matmul; with tied embeddings the table is used once, as the output
    projection. Attention adds 12·L·T·(N·H) per token (the causal mask is not subtracted).
    """
    c = config
    matmul_params = count_params(c) - c.vocab_size * c.width * (
        0 if c.tie_embeddings else 1
    )
    matmul_params -= c.width * (2 * c.num_layers + 1)  # norms' scales multiply, no matmul
    return 6 * matmul_params + 12 * c.num_layers * seq_len * c.num_heads * c.head_width
