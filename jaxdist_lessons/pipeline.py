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
writes its backward). ``one_f_one_b_grads`` and ``interleaved_grads`` run 1F1B and interleaved
1F1B, the backward written per stage with ``jax.vjp``, by the LM recipe's own
``pipeline.scheduled`` (``jaxdist_lm/pipeline.py``), on a model given as layers and a loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons._checks import positive_int

# JAX-free (bubble.py, for the planner page), re-exported here
from jaxdist_lessons.bubble import bubble_fraction as bubble_fraction

# The schedule tables are the LM recipe's (jaxdist_lm/schedules.py): the recipe and the
# book run one copy of them.
from jaxdist_lm.schedules import Op as Op
from jaxdist_lm.schedules import Timetable as Timetable
from jaxdist_lm.schedules import gpipe_schedule as gpipe_schedule
from jaxdist_lm.schedules import idle_fraction as idle_fraction
from jaxdist_lm.schedules import in_flight as in_flight
from jaxdist_lm.schedules import interleaved_schedule as interleaved_schedule
from jaxdist_lm.schedules import one_f_one_b_schedule as one_f_one_b_schedule
from jaxdist_lm.schedules import slot_tables as slot_tables

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


def _scheduled(
    stage_fn: StageFn,
    loss_fn: LossFn,
    chunks: Any,
    x: jax.Array,
    y: jax.Array,
    mesh: Mesh,
    table: Timetable,
    num_microbatches: int,
) -> tuple[jax.Array, Any]:
    """The LM recipe's ``pipeline.scheduled`` on a model of ``stage_fn`` layers:
    ``chunks`` as (V, S, layers per chunk, ...), the loss ``loss_fn`` of the last
    chunk's output; -> (the loss summed over microbatches, the gradients of
    ``chunks``)."""
    M = num_microbatches
    if AxisType.Explicit in mesh.axis_types:  # arrays carry their sharding: place them
        chunks = jax.reshard(chunks, NamedSharding(mesh, P(None, "pipeline")))
        x, y = jax.reshard((x, y), NamedSharding(mesh, P()))

    def stage(params: Any, x: jax.Array, y: jax.Array):
        # The recipe's stages also return their auxiliary loss (its experts' balance).
        return sequential_apply(stage_fn, params, x), jnp.zeros((), jnp.float32)

    def last(rest: Any, out: jax.Array, y: jax.Array) -> jax.Array:
        return loss_fn(out, y)

    from jaxdist_lm.pipeline import scheduled

    loss, _, grads, _, _ = scheduled(
        stage, last, chunks, {}, _micro(x, M), _micro(y, M), table, mesh
    )
    return loss, grads


def one_f_one_b_grads(
    stage_fn: StageFn,
    loss_fn: LossFn,
    stage_params: Any,
    x: jax.Array,
    y: jax.Array,
    mesh: Mesh,
    num_microbatches: int,
) -> tuple[jax.Array, Any]:
    """The loss of ``gpipe_loss`` and its gradient, run on the 1F1B schedule by the
    LM recipe's ``scheduled``: one stage of ``stage_params`` per device, one chunk."""
    S = _check(stage_params, x, mesh, num_microbatches, "pipeline")
    table = one_f_one_b_schedule(S, num_microbatches)
    chunks = jax.tree.map(lambda p: p[None, :, None], stage_params)  # (1, S, 1, ...)
    loss, grads = _scheduled(
        stage_fn, loss_fn, chunks, x, y, mesh, table, num_microbatches
    )
    return loss, jax.tree.map(lambda g: g[0, :, 0], grads)


def interleaved_grads(
    stage_fn: StageFn,
    loss_fn: LossFn,
    stage_params: Any,
    x: jax.Array,
    y: jax.Array,
    mesh: Mesh,
    num_microbatches: int,
    virtual: int,
) -> tuple[jax.Array, Any]:
    """The loss and gradient of the model of ``stage_params``' layers (one leading
    slice per layer, ``stage_fn`` applies one), run on interleaved 1F1B by the LM
    recipe's ``scheduled``: ``S * virtual`` chunks of equal size, device ``d`` holding
    chunks ``d, d + S, ...``. Gradients come back in ``stage_params``' layout."""
    S, v = mesh.shape["pipeline"], positive_int("virtual", virtual)
    layers = {p.shape[0] for p in jax.tree.leaves(stage_params)}
    if len(layers) != 1 or next(iter(layers)) % (S * v):
        raise ValueError(
            f"stage_params' leading dimensions {sorted(layers)} (layers) must be one "
            f"number that {S} stages x {v} virtual stages = {S * v} chunks divide"
        )
    _check_batch(x, num_microbatches)
    table = interleaved_schedule(S, num_microbatches, v)
    # layer (c S + d) L' + i -> [c, d, i]: chunk c of device d
    chunks = jax.tree.map(lambda p: p.reshape(v, S, -1, *p.shape[1:]), stage_params)
    loss, grads = _scheduled(
        stage_fn, loss_fn, chunks, x, y, mesh, table, num_microbatches
    )

    def by_layer(g: jax.Array) -> jax.Array:
        if AxisType.Explicit in mesh.axis_types:  # gather before merging the stage axis
            g = jax.reshard(g, NamedSharding(mesh, P()))
        return g.reshape(-1, *g.shape[3:])

    return loss, jax.tree.map(by_layer, grads)


def stack_stages(
    init_fn: Callable[[jax.Array], Any], rng: jax.Array, num_stages: int
) -> Any:
    """Parameters for ``num_stages`` stages, stacked on a new leading axis: ``init_fn(rng)`` per stage.

    Jitted: one compiled program, where running ``vmap`` eagerly would compile each initializer
    (per parameter shape) on its own.
    """
    positive_int("num_stages", num_stages)
    return jax.jit(jax.vmap(init_fn))(jax.random.split(rng, num_stages))
