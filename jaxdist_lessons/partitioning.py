"""Flax partitioning by logical axis names: one model, many layouts, chosen by rules (chapter 09_flax_partitioning).

A model names the dimensions of its parameters and activations with *logical* names
(``'embed'``, ``'mlp'``, ``'heads'``, ``'batch'``...; see ``models/vit.py``). A rule set maps each
logical name to a mesh axis, or to nothing (replicated). Swapping the rule set changes the
strategy:

- ``data``: only the batch is split (over ``'data'``); every device holds every parameter;
- ``fsdp``: the batch and the parameters are split over ``'fsdp'`` (ZeRO-3);
- ``tensor``: attention heads, the MLP's hidden units and an LM's vocabulary are split over ``'tensor'`` (Megatron);
- ``hybrid``: ``data`` and ``tensor`` together on a 2-D mesh;
- ``fsdp+tensor``: ``fsdp`` and ``tensor`` together.

The Linen recipe is chapter 05_resnet50's, ``train.create_train_state``: ``jax.eval_shape(init)`` gives boxed
(``nn.LogicallyPartitioned``) shapes, ``nn.get_partition_spec`` their logical specs,
``nn.logical_to_mesh_sharding`` the ``NamedSharding`` of every leaf under a rule set, and
``jax.jit(init, out_shardings=...)`` creates the state already sharded; ``train.fit`` trains it.
The step runs inside ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(rules)``, which the
caller enters. Chapter 09_flax_partitioning writes the same, and the NNX version, in its cells.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from jax.sharding import AxisType, Mesh, NamedSharding

from jaxdist_lessons import mesh as mesh_lib
from jaxdist_lessons import train as train_lib

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# The 3-axis mesh of chapter 09_flax_partitioning, in the book's one order (mesh.AXIS_NAMES).
MESH_AXES = tuple(a for a in mesh_lib.AXIS_NAMES if a in ("data", "fsdp", "tensor"))

_DATA: LogicalRules = (("batch", "data"),)
# Priority order matters: a mesh axis goes to the first listed name a parameter has, so
# a kernel ('embed', 'mlp') is split on 'embed', and a bias ('mlp',) still finds 'fsdp'
# through 'mlp'.
_FSDP_PARAMS: LogicalRules = (
    ("embed", "fsdp"),
    ("mlp", "fsdp"),
    ("heads", "fsdp"),
    ("vocab", "fsdp"),
)
_TENSOR: LogicalRules = (
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
)

RULES: dict[str, LogicalRules] = {
    "data": _DATA,
    "fsdp": (("batch", "fsdp"), *_FSDP_PARAMS),
    "tensor": _TENSOR,
    "hybrid": (*_DATA, *_TENSOR),
    "fsdp+tensor": (("batch", "fsdp"), *_TENSOR, *_FSDP_PARAMS),
}
STRATEGIES = tuple(RULES)

# For the article's 4-axis mesh, in our names ('data', 'fsdp', 'tensor', 'pipeline'): the batch over 'data' and
# 'fsdp' together, FSDP and tensor parallelism as above. No rule names 'pipeline', so every device
# along it holds the same blocks: the name alone pipelines nothing (see ``pipeline.py``).
FOUR_AXIS_RULES: LogicalRules = (("batch", ("data", "fsdp")), *_TENSOR, *_FSDP_PARAMS)


def rules_for(strategy: str) -> LogicalRules:
    """The logical-axis rules of a strategy; ``ValueError`` naming the known ones otherwise."""
    if strategy not in RULES:
        raise ValueError(
            f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}"
        )
    return RULES[strategy]


def mesh_shape_for(
    strategy: str, num_devices: int, tensor: int = 2
) -> tuple[int, int, int]:
    """Sizes of ``('data', 'fsdp', 'tensor')`` for a strategy on ``num_devices`` devices.

    Pure strategies put every device on their one axis; the 2-D ones put ``tensor`` devices
    (at most ``num_devices``) on ``'tensor'`` and the rest on ``'data'`` or ``'fsdp'``.
    """
    rules_for(strategy)
    n = num_devices
    tensor = min(tensor, n)
    shapes = {
        "data": {"data": n, "fsdp": 1, "tensor": 1},
        "fsdp": {"data": 1, "fsdp": n, "tensor": 1},
        "tensor": {"data": 1, "fsdp": 1, "tensor": n},
        "hybrid": {"data": -1, "fsdp": 1, "tensor": tensor},
        "fsdp+tensor": {"data": 1, "fsdp": -1, "tensor": tensor},
    }
    return mesh_lib.mesh_shape(n, **shapes[strategy])


def strategy_mesh(
    strategy: str, num_devices: int | None = None, tensor: int = 2
) -> Mesh:
    """A ``('data', 'fsdp', 'tensor')`` mesh with Auto axes, shaped for ``strategy``.

    Auto, because Linen's ``with_logical_constraint`` is a sharding *constraint* that XLA
    propagates from; Explicit axes make sharding part of every type instead. With
    ``num_devices``, the mesh holds the first ``num_devices`` devices.
    """
    n = jax.device_count() if num_devices is None else num_devices
    return jax.make_mesh(
        mesh_shape_for(strategy, n, tensor),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=jax.devices()[:n],
    )


def batch_sharding(mesh: Mesh, rules: LogicalRules) -> NamedSharding:
    """Where the leading (``'batch'``) dimension of the inputs goes under ``rules``."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes(("batch",), rules))


