"""Training a Flax model across devices: a born-sharded state, donated steps, one loop, one orchestrator.

The recipe (big_vision's, and the JAX docs'):

1. ``jax.eval_shape(init)`` gives the state's shapes without computing anything;
2. rules give each leaf a ``PartitionSpec``: regex rules on the leaves' paths
   (``sharding.shardings_from_rules``, chapter 5), or Flax's logical rules on the names a model gives
   its parameters (``nn.logical_to_mesh_sharding``, chapter 9);
3. ``jax.jit(init, out_shardings=...)`` creates the state *already sharded*: no device ever holds
   the whole thing.

``train_step`` donates the old state, so its buffers are reused for the new one. ``fit`` is the
training loop; ``train_and_evaluate(config, workdir)`` puts data, model, mesh, state, steps, loop and
Orbax checkpoints together, in the spirit of flax's ImageNet example. Every process of a
multi-process job calls it the same way; only process 0 prints.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxdist_lessons import data, sharding
from jaxdist_lessons import mesh as mesh_lib
from jaxdist_lessons.multihost import print0

Batch = data.Batch
# Regex rules on leaf paths, ``[('kernel$', P(None, 'tensor')), ...]``, or Flax logical rules,
# ``(('mlp', 'tensor'), ('batch', 'data'), ...)``.
Rules = sharding.Rules | Sequence[tuple[str, str | tuple[str, ...] | None]]
Step = Callable[[Any, Batch], tuple[Any, dict[str, jax.Array]]]


class TrainState(train_state.TrainState):
    """Flax's TrainState plus the BatchNorm statistics (``{}`` if none), which the step updates but the optimizer does not."""

    batch_stats: Any


# --- The state, born sharded --------------------------------------------------------------------


def init_fn(
    model: nn.Module,
    tx: optax.GradientTransformation,
    input_shape: Sequence[int],
    input_dtype: Any = jnp.float32,
) -> Callable[[jax.Array], TrainState]:
    """``init(rng) -> TrainState``: the model initialised on one example of ``input_shape``."""

    def init(rng: jax.Array) -> TrainState:
        variables = model.init(rng, jnp.zeros((1, *input_shape), input_dtype))
        state = TrainState.create(
            apply_fn=model.apply,
            params=variables["params"],
            tx=tx,
            batch_stats=variables.get("batch_stats", {}),
        )
        # A strongly typed step counter: a restored checkpoint then has exactly the same types, so the
        # jitted steps do not compile again for it.
        return state.replace(step=jnp.zeros((), jnp.int32))

    return init


def is_logical(rules: Rules) -> bool:
    """Whether ``rules`` are Flax logical rules (name to mesh axes) rather than regex rules (path to ``P``)."""
    kinds = {isinstance(target, P) for _, target in rules}
    if len(kinds) > 1:
        raise ValueError(
            "rules mix regex rules (path, PartitionSpec) with logical rules (name, mesh axes): "
            "use one kind"
        )
    return kinds == {False}


def shardings_for(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """The ``NamedSharding`` of every leaf of ``tree`` (arrays or shapes) under regex or logical ``rules``."""
    if is_logical(rules):
        return nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)
    return sharding.shardings_from_rules(tree, mesh, rules)


def abstract_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    input_shape: Sequence[int],
    input_dtype: Any = jnp.float32,
) -> TrainState:
    """The train state's structure, shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), computing nothing."""
    return jax.eval_shape(
        init_fn(model, tx, input_shape, input_dtype), jax.random.key(0)
    )


def state_shardings(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    input_shape: Sequence[int],
    input_dtype: Any = jnp.float32,
) -> Any:
    """The ``NamedSharding`` of every leaf of the train state, from ``rules``, without building the state."""
    return shardings_for(
        abstract_state(model, tx, input_shape, input_dtype), mesh, rules
    )


def create_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    rng: jax.Array,
    input_shape: Sequence[int],
    input_dtype: Any = jnp.float32,
) -> TrainState:
    """Parameters, batch statistics and optimizer state, born sharded by ``rules`` on ``mesh``.

    Adam's moments are built by mapping over the parameters, so path rules match them too
    (``opt_state/.../kernel``) and logical names stay on them: they are sharded like their parameters.
    """
    init = init_fn(model, tx, input_shape, input_dtype)
    shardings = shardings_for(jax.eval_shape(init, rng), mesh, rules)
    # Outside any rule context: ``out_shardings`` places the state, and Flax's DenseGeneral builds a
    # named kernel flat then reshapes it, which logical rules in context would reject.
    return jax.jit(init, out_shardings=shardings)(rng)


def shardings_of(state: Any) -> Any:
    """The sharding of every leaf of a state (arrays, or shapes with shardings)."""
    return jax.tree.map(lambda x: x.sharding, state)


# --- The steps ----------------------------------------------------------------------------------


