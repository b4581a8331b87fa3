"""Data parallelism, ZeRO-1 and FSDP (ZeRO-3): the sharding rule, the bytes theory says they move (chapter 06_performance).

Chapter 06_performance writes FSDP the way a reader would, as ``jax.jit`` of the one-device step with the state
sharded by ``fsdp_spec``: the compiler inserts the collectives. This module holds the rule, the
arithmetic, and the same three strategies written with ``shard_map`` (``make_step``), so that every
collective is one we asked for (``gather_shards``, ``mean_scatter``):

- ``data``: parameters and optimizer state replicated; the gradients are all-reduced.
- ``zero1``: parameters replicated, optimizer state sharded. The gradients are reduce-scattered,
  each device updates its shard of the parameters, and the new shards are all-gathered.
- ``fsdp``: parameters, gradients and optimizer state all sharded. The forward pass all-gathers
  the parameters; autodiff turns that all-gather into a reduce-scatter of the gradients. Each
  parameter is gathered once, and autodiff keeps the full copies for the backward pass: the state
  is sharded between steps, not within one.

FSDP as ZeRO-3 runs it, for a model that is a stack of identical layers (``make_layered_fsdp_step``):
a ``lax.scan`` over the layers whose body, under ``jax.checkpoint``, all-gathers its own layer's
parameters. One layer's gathered parameters are alive at a time; the backward pass gathers each
layer again (``regathering_fsdp_ring_bytes`` gives the bytes, ``expected_layered_bytes`` the memory).

The sharding rule (``fsdp_spec``): split each array along its largest dimension that the devices
divide evenly. An array with no such dimension (a bias of 10 classes on 8 devices, Adam's step
count) stays replicated: the small *remainder*, whose gradients are all-reduced as in ``data``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, compiled, sharding, strategies
from jaxdist_lessons.tables import Table

ZERO_STAGES = strategies.among("data", "zero1", "fsdp")
"""The ``shard_map`` steps of ``make_step``: data parallel, ZeRO-1 and FSDP (ZeRO-3)."""


LossFn = Callable[[Any, Any], jax.Array]


def _check_strategy(strategy: str) -> None:
    if strategy not in ZERO_STAGES:
        raise ValueError(
            f"unknown strategy {strategy!r}; allowed: {', '.join(ZERO_STAGES)}"
        )


def shard_dim(shape: Sequence[int], num_shards: int) -> int | None:
    """The largest dimension of ``shape`` that ``num_shards`` divides (the first, on a tie); ``None`` if none."""
    fits = [
        d
        for d, size in enumerate(shape)
        if size % num_shards == 0 and size >= num_shards
    ]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def fsdp_spec(shape: Sequence[int], mesh: Mesh, axis: str = "data") -> P:
    """The rule: ``axis`` on the array's largest evenly divisible dimension, else
    replicated (``P()``)."""
    dim = shard_dim(shape, mesh.shape[axis])
    return (
        P()
        if dim is None
        else P(*[axis if d == dim else None for d in range(len(shape))])
    )


def _specs(tree: Any, mesh: Mesh, axis: str, sharded: bool) -> Any:
    return jax.tree.map(
        lambda x: fsdp_spec(x.shape, mesh, axis) if sharded else P(), tree
    )


def param_specs(strategy: str, params: Any, mesh: Mesh, axis: str = "data") -> Any:
    """Specs of the parameters: sharded by ``fsdp_spec`` under ``fsdp``, replicated otherwise."""
    _check_strategy(strategy)
    return _specs(params, mesh, axis, strategy == "fsdp")


def opt_state_specs(
    strategy: str, opt_state: Any, mesh: Mesh, axis: str = "data"
) -> Any:
    """Specs of the optimizer state: sharded by ``fsdp_spec`` under ``zero1`` and ``fsdp``, replicated under ``data``."""
    _check_strategy(strategy)
    return _specs(opt_state, mesh, axis, strategy != "data")


def state_specs(
    strategy: str, params: Any, opt_state: Any, mesh: Mesh, axis: str = "data"
) -> tuple[Any, Any]:
    """``(param_specs, opt_state_specs)``: how ``strategy`` keeps the whole state."""
    return (
        param_specs(strategy, params, mesh, axis),
        opt_state_specs(strategy, opt_state, mesh, axis),
    )


def _named(specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )


def copy_to(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """New buffers holding ``tree``, each leaf sharded on ``mesh`` as ``specs`` says.

    New, because the steps donate their inputs, which must not delete the caller's arrays
    (``device_put`` may reuse a buffer already on a device, even with ``may_alias=False``).
    """
    copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)
    return jax.jit(copy, out_shardings=_named(specs, mesh))(tree)


# --- The collectives, leaf by leaf ------------------------------------------------------------


def _dim(spec: P) -> int | None:
    return next((d for d, entry in enumerate(spec) if entry is not None), None)


def _by_spec(
    tree: Any,
    specs: Any,
    replicated: Callable[[Any], Any],
    sharded: Callable[[Any, int], Any],
) -> Any:
    """``replicated(x)`` on each leaf whose spec shards nothing, ``sharded(x, dim)`` on the others."""
    return jax.tree.map(
        lambda x, s: replicated(x) if _dim(s) is None else sharded(x, _dim(s)),
        tree,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def _unchanged(x: Any, *_: Any) -> Any:
    return x


def gather_shards(tree: Any, specs: Any, axis: str, to: str = "varying") -> Any:
    """Each sharded leaf all-gathered to its full shape; replicated leaves as they are.

    ``to="invarying"`` says the result is the same on every device (it may then leave
    ``shard_map`` as ``P()``); the default keeps it per-device, which is what autodiff
    needs to reduce-scatter.
    """
    return _by_spec(
        tree,
        specs,
        _unchanged,
        lambda x, dim: lax.all_gather(x, axis, axis=dim, tiled=True, to=to),
    )


def mean_scatter(grads: Any, specs: Any, axis: str) -> Any:
    """The mean over devices of each gradient: reduce-scattered where sharded,
    all-reduced where not."""
    n = lax.axis_size(axis)
    return _by_spec(
        grads,
        specs,
        lambda g: lax.pmean(g, axis),
        lambda g, dim: lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True) / n,
    )


def _vary_replicated(tree: Any, specs: Any, axis: str) -> Any:
    """The replicated leaves cast to per-device values, so that their gradients stay local until reduced."""
    return _by_spec(tree, specs, lambda x: lax.pcast(x, axis, to="varying"), _unchanged)


def own_shard(tree: Any, specs: Any, axis: str) -> Any:
    """This device's block of each sharded leaf (no communication: the leaf is already here)."""
    index = lax.axis_index(axis)

    def take(x, dim):
        size = x.shape[dim] // lax.axis_size(axis)
        return lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)

    return _by_spec(tree, specs, _unchanged, take)


