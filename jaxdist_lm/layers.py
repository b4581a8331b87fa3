"""What model.py and experts.py share: the logical axes of an activation (constrain)
and of a weight (weight), and the SwiGLU MLP. Shapes as in model.py's legend."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from .model_config import ModelConfig


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's layout by its logical axes (no-op outside the rules)."""
    return nn.with_logical_constraint(x, names)


def weight(init, names: tuple[str, ...]):
    return nn.with_logical_partitioning(init, names)


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        c = self.config
        dense = functools.partial(
            nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32
        )
        up_init = weight(nn.initializers.normal(c.width**-0.5), ("embed", "mlp"))
        gate_BTF = dense(c.mlp_width, kernel_init=up_init, name="gate")(x_BTD)
        up_BTF = dense(c.mlp_width, kernel_init=up_init, name="up")(x_BTD)
        h_BTF = constrain(nn.silu(gate_BTF) * up_BTF, ("batch", "act_seq", "act_mlp"))
        down_init = weight(nn.initializers.normal(c.mlp_width**-0.5), ("mlp", "embed"))
        return dense(c.width, kernel_init=down_init, name="down")(h_BTF)
