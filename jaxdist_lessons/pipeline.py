"""Pipeline schedules over a ``'pipeline'`` mesh axis, with ``jax.shard_map`` and ``ppermute`` (chapter 11_pipelines_mesh_shape).

Naming a mesh axis ``'pipeline'`` pipelines nothing: JAX has no pipeline scheduler. Here are three.
The model is cut into stages of the same shape (for example, transformer blocks); device ``d`` on
the ``'pipeline'`` axis holds stage ``d``'s parameters (with ``v`` virtual stages, stages
``d, d + S, d + 2S, ...``). The batch is cut into ``M`` microbatches. A *schedule* says which
operation each device runs at each tick: ``F`` (forward of one microbatch through one stage) or
``B`` (its backward), both counted as one tick here.

- **GPipe** (Huang et al. 2019, arXiv:1811.06965): all forwards, then all backwards. Every
  stage keeps all ``M`` microbatches' activations until the backward starts.
- **1F1B** (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): after ``S - 1 - d`` warm-up
  forwards, device ``d`` alternates one forward and one backward, so it keeps at most ``S - d``.
- **Interleaved 1F1B** (Megatron-LM, Narayanan et al. 2021, arXiv:2104.04473): each device holds
  ``v`` smaller stages; the bubble shrinks ``v``-fold in time.

Schedules are built by one simulator: each device has a fixed order of operations and runs the
next one as soon as its input is ready (a forward needs the previous stage's forward, a backward
the next stage's backward). ``gpipe_loss`` runs GPipe as a ``shard_map`` program (``jax.grad``
writes its backward); ``one_f_one_b_grads`` runs 1F1B with the backward written per stage with
``jax.vjp``, and ``interleaved_grads`` runs interleaved 1F1B the same way, its chunks on a ring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons._checks import positive_int

# JAX-free (bubble.py, for the planner page), re-exported here
from jaxdist_lessons.bubble import bubble_fraction as bubble_fraction

# The schedule tables are the LM recipe's: schedules.py is a link to
# examples/lm/schedules.py (a wheel holds a copy of the file), so the recipe and the book
# run one copy of them.
from jaxdist_lessons.schedules import Op as Op
from jaxdist_lessons.schedules import Timetable as Timetable
from jaxdist_lessons.schedules import gpipe_schedule as gpipe_schedule
from jaxdist_lessons.schedules import idle_fraction as idle_fraction
from jaxdist_lessons.schedules import in_flight as in_flight
from jaxdist_lessons.schedules import interleaved_schedule as interleaved_schedule
from jaxdist_lessons.schedules import one_f_one_b_schedule as one_f_one_b_schedule
from jaxdist_lessons.schedules import slot_tables

StageFn = Callable[[Any, jax.Array], jax.Array]
LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def sequential_apply(stage_fn: StageFn, stage_params: Any, x: jax.Array) -> jax.Array:
    """The model without a pipeline: every stage in turn, on the whole batch, on one device."""
    num_stages = jax.tree.leaves(stage_params)[0].shape[0]
    for s in range(num_stages):
        x = stage_fn(jax.tree.map(lambda p, s=s: p[s], stage_params), x)
    return x


def _check(
    stage_params: Any, x: jax.Array, mesh: Mesh, num_microbatches: int, axis: str
):
    num_stages = mesh.shape[axis]
    leading = {p.shape[0] for p in jax.tree.leaves(stage_params)}
    if leading != {num_stages}:
        raise ValueError(
            f"stage_params must have a leading dimension of {num_stages} (the size of mesh axis "
            f"{axis!r}), one slice per stage; got leading sizes {sorted(leading)}"
        )
    _check_batch(x, num_microbatches)
    return num_stages


def _check_batch(x: jax.Array, num_microbatches: int) -> None:
    positive_int("num_microbatches", num_microbatches)
    if x.shape[0] % num_microbatches:
        raise ValueError(
            f"batch of {x.shape[0]} cannot be cut into {num_microbatches} equal microbatches"
        )


def _micro(a: jax.Array, num_microbatches: int) -> jax.Array:
    return a.reshape(num_microbatches, a.shape[0] // num_microbatches, *a.shape[1:])


def _run(
    mesh: Mesh, axis: str, per_device: Callable, stage_params: Any, *data: jax.Array
):
    """``per_device`` under ``shard_map``: parameters split over ``axis``, data whole, results per stage."""
    # arrays carry their sharding: place them first
    if AxisType.Explicit in mesh.axis_types:
        stage_params = jax.reshard(stage_params, NamedSharding(mesh, P(axis)))
        data = tuple(jax.reshard(a, NamedSharding(mesh, P())) for a in data)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(axis),) + (P(),) * len(data),
        out_specs=P(axis),
    )(stage_params, *data)


def gpipe_loss(
    stage_fn: StageFn,
    loss_fn: LossFn,
    stage_params: Any,
    x: jax.Array,
    y: jax.Array,
    mesh: Mesh,
    num_microbatches: int,
    axis: str = "pipeline",
) -> jax.Array:
    """The sum over microbatches of ``loss_fn(model(x_m), y_m)``, run as a GPipe
    forward; ``jax.grad`` it.

    Stage 0 alone reads ``x``; each later stage gets one microbatch per tick from the
    one before (``ppermute``); the last stage alone computes the loss. ``stage_params``
    has a leading dimension of ``mesh.shape[axis]``; ``stage_fn(params, x)`` returns an
    array shaped like ``x``.
    """
    S = _check(stage_params, x, mesh, num_microbatches, axis)
    M = num_microbatches
    to_next = [(s, s + 1) for s in range(S - 1)]  # the last stage sends nothing on

    def per_device(params: Any, micro_x: jax.Array, micro_y: jax.Array) -> jax.Array:
        params = jax.tree.map(lambda p: p[0], params)  # this device's stage
        stage = jax.lax.axis_index(axis)

        def tick(carry: tuple[jax.Array, jax.Array], t: jax.Array):
            held, loss = carry
            m = jnp.clip(t - stage, 0, M - 1)  # the microbatch this stage works on
            fresh = jax.lax.dynamic_index_in_dim(micro_x, m, keepdims=False)
            out = stage_fn(params, jnp.where(stage == 0, fresh, held))
            target = jax.lax.dynamic_index_in_dim(micro_y, m, keepdims=False)
            mine = (stage == S - 1) & (t - stage >= 0) & (t - stage < M)
            loss = loss + jnp.where(mine, loss_fn(out, target), 0.0)
            return (jax.lax.ppermute(out, axis, to_next), loss), None

        start = jax.lax.pcast(
            (jnp.zeros_like(micro_x[0]), jnp.zeros(())), (axis,), to="varying"
        )
        (_, loss), _ = jax.lax.scan(tick, start, jnp.arange(M + S - 1))
        return loss[None]  # one value per stage: only the last stage's is not zero

    losses = _run(mesh, axis, per_device, stage_params, _micro(x, M), _micro(y, M))
    return jnp.sum(losses)  # one scalar per stage, all but the last zero


def _tables(table: Timetable, num_stages: int) -> dict[str, np.ndarray]:
    """A schedule as integer arrays ``[tick, stage]`` a compiled loop can index."""
    T = len(table)
    a = {
        k: np.zeros((T, num_stages), np.int32)
        for k in ("kind", "micro", "recv_f", "recv_b")
    }
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            a["kind"][t, s] = 1 if op.kind == "F" else 2
            a["micro"][t, s] = op.micro
            # the next stage gets it after this tick
            if op.kind == "F" and s + 1 < num_stages:
                a["recv_f"][t, s + 1] = op.micro + 1
            if op.kind == "B" and s > 0:
                a["recv_b"][t, s - 1] = op.micro + 1
    return a


def check_slots(table: Timetable, slots: int) -> None:
    """Raise if two microbatches alive at once on one device would share slot ``micro % slots``."""
    tabs = _tables(table, len(table[0]))
    for s in range(len(table[0])):
        live: set[int] = set()
        for t in range(len(table)):
            arriving = tabs["recv_f"][t - 1, s] - 1 if t else -1
            if s == 0 and tabs["kind"][t, s] == 1:
                arriving = tabs["micro"][t, s]
            if arriving >= 0:
                if any(m % slots == arriving % slots for m in live):
                    raise ValueError(
                        f"{slots} slots are too few on stage {s} at tick {t}"
                    )
                live.add(arriving)
            if tabs["kind"][t, s] == 2:
                live.discard(int(tabs["micro"][t, s]))


def one_f_one_b_grads(
    stage_fn: StageFn,
    loss_fn: LossFn,
    stage_params: Any,
    x: jax.Array,
    y: jax.Array,
    mesh: Mesh,
    num_microbatches: int,
    axis: str = "pipeline",
) -> tuple[jax.Array, Any]:
    """The loss of ``gpipe_loss`` and its gradient, run on the 1F1B schedule; ``S``
    slots of inputs per stage.

    Each tick every stage runs what ``one_f_one_b_schedule`` says: a forward, or a
    backward by ``jax.vjp`` that recomputes the stage from its saved input. Activations
    go to the next stage and input gradients to the previous one by ``ppermute``, into
    slots ``micro % S``.
    """
    S = _check(stage_params, x, mesh, num_microbatches, axis)
    M = num_microbatches
    table = one_f_one_b_schedule(S, M)
    check_slots(table, S)
    tabs = {k: jnp.asarray(v) for k, v in _tables(table, S).items()}

    def per_device(params: Any, micro_x: jax.Array, micro_y: jax.Array):
        params = jax.tree.map(lambda p: p[0], params)
        stage = jax.lax.axis_index(axis)
        zero = jax.lax.pcast(jnp.zeros_like(micro_x[0]), (axis,), to="varying")

        def forward(carry, m):
            inputs, grads_in, grad_sum, loss = carry
            x_in = jnp.where(stage == 0, micro_x[m], inputs[m % S])
            # stage 0 keeps its input for the backward
            inputs = inputs.at[m % S].set(x_in)
            return (inputs, grads_in, grad_sum, loss), stage_fn(params, x_in), zero

        def backward(carry, m):
            inputs, grads_in, grad_sum, loss = carry
            # recompute, then backward
            out, vjp = jax.vjp(stage_fn, params, inputs[m % S])
            value, dloss = jax.value_and_grad(loss_fn)(out, micro_y[m])
            is_last = stage == S - 1
            g_params, g_x = vjp(jnp.where(is_last, dloss, grads_in[m % S]))
            grad_sum = jax.tree.map(jnp.add, grad_sum, g_params)
            loss = loss + jnp.where(is_last, value, 0.0)
            return (inputs, grads_in, grad_sum, loss), zero, g_x

        def idle(carry, m):
            return carry, zero, zero

        def tick(carry, t):
            kind, m = tabs["kind"][t, stage], tabs["micro"][t, stage]
            carry, to_next, to_prev = jax.lax.switch(
                kind, (idle, forward, backward), carry, m
            )
            inputs, grads_in, grad_sum, loss = carry
            got_f = jax.lax.ppermute(to_next, axis, [(s, s + 1) for s in range(S - 1)])
            got_b = jax.lax.ppermute(to_prev, axis, [(s + 1, s) for s in range(S - 1)])
            rf, rb = tabs["recv_f"][t, stage] - 1, tabs["recv_b"][t, stage] - 1
            inputs = jnp.where(rf >= 0, inputs.at[rf % S].set(got_f), inputs)
            grads_in = jnp.where(rb >= 0, grads_in.at[rb % S].set(got_b), grads_in)
            return (inputs, grads_in, grad_sum, loss), None

        # S slots, like zero: varying
        buffers = jnp.broadcast_to(zero, (S, *zero.shape))
        loss = jax.lax.pcast(jnp.zeros(()), (axis,), to="varying")
        # params vary
        start = (
            buffers,
            buffers,
            jax.tree.map(jnp.zeros_like, params),
            loss,
        )
        (_, _, grad_sum, loss), _ = jax.lax.scan(tick, start, jnp.arange(len(table)))
        return loss[None], jax.tree.map(lambda g: g[None], grad_sum)

    losses, grads = _run(
        mesh, axis, per_device, stage_params, _micro(x, M), _micro(y, M)
    )
    return jnp.sum(losses), grads


def interleaved_grads(
    stage_fn: StageFn,
    loss_fn: LossFn,
    stage_params: Any,
    x: jax.Array,
    y: jax.Array,
    mesh: Mesh,
    num_microbatches: int,
    virtual: int,
    axis: str = "pipeline",
) -> tuple[jax.Array, Any]:
    """The loss and gradient of the model of ``stage_params``' layers, run on
    interleaved 1F1B.

    ``stage_params`` has one leading slice per layer (``stage_fn`` applies one),
    ``S * virtual`` chunks of equal size: device ``d`` holds chunks ``d, d + S, ...``.
    Each tick every device runs what ``interleaved_schedule`` says, as
    ``one_f_one_b_grads`` does; the last device's chunk sends on to device 0's next
    chunk (a ring ``ppermute``), and inputs and gradients wait in pools of slots sized
    by the schedule. Gradients come back in ``stage_params``' layout.
    """
    S, v, M = mesh.shape[axis], positive_int("virtual", virtual), num_microbatches
    layers = {p.shape[0] for p in jax.tree.leaves(stage_params)}
    if len(layers) != 1 or next(iter(layers)) % (S * v):
        raise ValueError(
            f"stage_params' leading dimensions {sorted(layers)} (layers) must be one "
            f"number that {S} stages x {v} virtual stages = {S * v} chunks divide"
        )
    _check_batch(x, M)
    table = interleaved_schedule(S, M, v)
    arrays, num_inputs, num_grads = slot_tables(table)
    tabs = {k: jnp.asarray(a) for k, a in arrays.items()}

    def chunk_fn(params: Any, x: jax.Array) -> jax.Array:
        return sequential_apply(stage_fn, params, x)

    def per_device(params: Any, micro_x: jax.Array, micro_y: jax.Array):
        params = jax.tree.map(lambda p: p[0], params)  # [v, layers per chunk, ...]
        device = jax.lax.axis_index(axis)
        zero = jax.lax.pcast(jnp.zeros_like(micro_x[0]), (axis,), to="varying")

        def forward(carry, m, c, slot, gslot):
            inputs, grads_in, grad_sum, loss = carry
            x_in = jnp.where((device == 0) & (c == 0), micro_x[m], inputs[slot])
            # chunk 0 keeps its input for the backward
            inputs = inputs.at[slot].set(x_in)
            out = chunk_fn(jax.tree.map(lambda p: p[c], params), x_in)
            return (inputs, grads_in, grad_sum, loss), out, zero

        def backward(carry, m, c, slot, gslot):
            inputs, grads_in, grad_sum, loss = carry
            mine = jax.tree.map(lambda p: p[c], params)
            out, vjp = jax.vjp(chunk_fn, mine, inputs[slot])  # recompute, then backward
            value, dloss = jax.value_and_grad(loss_fn)(out, micro_y[m])
            is_last = (device == S - 1) & (c == v - 1)
            g_params, g_x = vjp(jnp.where(is_last, dloss, grads_in[gslot]))
            grad_sum = jax.tree.map(lambda a, g: a.at[c].add(g), grad_sum, g_params)
            loss = loss + jnp.where(is_last, value, 0.0)
            return (inputs, grads_in, grad_sum, loss), zero, g_x

        def idle(carry, *op):
            return carry, zero, zero

        def tick(carry, t):
            op = [tabs[k][t, device] for k in ("micro", "chunk", "slot", "gslot")]
            carry, to_next, to_prev = jax.lax.switch(
                tabs["kind"][t, device], (idle, forward, backward), carry, *op
            )
            inputs, grads_in, grad_sum, loss = carry
            got_f = jax.lax.ppermute(
                to_next, axis, [(d, (d + 1) % S) for d in range(S)]
            )
            got_b = jax.lax.ppermute(
                to_prev, axis, [(d, (d - 1) % S) for d in range(S)]
            )
            rf, rb = tabs["recv_f"][t, device] - 1, tabs["recv_b"][t, device] - 1
            inputs = jnp.where(rf >= 0, inputs.at[rf].set(got_f), inputs)
            grads_in = jnp.where(rb >= 0, grads_in.at[rb].set(got_b), grads_in)
            return (inputs, grads_in, grad_sum, loss), None

        loss = jax.lax.pcast(jnp.zeros(()), (axis,), to="varying")
        pools = [
            jnp.broadcast_to(zero, (k, *zero.shape)) for k in (num_inputs, num_grads)
        ]
        start = (*pools, jax.tree.map(jnp.zeros_like, params), loss)
        (_, _, grad_sum, loss), _ = jax.lax.scan(tick, start, jnp.arange(len(table)))
        return loss[None], jax.tree.map(lambda g: g[None], grad_sum)

    def by_device(p: jax.Array) -> jax.Array:  # layer (c S + d) L' + i -> [d, c, i]
        return p.reshape(v, S, -1, *p.shape[1:]).swapaxes(0, 1)

    def by_layer(g: jax.Array) -> jax.Array:
        if AxisType.Explicit in mesh.axis_types:  # gather before merging the stage axis
            g = jax.reshard(g, NamedSharding(mesh, P()))
        return g.swapaxes(0, 1).reshape(-1, *g.shape[3:])

    placed = jax.tree.map(by_device, stage_params)
    losses, grads = _run(mesh, axis, per_device, placed, _micro(x, M), _micro(y, M))
    return jnp.sum(losses), jax.tree.map(by_layer, grads)


def stack_stages(
    init_fn: Callable[[jax.Array], Any], rng: jax.Array, num_stages: int
) -> Any:
    """Parameters for ``num_stages`` stages, stacked on a new leading axis: ``init_fn(rng)`` per stage.

    Jitted: one compiled program, where running ``vmap`` eagerly would compile each initializer
    (per parameter shape) on its own.
    """
    positive_int("num_stages", num_stages)
    return jax.jit(jax.vmap(init_fn))(jax.random.split(rng, num_stages))