def _weighted_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def train_step(
    state: TrainState, batch: Batch
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One step of image classification: cross-entropy on integer labels, BatchNorm statistics updated."""

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["images"],
            train=True,
            mutable=["batch_stats"],
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["labels"]
        )
        return _weighted_mean(losses, batch["mask"]), (logits, updates["batch_stats"])

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params
    )
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    accuracy = _weighted_mean(
        (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32), batch["mask"]
    )
    return state, {"loss": loss, "accuracy": accuracy}


def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    """Summed loss, correct predictions and count over the rows whose mask is 1."""
    logits = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats},
        batch["images"],
        train=False,
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
    mask = batch["mask"]
    return {
        "loss_sum": jnp.sum(losses * mask),
        "correct": jnp.sum(correct * mask),
        "count": jnp.sum(mask),
    }


def loss_step(loss_fn: Callable[[Any, Any], jax.Array]) -> Step:
    """``step(state, batch) -> (state, {'loss'})`` for any ``loss_fn(params, batch)`` (no batch statistics)."""

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return step


def jit_step(
    step: Step, shardings: Any, batch_sharding: NamedSharding, donate: bool = True
) -> Callable:
    """``step`` jitted for a state sharded as ``shardings``, batches as ``batch_sharding``, metrics replicated."""
    replicated = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=0 if donate else (),
    )


def make_steps(
    shardings: Any, mesh: Mesh, data_axis: str = "data"
) -> tuple[Callable, Callable]:
    """``(train_step, eval_step)`` jitted for a state sharded as ``shardings`` and batches over ``data_axis``.

    ``train_step(state, batch) -> (state, {loss, accuracy})`` donates ``state``;
    ``eval_step(state, batch) -> {loss_sum, correct, count}`` counts only rows whose mask is 1.
    """
    replicated, batch_sharding = (
        NamedSharding(mesh, P()),
        NamedSharding(mesh, P(data_axis)),
    )
    jitted_eval = jax.jit(
        eval_step, in_shardings=(shardings, batch_sharding), out_shardings=replicated
    )
    return jit_step(train_step, shardings, batch_sharding), jitted_eval


# --- The loop -----------------------------------------------------------------------------------


def evaluate(
    eval_step: Callable, state: TrainState, batches: Iterable[Batch]
) -> dict[str, float]:
    """Mean loss and accuracy over every (unmasked) example of ``batches``."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    for batch in batches:
        for key, value in eval_step(state, batch).items():
            totals[key] += float(value)
    if totals["count"] == 0:
        raise ValueError(
            "evaluate got no examples: pass batches made with drop_remainder=False, or a global "
            "batch no larger than the dataset"
        )
    return {
        "loss": totals["loss_sum"] / totals["count"],
        "accuracy": totals["correct"] / totals["count"],
    }


@dataclasses.dataclass
class History:
    """Metrics recorded by ``fit``: one row per training step, one per evaluation."""

    train: list[dict[str, float]] = dataclasses.field(default_factory=list)
    eval: list[dict[str, float]] = dataclasses.field(default_factory=list)


def fit(
    state: Any,
    train_step: Callable,
    eval_step: Callable | None,
    train_batches: Callable[[int], Iterable[Any]],
    eval_batches: Callable[[], Iterable[Batch]] | None,
    epochs: int,
    history: History | None = None,
    first_epoch: int = 0,
    steps_per_epoch: int | None = None,
    progress: bool = True,
    after_epoch: Callable[[int, Any, History], None] | None = None,
) -> tuple[Any, History]:
    """Train for ``epochs`` epochs, evaluating after each; ``train_batches(epoch)`` yields that epoch's batches.

    ``steps_per_epoch`` cuts every epoch short (for quick runs on large datasets); ``progress``
    shows a tqdm bar (on process 0 only); ``after_epoch(epoch, state, history)`` runs after each
    epoch's evaluation (to checkpoint, or print).
    """
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(
            f"steps_per_epoch must be a positive integer or None, got {steps_per_epoch}"
        )
    history = History() if history is None else history
    for epoch in range(first_epoch, first_epoch + epochs):
        bar = tqdm(
            itertools.islice(train_batches(epoch), steps_per_epoch),
            desc=f"epoch {epoch + 1}",
            total=steps_per_epoch,
            disable=not progress or jax.process_index() != 0,
            leave=False,
        )
        for batch in bar:
            state, metrics = train_step(state, batch)
            row = {
                "epoch": epoch,
                "step": len(history.train),
                **{k: float(v) for k, v in metrics.items()},
            }
            history.train.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}")
        if eval_batches is not None:
            history.eval.append(
                {
                    "epoch": epoch,
                    "step": len(history.train),
                    **evaluate(eval_step, state, eval_batches()),
                }
            )
        if after_epoch is not None:
            after_epoch(epoch, state, history)
    return state, history


# --- Checkpoints ------------------------------------------------------------------------------


def save_checkpoint(path: str, state: TrainState) -> None:
    """Write ``state`` (sharded or not) to ``path`` with Orbax, replacing what is there.

    Each process writes the shards its devices hold, one copy of each replicated array between them.
    """
    with ocp.StandardCheckpointer() as checkpointer:
        # force: re-running a cell overwrites
        checkpointer.save(os.path.abspath(path), state, force=True)
        checkpointer.wait_until_finished()