# --- Training under a rule set ----------------------------------------------------------------


def make_train_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    mesh: Mesh,
    rules: LogicalRules,
    shardings: Any,
) -> Callable:
    """``step(state, batch) -> (state, {'loss'})``, jitted for these shardings; it donates ``state``.

    Call and lower it inside ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(rules)``, so
    that the model's ``with_logical_constraint`` calls take effect. Leave the rules out for a
    model that names only its parameters and uses Flax's ``DenseGeneral`` with named
    multi-dimensional kernels (the decoder): at every call Flax traces the kernel's initializer,
    which builds the kernel flat, and a rule set in context rejects a 3-name constraint on the
    flat kernel.
    """
    return train_lib.jit_step(
        train_lib.loss_step(loss_fn), shardings, batch_sharding(mesh, rules)
    )


@dataclasses.dataclass
class StrategyRun:
    """What ``train_strategy`` did: the loss of every step, the final state, the compiled step, its mesh."""

    losses: list[float]
    state: train_lib.TrainState
    program: jax.stages.Compiled
    mesh: Mesh


def train_strategy(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], jax.Array],
    batches: Sequence[Any],
    mesh: Mesh,
    rules: LogicalRules,
    tx: optax.GradientTransformation | None = None,
    seed: int = 0,
    sample: Any = None,
) -> StrategyRun:
    """Train ``model`` on ``batches`` (one step each) on ``mesh`` under the logical
    ``rules``.

    Chapter 09_flax_partitioning's training cell as a function. ``loss_fn(params,
    batch)``; ``sample`` is what ``model.init`` is called on (by default the first
    example of the first batch's first array). The state is
    ``train.create_train_state``'s, the step ``make_train_step``'s, compiled once, ahead
    of time, and ``train.fit`` runs it. Call it inside ``jax.set_mesh(mesh)`` and
    ``nn.logical_axis_rules(rules)`` (see ``make_train_step``).
    """
    if not batches:
        raise ValueError("train_strategy needs at least one batch")
    tx = optax.adam(1e-3) if tx is None else tx
    sample = jax.tree.leaves(batches[0])[0][:1] if sample is None else sample
    state = train_lib.create_train_state(
        model,
        tx,
        sample.shape[1:],
        train_lib.rule_shardings(mesh, rules),
        jax.random.key(seed),
        input_dtype=sample.dtype,
    )
    placed = [jax.device_put(batch, batch_sharding(mesh, rules)) for batch in batches]
    step = make_train_step(loss_fn, mesh, rules, train_lib.shardings_of(state))
    program = step.lower(state, placed[0]).compile()
    state, history = train_lib.fit(
        state, program, None, lambda epoch: placed, None, epochs=1, progress=False
    )
    return StrategyRun([row["loss"] for row in history.train], state, program, mesh)
