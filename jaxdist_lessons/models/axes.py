"""Logical axis names for the models' parameters and activations, and the helpers that attach them.

Both Transformer stacks (``transformer.Decoder`` and ``vit.ViT``) name their dimensions with this
one set of names; chapter 09_flax_partitioning's rules (``partitioning.RULES``) map each name to a mesh axis, or
to nothing (replicated)::

    parameters:  vocab (vocabulary), embed (hidden), mlp (MLP hidden), heads, kv (per head),
                 patch (pixels of a patch), classes, posn (token positions)
    activations: batch, seq, act_embed, act_mlp, act_heads

A parameter created through ``named`` carries its names in a ``nn.LogicallyPartitioned`` box;
with ``enabled=False`` the initializer is returned as is, and the parameter is a plain array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

PARAMETER_AXES = ("vocab", "embed", "mlp", "heads", "kv", "patch", "classes", "posn")
ACTIVATION_AXES = ("batch", "seq", "act_embed", "act_mlp", "act_heads")

Names = tuple[str | None, ...]


def _known(names: Names, allowed: tuple[str, ...]) -> Names:
    unknown = [n for n in names if n is not None and n not in allowed]
    if unknown:
        raise ValueError(
            f"unknown logical axis {unknown[0]!r}; allowed: {', '.join(allowed)}"
        )
    return names


def named(init: Callable, *names: str | None, enabled: bool = True) -> Callable:
    """``init`` boxed with logical axis names, one per dimension (``None``: no name); as is if not ``enabled``."""
    names = _known(names, PARAMETER_AXES)
    return nn.with_logical_partitioning(init, names) if enabled else init


def dense_inits(
    kernel: Names, bias: Names, enabled: bool = True
) -> dict[str, Callable]:
    """A dense layer's ``kernel_init`` and ``bias_init`` (Flax's defaults: LeCun normal, zeros), named."""
    return {
        "kernel_init": named(nn.initializers.lecun_normal(), *kernel, enabled=enabled),
        "bias_init": named(nn.initializers.zeros_init(), *bias, enabled=enabled),
    }


def layer_norm(
    name: str, dtype: Any, param_dtype: Any, enabled: bool = True
) -> nn.LayerNorm:
    """A LayerNorm whose scale and bias are named ``('embed',)``."""
    return nn.LayerNorm(
        dtype=dtype,
        param_dtype=param_dtype,
        name=name,
        scale_init=named(nn.initializers.ones_init(), "embed", enabled=enabled),
        bias_init=named(nn.initializers.zeros_init(), "embed", enabled=enabled),
    )


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Ask for an activation's layout by logical names; without rules in context it does nothing."""
    return nn.with_logical_constraint(x, _known(names, ACTIVATION_AXES))
