"""Flax partitioning by logical axis names: one model, many layouts, chosen by rules (chapter 9).

A model names the dimensions of its parameters and activations with *logical* names
(``'embed'``, ``'mlp'``, ``'heads'``, ``'batch'``...; see ``models/vit.py``). A rule set maps each
logical name to a mesh axis, or to nothing (replicated). Swapping the rule set changes the
strategy:

- ``data``: only the batch is split (over ``'data'``); every device holds every parameter;
- ``fsdp``: the batch and the parameters are split over ``'fsdp'`` (ZeRO-3);
- ``tensor``: attention heads, the MLP's hidden units and an LM's vocabulary are split over ``'tensor'`` (Megatron);
- ``hybrid``: ``data`` and ``tensor`` together on a 2-D mesh;
- ``fsdp+tensor``: ``fsdp`` and ``tensor`` together.

The Linen recipe is chapter 5's, ``train.create_train_state``: ``jax.eval_shape(init)`` gives boxed
(``nn.LogicallyPartitioned``) shapes, ``nn.get_partition_spec`` their logical specs,
``nn.logical_to_mesh_sharding`` the ``NamedSharding`` of every leaf under a rule set, and
``jax.jit(init, out_shardings=...)`` creates the state already sharded; ``train.fit`` trains it.
The NNX equivalents are at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import mesh as mesh_lib
from jaxdist_lessons import train as train_lib
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.models.small import NNXMLP
from jaxdist_lessons.sharding import path_name

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

MESH_AXES = ("data", "fsdp", "tensor")

_DATA: LogicalRules = (("batch", "data"),)
# Priority order matters: a mesh axis goes to the first listed name a parameter has, so a kernel
# ('embed', 'mlp') is split on 'embed', and a bias ('mlp',) still finds 'fsdp' through 'mlp'.
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
    return mesh_lib.make_mesh(
        mesh_shape_for(strategy, n, tensor),
        MESH_AXES,
        axis_types=AxisType.Auto,
        devices=jax.devices()[:n],
    )


def four_axis_shape(num_devices: int) -> tuple[int, int, int, int]:
    """Sizes of ``('data', 'fsdp', 'tensor', 'pipeline')`` on ``num_devices``: ``(1, 2, 2, 2)`` on 8.

    With fewer than 8 devices ``pipeline`` shrinks to 1 first, then ``fsdp`` (``(1, 2, 2, 1)`` on 4,
    ``(1, 1, 2, 1)`` on 2); ``tensor`` stays 2 down to 2 devices. With more, ``fsdp`` grows.
    """
    n = positive_int("num_devices", num_devices)
    pipeline = 2 if n >= 8 else 1
    tensor = 2 if n >= 2 else 1
    return tuple(
        mesh_lib.mesh_shape(n, data=1, fsdp=-1, tensor=tensor, pipeline=pipeline)
    )


def four_axis_mesh(num_devices: int | None = None) -> Mesh:
    """The article's 4-axis mesh done right, ``('data', 'fsdp', 'tensor', 'pipeline')``, shaped by ``four_axis_shape``."""
    n = jax.device_count() if num_devices is None else num_devices
    return mesh_lib.make_mesh(
        four_axis_shape(n),
        (*MESH_AXES, "pipeline"),
        axis_types=AxisType.Auto,
        devices=jax.devices()[:n],
    )


@contextlib.contextmanager
def activate(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """Make ``mesh`` and ``rules`` the context that ``nn.with_logical_constraint`` reads."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


# --- Specs and shardings of a tree ------------------------------------------------------------


def logical_specs(tree: Any) -> Any:
    """The logical ``PartitionSpec`` of every leaf (``P()`` where a leaf carries no names)."""
    return nn.get_partition_spec(tree)


def mesh_specs(tree: Any, rules: LogicalRules) -> Any:
    """The mesh ``PartitionSpec`` of every leaf, with logical names translated by ``rules``."""
    return jax.tree.map(
        lambda spec: nn.logical_to_mesh_axes(tuple(spec), rules),
        logical_specs(tree),
        is_leaf=lambda x: isinstance(x, P),
    )


def batch_sharding(mesh: Mesh, rules: LogicalRules) -> NamedSharding:
    """Where the leading (``'batch'``) dimension of the inputs goes under ``rules``."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes(("batch",), rules))


def describe(tree: Any, mesh: Mesh, rules: LogicalRules) -> list[list[Any]]:
    """One row per leaf: path, shape, logical spec, mesh spec, the block one device holds."""
    rows = []
    leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(tree))
    logical = jax.tree.leaves(logical_specs(tree), is_leaf=lambda x: isinstance(x, P))
    physical = jax.tree.leaves(
        mesh_specs(tree, rules), is_leaf=lambda x: isinstance(x, P)
    )
    for (path, leaf), lspec, mspec in zip(leaves, logical, physical):
        block = NamedSharding(mesh, mspec).shard_shape(leaf.shape)
        rows.append([path_name(path), tuple(leaf.shape), str(lspec), str(mspec), block])
    return rows