def fsdp_update(
    loss_of_shards: Callable[[Any], jax.Array],
    tx: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    specs: Any,
    axis: str,
) -> tuple[Any, Any, jax.Array]:
    """One FSDP update inside ``shard_map``: the loss of this device's shards
    differentiated, each gradient reduced once."""
    local = _vary_replicated(params, specs, axis)
    loss, grads = jax.value_and_grad(loss_of_shards)(local)
    n = lax.axis_size(axis)  # the sharded gradients are already reduce-scattered sums
    grads = _by_spec(grads, specs, lambda g: lax.pmean(g, axis), lambda g, _: g / n)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, axis)


# --- The steps --------------------------------------------------------------------------------


def make_step(
    strategy: str,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    params: Any,
    opt_state: Any,
    axis: str = "data",
    donate: bool = True,
) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` for ``strategy``,
    jitted.

    ``params`` and ``opt_state`` (arrays or ``ShapeDtypeStruct``s) give the shapes the
    specs come from; the step takes them placed as ``param_specs`` and
    ``opt_state_specs`` say. The batch is sharded over ``axis``.
    """
    _check_strategy(strategy)
    pspecs, ospecs = state_specs(strategy, params, opt_state, mesh, axis)
    shard_specs = param_specs("fsdp", params, mesh, axis)  # how zero1 splits the update

    # Every step differentiates the *local* loss with respect to per-device ("varying")
    # parameters and then reduces each gradient once. (Differentiating a pmean'd loss
    # with respect to replicated parameters also works, but all-reduces a parameter once
    # per use: twice for a tied embedding.)
    def data_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(
            lax.pcast(params, axis, to="varying"), batch
        )
        grads = lax.pmean(grads, axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, axis)

    def zero1_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(
            lax.pcast(params, axis, to="varying"), batch
        )
        grads = mean_scatter(grads, shard_specs, axis)
        mine = own_shard(params, shard_specs, axis)
        updates, opt_state = tx.update(grads, opt_state, mine)
        new_params = gather_shards(
            optax.apply_updates(mine, updates), shard_specs, axis, to="invarying"
        )
        return new_params, opt_state, lax.pmean(loss, axis)

    def fsdp_step(params, opt_state, batch):
        # The all-gather's transpose is a reduce-scatter (a sum): autodiff writes FSDP's
        # backward pass.
        loss_of_shards = lambda p: loss_fn(gather_shards(p, pspecs, axis), batch)
        return fsdp_update(loss_of_shards, tx, params, opt_state, pspecs, axis)

    body = {"data": data_step, "zero1": zero1_step, "fsdp": fsdp_step}[strategy]
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(pspecs, ospecs, P(axis)),
        out_specs=(pspecs, ospecs, P()),
    )
    return jax.jit(mapped, donate_argnums=(0, 1) if donate else ())


# --- FSDP one layer at a time ----------------------------------------------------------------

LayerFn = Callable[[Any, jax.Array], jax.Array]
"""``layer_fn(one_layer_params, x) -> x``: one layer of a stack of identical layers."""

LAYERED_STRATEGIES = strategies.among("data", "fsdp_all_gathered", "fsdp_per_layer")


def stacked_specs(tree: Any, mesh: Mesh, axis: str = "fsdp") -> Any:
    """Specs of stacked layers: each leaf's leading (layer) axis whole, ``fsdp_spec`` on the rest; scalars replicated."""
    return jax.tree.map(
        lambda x: P() if x.ndim == 0 else P(None, *fsdp_spec(x.shape[1:], mesh, axis)),
        tree,
    )


def scan_layers(
    layer_fn: LayerFn,
    layers: Any,
    x: jax.Array,
    gather: Callable[[Any], Any] = _unchanged,
    remat: bool = False,
) -> jax.Array:
    """``x`` through each layer of the stack in turn: a ``lax.scan`` over the leaves'
    leading axis.

    ``gather(layer)`` makes one layer's stored parameters whole before ``layer_fn`` uses
    them. With ``remat`` the body is under ``jax.checkpoint``: autodiff saves only each
    layer's input (and its stored parameters, which are an argument anyway), and the
    backward pass runs the body again, gather included.
    """

    def body(x, layer):
        return layer_fn(gather(layer), x), None

    return lax.scan(jax.checkpoint(body) if remat else body, x, layers)[0]


def stack_loss(layer_fn: LayerFn) -> LossFn:
    """``loss_fn(layers, (inputs, targets))``: mean squared error of the stack's output, unsharded."""

    def loss_fn(layers, batch):
        inputs, targets = batch
        return jnp.mean((scan_layers(layer_fn, layers, inputs) - targets) ** 2)

    return loss_fn


def make_layered_fsdp_step(
    layer_fn: LayerFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    layers: Any,
    opt_state: Any,
    axis: str = "fsdp",
    remat: bool = True,
    donate: bool = True,
) -> Callable:
    """FSDP that gathers one layer at a time:
    ``step(layers, opt_state, (inputs, targets))``, jitted.

    ``layers`` (and the optimizer state) are stacked on a leading layer axis and sharded
    by ``stacked_specs`` (``jax.device_put`` puts them there). Inside the scan each
    layer all-gathers its own parameters. With ``remat`` (ZeRO-3) only that layer's
    gathered copy is alive, and the backward pass gathers it again; without, autodiff
    keeps every layer's gathered copy for the backward pass.
    """
    specs = stacked_specs(layers, mesh, axis)
    one_layer = jax.tree.map(
        lambda s: P(*s[1:]), specs, is_leaf=lambda s: isinstance(s, P)
    )
    ospecs = stacked_specs(opt_state, mesh, axis)

    def step(layers, opt_state, batch):
        inputs, targets = batch
        gather = lambda layer: gather_shards(layer, one_layer, axis)

        def loss_of_shards(shards):
            outputs = scan_layers(layer_fn, shards, inputs, gather, remat)
            return jnp.mean((outputs - targets) ** 2)

        return fsdp_update(loss_of_shards, tx, layers, opt_state, specs, axis)

    mapped = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(specs, ospecs, P(axis)),
        out_specs=(specs, ospecs, P()),
    )
    return jax.jit(mapped, donate_argnums=(0, 1) if donate else ())


# --- What theory says ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Split:
    """Bytes of a tree that the rule shards, and of the remainder it leaves replicated (with the leaves' names)."""

    sharded: int
    replicated: int
    replicated_leaves: tuple[str, ...]

    @property
    def total(self) -> int:
        """All the bytes."""
        return self.sharded + self.replicated


def split(tree: Any, num_shards: int) -> Split:
    """How ``fsdp_spec`` divides ``tree`` over ``num_shards`` devices."""
    sharded, replicated, names = 0, 0, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        if shard_dim(leaf.shape, num_shards) is None:
            replicated += nbytes
            names.append(jax.tree_util.keystr(path, simple=True, separator="/"))
        else:
            sharded += nbytes
    return Split(sharded, replicated, tuple(names))


def expected_collectives(
    strategy: str, params: Any, num_devices: int, loss_bytes: int = 4
) -> dict[str, int]:
    """Bytes per device of each kind of collective the step's program holds (``comms`` counts results).

    ``data``: one all-reduce of every gradient. ``zero1`` and ``fsdp``: an all-gather of the sharded
    parameters, a reduce-scatter of their gradients (each device keeps ``1/N``), and an all-reduce of
    the remainder's gradients. The loss adds ``loss_bytes`` to the all-reduce.
    """
    _check_strategy(strategy)
    if num_devices == 1:
        return {}  # XLA drops collectives over a single device
    if strategy == "data":
        return {"all-reduce": comms.tree_bytes(params) + loss_bytes}
    parts = split(params, num_devices)
    found = {
        "all-gather": parts.sharded,
        "reduce-scatter": parts.sharded // num_devices,
        "all-reduce": parts.replicated + loss_bytes,
    }
    # none where none split
    return {kind: nbytes for kind, nbytes in found.items() if nbytes}


def ring_bytes_sent(strategy: str, params: Any, num_devices: int) -> float:
    """Bytes each device sends per step with ring collectives: the same ``2 (N-1)/N`` of the gradients for all three."""
    _check_strategy(strategy)
    if strategy == "data":
        return comms.ring_all_reduce_bytes(comms.tree_bytes(params), num_devices)
    parts = split(params, num_devices)
    return (
        comms.ring_all_gather_bytes(parts.sharded, num_devices)
        + comms.ring_reduce_scatter_bytes(parts.sharded, num_devices)
        + comms.ring_all_reduce_bytes(parts.replicated, num_devices)
    )


def regathering_fsdp_ring_bytes(params: Any, num_devices: int) -> float:
    """Bytes each device sends per step in FSDP as ZeRO-3 runs it: ``3 (N-1)/N`` of the sharded bytes.

    Unlike ``make_step("fsdp", ...)``, which gathers each parameter once and keeps the full copy
    for the backward pass, ZeRO-3 (``make_layered_fsdp_step``, and PyTorch's FSDP) frees each layer's gathered parameters after
    its forward computation and all-gathers them again in the backward pass: two all-gathers and a
    reduce-scatter of the sharded bytes, plus the remainder's all-reduce.
    """
    parts = split(params, num_devices)
    return (
        2 * comms.ring_all_gather_bytes(parts.sharded, num_devices)
        + comms.ring_reduce_scatter_bytes(parts.sharded, num_devices)
        + comms.ring_all_reduce_bytes(parts.replicated, num_devices)
    )


def expected_state_bytes(
    strategy: str, params: Any, opt_state: Any, num_devices: int
) -> int:
    """Bytes of parameters and optimizer state each device holds: sharded parts divided by N, remainder whole."""
    _check_strategy(strategy)
    p, o = split(params, num_devices), split(opt_state, num_devices)
    if strategy == "data":
        return p.total + o.total
    optimizer = o.sharded // num_devices + o.replicated
    if strategy == "zero1":
        return p.total + optimizer
    return p.sharded // num_devices + p.replicated + optimizer


def expected_layered_bytes(
    strategy: str,
    layer_params: Any,
    num_layers: int,
    num_devices: int,
    optimizer_slots: int = 2,
) -> dict[str, int]:
    """Bytes per device theory predicts for a step on ``num_layers`` layers like ``layer_params``.

    What each device updates: every byte under ``data``, the sharded part over N plus the remainder
    under FSDP. The step holds it as parameters, ``optimizer_slots`` times as optimizer state (Adam:
    2), and twice as gradients and updates. FSDP adds the gathered weights: every layer's sharded part
    (``fsdp_all_gathered``) or one layer's (``fsdp_per_layer``). Activations are left out.
    """
    if strategy not in LAYERED_STRATEGIES:
        raise ValueError(
            f"unknown strategy {strategy!r}; allowed: {', '.join(LAYERED_STRATEGIES)}"
        )
    one = split(layer_params, num_devices)
    if strategy == "data":
        held = num_layers * one.total
    else:
        held = num_layers * (one.sharded // num_devices + one.replicated)
    gathered = {
        "data": 0,
        "fsdp_all_gathered": num_layers * one.sharded,
        "fsdp_per_layer": one.sharded,
    }[strategy]
    return {
        "parameters": held,
        "optimizer state": optimizer_slots * held,
        "gathered weights": gathered,
        "gradients and updates": 2 * held,
    }


# --- Measured against theory -----------------------------------------------------------------

LAYERED_LABELS = {
    "data": "data parallel",
    "fsdp_all_gathered": "FSDP, every layer gathered",
    "fsdp_per_layer": "FSDP, one layer at a time",
}


@dataclasses.dataclass(frozen=True)
class LayeredMeasurement:
    """What ``measure_layered`` read: bytes per device by part, measured and predicted, the all-gathers, a table."""

    measured: dict[str, dict[str, int]]
    predicted: dict[str, dict[str, int]]
    gathers: dict[str, list[comms.Collective]]
    table: Table

    def labelled(self, parts: Mapping[str, Any]) -> dict[str, Any]:
        """``parts`` keyed by ``LAYERED_LABELS`` (for a figure's legend) instead of by strategy."""
        return {LAYERED_LABELS[s]: v for s, v in parts.items()}


def layered_steps(
    layer_fn: LayerFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    layers: Any,
    axis: str = "fsdp",
) -> dict[str, tuple[Callable, tuple[Any, Any]]]:
    """The step of each of ``LAYERED_STRATEGIES`` on stacked ``layers``, with its state placed for it.

    ``data``: ``make_step("data", stack_loss(layer_fn), ...)``; ``fsdp_all_gathered`` and
    ``fsdp_per_layer``: ``make_layered_fsdp_step`` without and with ``remat``.
    """
    opt_state = tx.init(layers)
    loss_fn = stack_loss(layer_fn)
    steps = {
        "data": (
            make_step("data", loss_fn, tx, mesh, layers, opt_state, axis=axis),
            copy_to((layers, opt_state), P(), mesh),  # replicated
        )
    }
    for strategy, remat in [("fsdp_all_gathered", False), ("fsdp_per_layer", True)]:
        steps[strategy] = (
            make_layered_fsdp_step(layer_fn, tx, mesh, layers, opt_state, axis, remat),
            copy_to(
                (layers, opt_state),
                stacked_specs((layers, opt_state), mesh, axis),
                mesh,
            ),
        )
    return steps


def measure_layered(
    steps: Mapping[str, tuple[Callable, tuple[Any, Any]]],
    batch: Any,
    one_layer: Any,
    num_layers: int,
    num_devices: int,
) -> LayeredMeasurement:
    """Compile each ``strategy -> (step, (layers, opt_state))`` of ``LAYERED_STRATEGIES`` and read its memory.

    Measured: the parameters and optimizer state each device holds, and the program's temporaries.
    Predicted: ``expected_layered_bytes``. The table adds the live bytes, their ratio to theory,
    and how many all-gathers run inside the layer loop and outside it.
    """
    measured, predicted, gathers, rows = {}, {}, {}, []
    for strategy, (step, state) in steps.items():
        program = step.lower(*state, batch).compile()
        stats = compiled.stats(program)
        held = [max(sharding.bytes_per_device(tree).values()) for tree in state]
        measured[strategy] = {
            "parameters": held[0],
            "optimizer state": held[1],
            "temporaries": stats.temp_bytes,
        }
        predicted[strategy] = expected_layered_bytes(
            strategy, one_layer, num_layers, num_devices
        )
        found = comms.collectives(program.as_text())
        gathers[strategy] = [c for c in found if c.kind == "all-gather"]
        in_loop = sum(c.in_loop for c in gathers[strategy])
        theory = sum(predicted[strategy].values())
        rows.append(
            [strategy, *held, stats.temp_bytes, stats.live_bytes, theory]
            + [stats.live_bytes / theory, in_loop, len(gathers[strategy]) - in_loop]
        )
    headers = [
        "strategy",
        "parameters",
        "optimizer state",
        "temporaries",
        "live",
        "theory",
    ]
    headers += ["live / theory", "all-gathers in the loop", "outside it"]
    title = f"One Adam step on {num_layers} blocks, {num_devices} devices (bytes per device)"
    return LayeredMeasurement(
        measured, predicted, gathers, Table(headers, rows, title=title)
    )
