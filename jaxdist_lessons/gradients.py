"""One data-parallel training step, four ways: one device, ``pmap``, ``jit`` with shardings, ``shard_map``.

All four compute the gradient of the *global* mean loss, so they agree with each other
(to fp32 rounding) and with one device processing the whole batch:

1. **one device**: the reference.
2. **``jax.pmap``** (legacy, in maintenance mode): each device sees its slice of the batch
   and a replica of the state with a leading device axis; ``lax.pmean`` over the named axis
   averages the gradients. BatchNorm needs ``axis_name`` to average its statistics.
3. **``jax.jit`` with shardings**: the batch is sharded over ``data``, the state replicated;
   the program is written for the global batch and the compiler inserts the all-reduce.
   BatchNorm's statistics are global without any ``axis_name``.
4. **``jax.shard_map``**: per-device code, like pmap, but on a mesh; average the *loss* with
   ``lax.pmean`` and let autodiff do the rest. (``shard_map_trap_grads`` shows what happens
   if you average the gradients instead: N times the true gradient.)

Each ``*_step`` returns a ``DataParallelStep``, ``step(state, batch) -> (state, {"loss", "grads"})``,
for a ``train.TrainState`` (made by ``train.create_train_state``) and a ``data.Batch``. The models
are ``models.small.MLP`` and ``models.small.SmallCNN``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import data
from jaxdist_lessons.train import TrainState

Batch = data.Batch
DataParallelStep = Callable[[TrainState, Batch], tuple[TrainState, dict[str, Any]]]
"""``step(state, batch) -> (state, {"loss", "grads"})``."""


# --- Loss and update ----------------------------------------------------------------------------


def loss_fn(
    model: nn.Module, params: Any, batch_stats: Any, batch: Batch
) -> tuple[jax.Array, Any]:
    """Mean cross-entropy over the batch this code sees, and the updated batch
    statistics."""
    images, labels = _images_labels(batch)
    if batch_stats:
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats},
            images,
            train=True,
            mutable=["batch_stats"],
        )
        batch_stats = updates["batch_stats"]
    else:
        logits = model.apply({"params": params}, images, train=True)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels
    ).mean(), batch_stats


def apply_gradients(
    tx: optax.GradientTransformation, state: TrainState, grads: Any, batch_stats: Any
) -> TrainState:
    """One optimizer update, as ``jit_data_parallel_step`` writes it out, for the per-device forms."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        batch_stats=batch_stats,
        opt_state=opt_state,
    )


def with_axis_name(model: nn.Module, axis_name: str | None) -> nn.Module:
    """The same model with its BatchNorm statistics averaged over ``axis_name``."""
    return model.clone(axis_name=axis_name)


def loss_and_grads(
    model: nn.Module,
    state: TrainState,
    batch: Batch,
    reduce_loss: Callable[[jax.Array], jax.Array] = lambda loss: loss,
):
    """``((loss, batch_stats), grads)`` of ``reduce_loss(loss_fn(...))`` with respect to the parameters."""

    def objective(params):
        loss, batch_stats = loss_fn(model, params, state.batch_stats, batch)
        return reduce_loss(loss), batch_stats

    return jax.value_and_grad(objective, has_aux=True)(state.params)


# --- The four forms ---------------------------------------------------------------------------


def one_device_mesh() -> Mesh:
    """A mesh of one device, the first: form 1 is form 3 on it."""
    return jax.make_mesh(
        (1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1]
    )


def single_device_step(
    model: nn.Module, tx: optax.GradientTransformation
) -> DataParallelStep:
    """Form 1: the whole batch on one device, the reference for the others: ``jit_data_parallel_step`` on one device."""
    return jit_data_parallel_step(model, tx, one_device_mesh())


def pmap_step(
    model: nn.Module, tx: optax.GradientTransformation, axis_name: str = "data"
) -> DataParallelStep:
    """Form 2, legacy: ``jax.pmap`` over a leading device axis; ``pmean`` the gradients
    over ``axis_name``.

    Call it on ``replicate(state)`` and ``split_batch(batch)``; ``unreplicate`` the
    result.
    """
    model = with_axis_name(model, axis_name)

    def step(state: TrainState, batch: Batch):
        (loss, batch_stats), grads = loss_and_grads(model, state, batch)
        grads = lax.pmean(grads, axis_name)  # each device had the mean over its slice
        loss = lax.pmean(loss, axis_name)
        return apply_gradients(tx, state, grads, batch_stats), {
            "loss": loss,
            "grads": grads,
        }

    return jax.pmap(step, axis_name=axis_name)