# --- Training under a rule set ----------------------------------------------------------------


def make_train_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    mesh: Mesh,
    rules: LogicalRules,
    shardings: Any,
    constrain_activations: bool = True,
) -> Callable:
    """``step(state, batch) -> (state, {'loss'})``, jitted for these shardings; it donates ``state``.

    ``constrain_activations`` puts the rules in context, so the model's ``with_logical_constraint``
    calls take effect. Turn it off for a model that names only its parameters and uses Flax's
    ``DenseGeneral`` with named multi-dimensional kernels (the decoder): at every call Flax traces
    the kernel's initializer, which builds the kernel flat, and a rule set in context rejects a
    3-name constraint on the flat kernel.
    """
    jitted = train_lib.jit_step(
        train_lib.loss_step(loss_fn), shardings, batch_sharding(mesh, rules)
    )
    context = (
        (lambda: activate(mesh, rules))
        if constrain_activations
        else contextlib.nullcontext
    )

    def run(
        state: train_lib.TrainState, batch: Any
    ) -> tuple[Any, dict[str, jax.Array]]:
        with context():
            return jitted(state, batch)

    def lower(state: train_lib.TrainState, batch: Any) -> jax.stages.Lowered:
        with context():
            return jitted.lower(state, batch)

    run.lower = lower
    return run


@dataclasses.dataclass
class Run:
    """What ``train`` did: the loss of every step, the final state, the compiled step and its mesh."""

    losses: list[float]
    state: train_lib.TrainState
    program: jax.stages.Compiled
    mesh: Mesh


def train(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], jax.Array],
    batches: Sequence[Any],
    strategy: str,
    tx: optax.GradientTransformation | None = None,
    mesh: Mesh | None = None,
    seed: int = 0,
    sample: Any = None,
    rules: LogicalRules | None = None,
    constrain_activations: bool = True,
) -> Run:
    """Train ``model`` on ``batches`` (one step each) under a strategy's rules (or ``rules``).

    ``loss_fn(params, batch)``; ``sample`` is what ``model.init`` is called on (by default the
    first example of the first batch's first array). The state is ``train.create_train_state``'s,
    the step is compiled once, ahead of time, and ``train.fit`` runs it.
    ``constrain_activations``: see ``make_train_step``.
    """
    if not batches:
        raise ValueError("train needs at least one batch")
    rules = rules_for(strategy) if rules is None else rules
    mesh = strategy_mesh(strategy) if mesh is None else mesh
    tx = optax.adam(1e-3) if tx is None else tx
    sample = jax.tree.leaves(batches[0])[0][:1] if sample is None else sample
    rng = jax.random.key(seed)
    state = train_lib.create_train_state(
        model, tx, mesh, rules, rng, sample.shape[1:], sample.dtype
    )
    placed = [jax.device_put(batch, batch_sharding(mesh, rules)) for batch in batches]
    step = make_train_step(
        loss_fn, mesh, rules, train_lib.shardings_of(state), constrain_activations
    )
    program = step.lower(state, placed[0]).compile()
    state, history = train_lib.fit(
        state, program, None, lambda epoch: placed, None, epochs=1, progress=False
    )
    return Run([row["loss"] for row in history.train], state, program, mesh)


def create_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    sample: Any,
    mesh: Mesh,
    rules: LogicalRules,
    rng: jax.Array,
) -> tuple[train_lib.TrainState, Any]:
    """Transitional, for tests/test_costmodel.py: ``train.create_train_state`` and its shardings."""
    state = train_lib.create_train_state(
        model, tx, mesh, rules, rng, sample.shape[1:], sample.dtype
    )
    return state, train_lib.shardings_of(state)


# --- NNX: the same idea on stateful modules (``models.small.NNXMLP``) -------------------------


def nnx_sharded_mlp(
    mesh: Mesh, din: int = 16, hidden: int = 64, dout: int = 4, seed: int = 0
) -> NNXMLP:
    """An ``NNXMLP`` created inside ``mesh``, so each parameter is born with its sharding."""
    with jax.set_mesh(mesh):
        return NNXMLP(din, hidden, dout, rngs=nnx.Rngs(seed))


def nnx_optimizer(
    model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh
) -> nnx.Optimizer:
    """An optimizer for ``model``'s ``nnx.Param``s, created inside ``mesh`` so its moments are sharded like them."""
    with jax.set_mesh(mesh):
        return nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def nnx_train_step(
    model: NNXMLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array
) -> jax.Array:
    """One squared-error step on an NNX model; ``model`` and ``optimizer`` are updated in place."""

    def loss_fn(model: NNXMLP) -> jax.Array:
        return jnp.mean((model(x, out_sharding=jax.typeof(y).sharding.spec) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss
