"""ResNet v1.5 in Flax Linen: ResNet18/34 (basic blocks) and ResNet50/101/152 (bottleneck blocks).

v1.5 puts the stride of a downsampling bottleneck block in its 3x3 convolution. The
parameter counts match the published ones (ResNet50: 25,557,032 at 1000 classes).

BatchNorm: under ``jax.jit`` with a batch sharded over devices, the model sees the global
batch, so its batch statistics are already global and ``axis_name`` stays ``None``. Under
``jax.pmap`` or ``jax.shard_map`` each device sees only its shard: pass the mapped axis
name (for example ``axis_name='data'``) so the statistics are averaged across devices.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

ModuleDef = Any


class _Block(nn.Module):
    """What every residual block is given: its width, its convolution and norm layers, its stride."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    strides: int = 1


class BasicBlock(_Block):
    """Two 3x3 convolutions and a shortcut."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = nn.relu(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="proj_conv")(
                residual
            )
            residual = self.norm(name="proj_bn")(residual)
        return nn.relu(residual + y)


class BottleneckBlock(_Block):
    """1x1 down, 3x3 (strided, v1.5), 1x1 up to 4x the width, and a shortcut."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
        y = self.conv(self.filters * 4, (1, 1))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(
                self.filters * 4, (1, 1), self.strides, name="proj_conv"
            )(residual)
            residual = self.norm(name="proj_bn")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """A ResNet for images in NHWC layout; returns logits of shape ``(batch, num_classes)``."""

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    width: float = 1.0
    dtype: Any = jnp.float32
    axis_name: str | None = None

    @nn.compact
    def __call__(self, images_BHWC: jax.Array, train: bool = True) -> jax.Array:
        base = max(1, int(64 * self.width))
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name=self.axis_name,
        )
        x = conv(base, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(
            images_BHWC
        )
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for stage, blocks in enumerate(self.stage_sizes):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = self.block_cls(
                    base * 2**stage, conv=conv, norm=norm, strides=strides
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


def _family(stage_sizes: Sequence[int], block_cls: ModuleDef) -> Callable[..., ResNet]:
    return functools.partial(
        ResNet, stage_sizes=tuple(stage_sizes), block_cls=block_cls
    )


ResNet18 = _family((2, 2, 2, 2), BasicBlock)
ResNet34 = _family((3, 4, 6, 3), BasicBlock)
ResNet50 = _family((3, 4, 6, 3), BottleneckBlock)
ResNet101 = _family((3, 4, 23, 3), BottleneckBlock)
ResNet152 = _family((3, 8, 36, 3), BottleneckBlock)


def partition_rules(tensor_axis: str = "tensor") -> list[tuple[str, P]]:
    """Tensor-parallel rules for a ResNet's variables: output channels over
    ``tensor_axis``.

    Convolution kernels are ``(kh, kw, in, out)`` and the head is
    ``(features, classes)``: both split their last dimension. BatchNorm's per-channel
    scale, bias and statistics follow the channels they normalise. Every other leaf is
    replicated.
    """
    return [
        (r"(conv_init|Conv_\d+|proj_conv)/kernel$", P(None, None, None, tensor_axis)),
        (r"head/kernel$", P(None, tensor_axis)),
        (r"(scale|bias|mean|var)$", P(tensor_axis)),
    ]