def jit_data_parallel_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    data_axis: str = "data",
) -> DataParallelStep:
    """Form 3, the data-parallel step: ``jax.jit`` over the global batch, sharded over
    ``data_axis``.

    The step is written as for one device. The compiler sees a mean over a sharded
    dimension and inserts the all-reduce of the gradients itself.
    """
    # BatchNorm sees the global batch: no axis to name
    model = with_axis_name(model, None)

    def step(state: TrainState, batch: Batch):
        def objective(params):
            return loss_fn(model, params, state.batch_stats, batch)

        (loss, batch_stats), grads = jax.value_and_grad(objective, has_aux=True)(
            state.params
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            batch_stats=batch_stats,
            opt_state=opt_state,
        )
        return state, {"loss": loss, "grads": grads}

    replicated = NamedSharding(mesh, P())  # the state: a full copy on every device
    # the batch: each device a slice of rows
    rows_split = NamedSharding(mesh, P(data_axis))
    return jax.jit(
        step,
        in_shardings=(replicated, rows_split),
        out_shardings=(replicated, replicated),
    )


def shard_map_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    data_axis: str = "data",
) -> DataParallelStep:
    """Form 4: ``jax.shard_map``; each device computes its local loss and we ``pmean``
    the *loss*.

    Autodiff of ``pmean`` gives each device the gradient of the global mean loss: the
    all-reduce of the gradients comes from transposing it.
    """
    model = with_axis_name(model, data_axis)

    def local_step(state: TrainState, batch: Batch):
        (loss, batch_stats), grads = loss_and_grads(
            model, state, batch, lambda loss: lax.pmean(loss, data_axis)
        )
        return apply_gradients(tx, state, grads, batch_stats), {
            "loss": loss,
            "grads": grads,
        }

    return jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), P(data_axis)), out_specs=(P(), P())
        )
    )


def shard_map_trap_grads(
    model: nn.Module, mesh: Mesh, data_axis: str = "data"
) -> Callable[[TrainState, Batch], Any]:
    """The porting mistake: gradients of the *local* loss, then ``pmean`` of the gradients.

    Under ``shard_map``'s default ``check_vma=True``, the gradient of a replicated input is
    already summed over devices by autodiff, so this returns N times the true gradient.
    """
    model = with_axis_name(model, data_axis)

    def local_grads(state: TrainState, batch: Batch):
        return lax.pmean(loss_and_grads(model, state, batch)[1], data_axis)

    return jax.jit(
        jax.shard_map(
            local_grads, mesh=mesh, in_specs=(P(), P(data_axis)), out_specs=P()
        )
    )


# --- Moving data to where each form wants it -------------------------------------------------


def replicate(tree: Any, num_devices: int | None = None) -> Any:
    """A leading device axis on every leaf, for ``pmap`` (``jax.device_put_replicated`` is gone).

    Host arrays, which ``pmap`` may place as it likes: it rejects arrays committed to other shardings.
    """
    n = jax.local_device_count() if num_devices is None else num_devices
    return jax.tree.map(
        lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), tree
    )


def unreplicate(tree: Any) -> Any:
    """Device 0's copy of a ``pmap`` result."""
    return jax.tree.map(lambda x: x[0], tree)


def split_batch(batch: Batch, num_devices: int | None = None) -> Batch:
    """``(B, ...)`` to ``(num_devices, B // num_devices, ...)`` for ``pmap``: device ``i`` gets the ``i``-th block."""
    n = jax.local_device_count() if num_devices is None else num_devices
    return data.split_rows(batch, n, what="device slices")


# --- Each form as a step on ordinary arrays ---------------------------------------------------

FORMS = ("one device", "pmap", "jit", "shard_map")


def form_step(
    form: str,
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh | None = None,
) -> DataParallelStep:
    """One form's step, taking and returning ordinary (global) arrays: it moves them where the form wants them.

    Run K steps with a plain loop: ``for batch in batches: state, metrics = step(state, batch)``.
    """
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; allowed: {', '.join(FORMS)}")
    if form in ("jit", "shard_map") and mesh is None:
        raise ValueError(f"form {form!r} needs a mesh with a 'data' axis")
    if form == "one device":
        step, one = single_device_step(model, tx), one_device_mesh()
        return lambda state, batch: step(*_place(state, batch, one))
    if form == "pmap":
        step = pmap_step(model, tx)
        return lambda state, batch: unreplicate(
            step(replicate(state), split_batch(batch))
        )
    step = (
        jit_data_parallel_step(model, tx, mesh)
        if form == "jit"
        else shard_map_step(model, tx, mesh)
    )
    return lambda state, batch: step(*_place(state, batch, mesh))


def _place(state: TrainState, batch: Batch, mesh: Mesh) -> tuple[TrainState, Batch]:
    """The state replicated and the batch split by rows over ``data``, as forms 3 and 4 take them."""
    return (
        jax.device_put(state, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data"))),
    )


def _images_labels(batch: Any) -> tuple[jax.Array, jax.Array]:
    if isinstance(batch, tuple):  # an (images, labels) pair, as ``benchmark`` passes it
        return batch
    return batch["images"], batch["labels"]
