"""What model.py and experts.py share: the logical axes of an activation (constrain)
and of a weight (weight, dense), and the SwiGLU MLP. Shapes as in model.py's legend."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from .model_config import ModelConfig


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's layout by its logical axes (no-op outside the rules)."""
    return nn.with_logical_constraint(x, names)


def by_axes(init, names: tuple[str | None, ...]):
    """``init``, its weight named by axis. Not sharded as it is made (NNX's eager
    sharding needs a mesh, and model.abstract describes a model without one): step.py
    maps the names to mesh axes by layout.py's rules."""
    return nnx.with_partitioning(init, names, eager_sharding=False)


def weight(
    rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], fan_in: int
) -> nnx.Param:
    """A float32 weight drawn from N(0, 1/fan_in), named by axis."""
    init = by_axes(nnx.initializers.normal(fan_in**-0.5), names)
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


def dense(
    d_in: int, d_out: int, names: tuple[str, str], dtype, rngs: nnx.Rngs
) -> nnx.Linear:
    """A float32 kernel without bias, N(0, 1/d_in), used in the compute type."""
    init = by_axes(nnx.initializers.normal(d_in**-0.5), names)
    return nnx.Linear(
        d_in, d_out, use_bias=False, dtype=dtype, kernel_init=init, rngs=rngs
    )


class MLP(nnx.Module):
    """SwiGLU: ``gate`` and ``up`` split by column, ``down`` by row."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        D, F = config.width, config.mlp_width
        self.gate = dense(D, F, ("embed", "mlp"), dtype, rngs)
        self.up = dense(D, F, ("embed", "mlp"), dtype, rngs)
        self.down = dense(F, D, ("mlp", "embed"), dtype, rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        h_BTF = nnx.silu(self.gate(x_BTD)) * self.up(x_BTD)
        return self.down(constrain(h_BTF, ("batch", "act_seq", "act_mlp")))
