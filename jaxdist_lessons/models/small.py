"""Small models for the lessons: an MLP and a CNN with BatchNorm (Linen), and a Megatron-split MLP (NNX).

``MLP`` and ``SmallCNN`` are chapter 04_gradients's stand-ins for real models: one without batch statistics and
one with them, because batch statistics are where data parallelism gets subtle. Both take an
``axis_name`` (BatchNorm averages its statistics over it under ``pmap`` or ``shard_map``).
``NNXMLP`` is chapter 09_flax_partitioning's NNX example: its kernels carry partition metadata.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import PartitionSpec as P


class MLP(nn.Module):
    """Flatten, hidden ReLU layers, logits. No batch statistics."""

    features: Sequence[int] = (32, 10)
    axis_name: str | None = None  # unused; here so that every model takes one

    @nn.compact
    def __call__(self, images_BHWC: jax.Array, train: bool = True) -> jax.Array:
        x = images_BHWC.reshape(images_BHWC.shape[0], -1)
        for width in self.features[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.features[-1])(x)


class SmallCNN(nn.Module):
    """Conv, BatchNorm, ReLU, average pool, Dense. BatchNorm averages over ``axis_name`` if given."""

    channels: int = 8
    num_classes: int = 10
    axis_name: str | None = None

    @nn.compact
    def __call__(self, images_BHWC: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(self.channels, (3, 3))(images_BHWC)
        x = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, axis_name=self.axis_name
        )(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


class NNXMLP(nnx.Module):
    """A two-layer MLP in NNX, split Megatron-style: the first kernel by columns, the
    second by rows."""

    def __init__(
        self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs, axis: str = "tensor"
    ):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            din,
            hidden,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, (None, axis)),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axis,)),
        )
        self.down = nnx.Linear(
            hidden,
            dout,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, (axis, None)),
        )

    def __call__(self, x: jax.Array, out_sharding: P | None = None) -> jax.Array:
        # On Explicit axes the row-split matmul must be told where its sum goes
        # (``out_sharding``); on Auto axes XLA chooses.
        return self.down(nnx.gelu(self.up(x)), out_sharding=out_sharding)
