"""A small Vision Transformer (ViT) whose parameters and activations carry logical axis names (chapter 09_flax_partitioning).

Every parameter is created through ``axes.named``, so it carries logical names such as
``('embed', 'mlp')`` (``models/axes.py``'s set, shared with ``transformer.Decoder``) rather than
mesh axes; a set of rules (``jaxdist_lessons.partitioning.RULES``) maps those names to the mesh
at run time. One model then runs under data parallelism, FSDP, tensor parallelism or a hybrid
by swapping the rules, not by editing the model.

Parameter paths, for block ``i``::

    patch_embed/{kernel,bias}                    (patch, embed) / (embed,)
    cls (1, 1, embed), position (1, tokens, embed)
    Block_i/attention/{query,key,value}/kernel   (embed, heads, kv); bias (heads, kv)
    Block_i/attention/out/kernel                 (heads, kv, embed); bias (embed,)
    Block_i/mlp/{up,down}/kernel                 (embed, mlp) / (mlp, embed)
    Block_i/{ln_attention,ln_mlp}/{scale,bias}, ln_final/{scale,bias}   (embed,)
    head/{kernel,bias}                           (embed, classes) / (classes,)

ViT-B/16 is ``ViT(hidden=768, num_layers=12, num_heads=12, mlp_dim=3072, patch_size=16)``.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxdist_lessons.models import attention, axes

Dtype = Any

zeros = nn.initializers.zeros_init()


def patchify(images_BHWC: jax.Array, patch_size: int) -> jax.Array:
    """Cut images into non-overlapping square patches: ``(B, H, W, C) -> (B, H/p * W/p, p*p*C)``."""
    b, h, w, c = images_BHWC.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image size {(h, w)} is not divisible by patch_size={p}")
    x = images_BHWC.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


class HeadsDense(nn.Module):
    """A dense layer to or from heads, written as one einsum (Flax's DenseGeneral reshapes its
    kernel at init, which breaks the rank of a logical constraint on it)."""

    equation: str
    kernel_shape: tuple[int, ...]
    kernel_names: tuple[str | None, ...]
    bias_shape: tuple[int, ...]
    bias_names: tuple[str | None, ...]
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # LeCun normal, with the fan-in counted over every input dimension of the kernel.
        inputs = tuple(range(len(self.kernel_shape) - len(self.bias_shape)))
        outputs = tuple(range(len(inputs), len(self.kernel_shape)))
        init = nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=inputs, out_axis=outputs
        )
        kernel = self.param(
            "kernel",
            axes.named(init, *self.kernel_names),
            self.kernel_shape,
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            axes.named(zeros, *self.bias_names),
            self.bias_shape,
            self.param_dtype,
        )
        return jnp.einsum(
            self.equation, x.astype(self.dtype), kernel.astype(self.dtype)
        ) + bias.astype(self.dtype)


class Attention(nn.Module):
    """Multi-head self-attention over all tokens (no mask: every patch sees every patch)."""

    num_heads: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        hidden = x_BTD.shape[-1]
        head_dim = attention.head_dim(hidden, self.num_heads)

        def project(name: str) -> jax.Array:
            y = HeadsDense(
                "btd,dna->btna",
                (hidden, self.num_heads, head_dim),
                ("embed", "heads", "kv"),
                (self.num_heads, head_dim),
                ("heads", "kv"),
                self.dtype,
                self.param_dtype,
                name=name,
            )(x_BTD)
            return axes.constrain(y, "batch", "seq", "act_heads", None)

        q_BTNA, k_BTNA, v_BTNA = project("query"), project("key"), project("value")
        out_BTNA = attention.attend(
            q_BTNA, k_BTNA, v_BTNA, causal=False, dtype=self.dtype
        )
        out_BTD = HeadsDense(
            "btna,nad->btd",
            (self.num_heads, head_dim, hidden),
            ("heads", "kv", "embed"),
            (hidden,),
            ("embed",),
            self.dtype,
            self.param_dtype,
            name="out",
        )(out_BTNA)
        return axes.constrain(out_BTD, "batch", "seq", "act_embed")


class MLP(nn.Module):
    """Dense to ``mlp_dim``, GELU, Dense back to the hidden size."""

    mlp_dim: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        hidden = x_BTD.shape[-1]
        h_BTF = nn.Dense(
            self.mlp_dim,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            **axes.dense_inits(("embed", "mlp"), ("mlp",)),
            name="up",
        )(x_BTD)
        h_BTF = axes.constrain(nn.gelu(h_BTF), "batch", "seq", "act_mlp")
        out_BTD = nn.Dense(
            hidden,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            **axes.dense_inits(("mlp", "embed"), ("embed",)),
            name="down",
        )(h_BTF)
        return axes.constrain(out_BTD, "batch", "seq", "act_embed")


class Block(nn.Module):
    """One pre-LayerNorm encoder block: ``x + attention(ln(x))``, then ``x + mlp(ln(x))``."""

    num_heads: int
    mlp_dim: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        norm = lambda name: axes.layer_norm(name, self.dtype, self.param_dtype)
        x_BTD = x_BTD + Attention(
            self.num_heads, self.dtype, self.param_dtype, name="attention"
        )(norm("ln_attention")(x_BTD))
        return x_BTD + MLP(self.mlp_dim, self.dtype, self.param_dtype, name="mlp")(
            norm("ln_mlp")(x_BTD)
        )


class ViT(nn.Module):
    """Patches, a class token and learned positions, ``num_layers`` blocks, a LayerNorm, a linear head."""

    num_classes: int
    patch_size: int
    hidden: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, images_BHWC: jax.Array) -> jax.Array:
        patches_BTP = patchify(images_BHWC, self.patch_size)
        x_BTD = nn.Dense(
            self.hidden,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            **axes.dense_inits(("patch", "embed"), ("embed",)),
            name="patch_embed",
        )(patches_BTP)
        batch, tokens = x_BTD.shape[0], x_BTD.shape[1] + 1
        cls = self.param(
            "cls",
            axes.named(zeros, None, None, "embed"),
            (1, 1, self.hidden),
            self.param_dtype,
        )
        position = self.param(
            "position",
            axes.named(nn.initializers.normal(0.02), None, "posn", "embed"),
            (1, tokens, self.hidden),
            self.param_dtype,
        )
        cls_B1D = jnp.broadcast_to(cls.astype(self.dtype), (batch, 1, self.hidden))
        x_BTD = jnp.concatenate([cls_B1D, x_BTD], axis=1) + position.astype(self.dtype)
        x_BTD = axes.constrain(x_BTD, "batch", "seq", "act_embed")
        for i in range(self.num_layers):
            x_BTD = Block(
                self.num_heads,
                self.mlp_dim,
                self.dtype,
                self.param_dtype,
                name=f"Block_{i}",
            )(x_BTD)
        x_BD = axes.layer_norm("ln_final", self.dtype, self.param_dtype)(x_BTD)[:, 0]
        logits_BO = nn.Dense(
            self.num_classes,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            **axes.dense_inits(("embed", "classes"), ("classes",)),
            name="head",
        )(x_BD)
        return logits_BO.astype(jnp.float32)


def vit_params(
    hidden: int,
    num_layers: int,
    mlp_dim: int,
    patch_size: int,
    image_size: int,
    num_classes: int,
    channels: int = 3,
) -> int:
    """Parameters of ``ViT`` by hand: per block ``4 h^2 + 4 h`` (attention), ``2 h f + f + h`` (MLP), ``4 h`` (norms)."""
    tokens = (image_size // patch_size) ** 2 + 1
    block = (
        4 * hidden * hidden
        + 4 * hidden
        + 2 * hidden * mlp_dim
        + mlp_dim
        + hidden
        + 4 * hidden
    )
    embed = (
        patch_size * patch_size * channels * hidden + hidden + hidden + tokens * hidden
    )
    return num_layers * block + embed + 2 * hidden + hidden * num_classes + num_classes


def classification_loss(
    model: nn.Module, params: Any, batch: dict[str, jax.Array]
) -> jax.Array:
    """Mean cross-entropy of the model's logits for ``batch['images']`` against integer ``batch['labels']``."""
    logits = model.apply({"params": params}, batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["labels"]
    ).mean()