def with_shardings(like: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct``s shaped like ``like``'s leaves and placed by ``shardings``: a state that is never built.

    Leaf by leaf, in order: ``shardings`` may come from a state built with another model or
    optimizer object of the same structure.
    """
    placements = jax.tree.leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    leaves, structure = jax.tree.flatten(like)
    return jax.tree.unflatten(
        structure,
        [
            jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)
            for x, s in zip(leaves, placements, strict=True)
        ],
    )


def restore_checkpoint(path: str, like: TrainState | Any, shardings: Any) -> TrainState:
    """Read a checkpoint into the structure of ``like`` with the given ``shardings``: any mesh, any layout."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(
            os.path.abspath(path), with_shardings(like, shardings)
        )


def restore_latest(
    workdir: str, like: TrainState | Any, shardings: Any
) -> tuple[TrainState, int] | None:
    """``(state, epochs done)`` from the latest checkpoint ``train_and_evaluate`` saved in ``workdir``, or ``None``."""
    with ocp.CheckpointManager(os.path.abspath(workdir)) as manager:
        epoch = manager.latest_step()
        if epoch is None:
            return None
        target = with_shardings(like, shardings)
        return manager.restore(epoch, args=ocp.args.StandardRestore(target)), epoch


# --- The orchestrator ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything ``train_and_evaluate`` needs: data, model, mesh and rules, optimisation, schedule."""

    model: nn.Module
    dataset: str = data.DIGITS
    data_dir: str | None = None
    preprocess: data.Preprocess = data.Preprocess()
    # Mesh axis sizes; -1 takes the devices left over (``mesh.mesh_shape``). Auto axes.
    mesh: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
    rules: Rules = ()
    global_batch: int = 64
    epochs: int = 2
    steps_per_epoch: int | None = None
    learning_rate: float = 3e-3
    seed: int = 0
    augment: bool = True
    evaluate: bool = True
    progress: bool = True


@dataclasses.dataclass
class Result:
    """What ``train_and_evaluate`` did: the final state, its history, and what it was built with."""

    state: TrainState
    history: History
    mesh: Mesh
    shardings: Any
    train_step: Callable
    eval_step: Callable
    first_epoch: int  # 0, or the epochs done by the checkpoint it resumed from


def train_and_evaluate(config: Config, workdir: str | None = None) -> Result:
    """Train ``config.model`` on ``config.dataset``; checkpoint each epoch into ``workdir`` and resume from its latest.

    Every process of a job calls it alike: each reads its own rows of every batch, and Orbax
    writes each process's shards. Only process 0 prints.
    """
    mesh = mesh_lib.make_mesh(
        mesh_lib.mesh_shape(jax.device_count(), **config.mesh),
        tuple(config.mesh),
        axis_types=AxisType.Auto,
    )
    train_source = data.source(config.dataset, "train", config.data_dir)
    eval_source = data.source(
        config.dataset,
        data.eval_split(config.dataset, config.data_dir),
        config.data_dir,
    )
    input_shape = data.input_shape(train_source, config.preprocess)
    tx = optax.adam(config.learning_rate)
    shardings = state_shardings(config.model, tx, mesh, config.rules, input_shape)
    jitted_train, jitted_eval = make_steps(shardings, mesh)

    state, first_epoch = None, 0
    if workdir is not None:
        like = abstract_state(config.model, tx, input_shape)
        restored = restore_latest(workdir, like, shardings)
        if restored is not None:
            state, first_epoch = restored
            print0(f"resumed from {workdir} after epoch {first_epoch}")
    if state is None:
        rng = jax.random.key(config.seed)
        state = create_train_state(
            config.model, tx, mesh, config.rules, rng, input_shape
        )

    def train_batches(epoch: int) -> Iterable[Batch]:
        return data.batches(
            train_source,
            config.global_batch,
            mesh,
            seed=config.seed,
            epoch=epoch,
            augment=config.augment,
            preprocess=config.preprocess,
        )

    def eval_batches() -> Iterable[Batch]:
        return data.batches(
            eval_source,
            config.global_batch,
            mesh,
            shuffle=False,
            drop_remainder=False,
            preprocess=config.preprocess,
        )

    manager = (
        None if workdir is None else ocp.CheckpointManager(os.path.abspath(workdir))
    )

    def after_epoch(epoch: int, state: TrainState, history: History) -> None:
        losses = [row["loss"] for row in history.train if row["epoch"] == epoch]
        line = f"epoch {epoch + 1}: mean training loss {np.mean(losses):.4f}"
        if history.eval:
            line += f", held-out accuracy {history.eval[-1]['accuracy']:.1%}"
        print0(line)
        if manager is not None:
            manager.save(epoch + 1, args=ocp.args.StandardSave(state))

    state, history = fit(
        state,
        jitted_train,
        jitted_eval,
        train_batches,
        eval_batches if config.evaluate else None,
        epochs=max(0, config.epochs - first_epoch),
        first_epoch=first_epoch,
        steps_per_epoch=config.steps_per_epoch,
        progress=config.progress,
        after_epoch=after_epoch,
    )
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    return Result(
        state, history, mesh, shardings, jitted_train, jitted_eval, first_epoch
    )
