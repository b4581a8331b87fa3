"""A deep MLP whose blocks can be rematerialised one by one: the out-of-memory levers' model (chapter 07_troubleshooting)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
    """Dense then GELU, at ``width`` and in ``dtype`` (parameters too)."""

    width: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.gelu(
            nn.Dense(self.width, dtype=self.dtype, param_dtype=self.dtype)(x)
        )


class DeepMLP(nn.Module):
    """``depth`` Dense+GELU blocks then a 10-way head; ``remat`` recomputes each block in the backward pass.

    Not ``small.MLP``: the remat lever needs a module per block (``nn.remat`` of a whole model
    recomputes it all at once and, measured, keeps the same temporaries), GELU's backward pass needs
    its input (so remat has activations to save), and the bf16 lever needs bf16 parameters.
    """

    width: int = 128
    depth: int = 8
    remat: bool = False
    dtype: Any = jnp.float32

    # train: as gradients.loss_fn calls it
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        block = nn.remat(Block) if self.remat else Block
        for _ in range(self.depth):
            x = block(self.width, self.dtype)(x)
        return nn.Dense(10, dtype=self.dtype, param_dtype=self.dtype)(x)
