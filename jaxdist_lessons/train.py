"""Training a Flax model across devices: a born-sharded state, donated steps, one loop, one orchestrator.

The recipe (big_vision's, nanodo's, and the JAX docs'), all in ``create_train_state``:

1. ``jax.eval_shape(init)`` gives the state's shapes without computing anything (once);
2. a ``shardings_fn`` gives each leaf a ``NamedSharding``: ``rule_shardings(mesh, rules)`` speaks
   regex rules on the leaves' paths (``sharding.shardings_from_rules``, chapter 05_resnet50) or Flax's
   logical rules on the names a model gives its parameters (``nn.logical_to_mesh_sharding``,
   chapter 09_flax_partitioning);
3. ``jax.jit(init, out_shardings=...)`` creates the state *already sharded*: no device ever holds
   the whole thing (or, with ``abstract=True``, the placed shapes: a restore or compile target).

``train_step`` donates the old state, so its buffers are reused for the new one. ``fit`` is the
one training loop, with Orbax checkpoints keyed by the steps done, so that a run can stop and
resume mid-epoch; ``train_and_evaluate(config, workdir)`` puts data, model, mesh, state, steps,
loop and checkpoints together, in the spirit of flax's ImageNet example, from a ``Config`` of
plain values. Every process of a multi-process job calls it the same way; only process 0 prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from jaxdist_lessons.models import resnet, small
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
    """``init(rng) -> TrainState``: the model initialised on one example.

    The example has ``input_shape`` (without the batch dimension) and ``input_dtype``.
    One ``init`` per equal model, optimizer, shape and dtype: a ``TrainState``'s tree
    structure holds ``model.apply``, a bound method equal only for the same module
    object, so a second run with an equal model (resumed, or continued) reuses the first
    run's traced programs instead of tracing them again.
    """
    return _init_fn(model, tx, tuple(input_shape), jnp.dtype(input_dtype))


@functools.cache
def _init_fn(
    model: nn.Module,
    tx: optax.GradientTransformation,
    input_shape: tuple[int, ...],
    input_dtype: jnp.dtype,
) -> Callable[[jax.Array], TrainState]:
    def init(rng: jax.Array) -> TrainState:
        variables = model.init(rng, jnp.zeros((1, *input_shape), input_dtype))
        state = TrainState.create(
            apply_fn=model.apply,
            params=variables["params"],
            tx=tx,
            batch_stats=variables.get("batch_stats", {}),
        )
        # A strongly typed step counter: a restored checkpoint then has exactly the
        # same types, so the jitted steps do not compile again for it.
        return state.replace(step=jnp.zeros((), jnp.int32))

    return init


def rule_shardings(mesh: Mesh, rules: Rules) -> Callable[[Any], Any]:
    """``shardings_fn(tree)`` for ``create_train_state``: regex rules on paths, or Flax logical rules.

    Regex rules map a leaf's path to a ``PartitionSpec`` (``sharding.shardings_from_rules``);
    logical rules map the names a model gives its parameters to mesh axes
    (``nn.logical_to_mesh_sharding``). No rules: every leaf replicated.
    """
    kinds = {isinstance(target, P) for _, target in rules}
    if len(kinds) > 1:
        raise ValueError(
            "rules mix regex rules (path, PartitionSpec) with logical rules (name, mesh axes): "
            "use one kind"
        )
    if kinds == {False}:
        return lambda tree: nn.logical_to_mesh_sharding(
            nn.get_partition_spec(tree), mesh, rules
        )
    return lambda tree: sharding.shardings_from_rules(tree, mesh, rules)


def create_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    input_shape: Sequence[int],
    shardings_fn: Callable[[Any], Any],
    rng: jax.Array | None = None,
    *,
    input_dtype: Any = jnp.float32,
    abstract: bool = False,
) -> TrainState:
    """Parameters, batch statistics and optimizer state, born sharded by ``shardings_fn``.

    ``jax.eval_shape`` traces ``init`` once for the state's shapes; ``shardings_fn(shapes)`` gives
    each leaf its ``NamedSharding`` (``rule_shardings(mesh, rules)``, or your own); then
    ``jax.jit(init, out_shardings=...)`` builds every array in its shards. With ``abstract=True``
    nothing is built: the shapes come back placed by their shardings (``jax.ShapeDtypeStruct``s),
    a target to restore a checkpoint into or to compile for. Adam's moments are built by mapping
    over the parameters, so path rules match them too (``opt_state/.../kernel``).
    """
    rng = jax.random.key(0) if rng is None else rng
    init = init_fn(model, tx, input_shape, input_dtype)
    shapes = jax.eval_shape(init, rng)
    shardings = shardings_fn(shapes)
    if abstract:
        return with_shardings(shapes, shardings)
    # Outside any rule context: ``out_shardings`` places the state, and Flax's DenseGeneral builds a
    # named kernel flat then reshapes it, which logical rules in context would reject.
    return jax.jit(init, out_shardings=shardings)(rng)


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


def shardings_of(state: Any) -> Any:
    """The sharding of every leaf of a state (arrays, or shapes with shardings)."""
    return jax.tree.map(lambda x: x.sharding, state)


# --- The steps ----------------------------------------------------------------------------------


def _weighted_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def train_step(
    state: TrainState, batch: Batch
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One step of image classification.

    Cross-entropy on integer labels, weighted by the batch's mask; BatchNorm statistics
    updated.
    """

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
            "evaluate got no examples: pass batches made with drop_remainder=False, "
            "or a global batch no larger than the dataset"
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
    stopped: bool = False  # ``before_step`` asked to stop before the last step


def fit(
    state: Any,
    train_step: Callable,
    eval_step: Callable | None,
    train_batches: Callable[[int], Iterable[Any]],
    eval_batches: Callable[[], Iterable[Batch]] | None,
    epochs: int,
    *,
    steps_per_epoch: int | None = None,
    first_step: int = 0,
    checkpoints: ocp.CheckpointManager | None = None,
    before_step: Callable[[int], bool] | None = None,
    progress: bool = True,
) -> tuple[Any, History]:
    """The training loop: from ``first_step`` steps done to the end of epoch ``epochs``.

    ``train_batches(epoch)`` yields an epoch's batches; a run resumed mid-epoch skips those it
    trained on. After each epoch: an evaluation (with ``eval_batches``), a line on process 0, and
    a save into ``checkpoints`` keyed by the steps done. ``steps_per_epoch`` cuts epochs short
    (needed to resume mid-epoch); ``before_step(step)`` returning True stops the loop there,
    saving that step (a preemption); ``progress`` shows a tqdm bar on process 0.
    """
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(
            f"steps_per_epoch must be a positive integer or None, got {steps_per_epoch}"
        )
    if first_step and steps_per_epoch is None:
        raise ValueError("resuming at a step needs steps_per_epoch")
    history, step = History(), first_step
    for epoch in range(first_step // (steps_per_epoch or 1), epochs):
        skip = step - epoch * (steps_per_epoch or 0)
        bar = tqdm(
            itertools.islice(train_batches(epoch), skip, steps_per_epoch),
            desc=f"epoch {epoch + 1}",
            total=None if steps_per_epoch is None else steps_per_epoch - skip,
            disable=not progress or jax.process_index() != 0,
            leave=False,
        )
        for batch in bar:
            if before_step is not None and before_step(step):
                history.stopped = True
                break
            state, metrics = train_step(state, batch)
            history.train.append(
                {"epoch": epoch, "step": step}
                | {k: float(v) for k, v in metrics.items()}
            )
            step += 1
            bar.set_postfix(loss=f"{history.train[-1]['loss']:.3f}")
        if history.stopped:
            if checkpoints is not None and step not in checkpoints.all_steps():
                checkpoints.save(step, args=ocp.args.StandardSave(state))
                checkpoints.wait_until_finished()
            break
        losses = [row["loss"] for row in history.train if row["epoch"] == epoch]
        line = f"epoch {epoch + 1}: losses {losses[0]:.4f} .. {losses[-1]:.4f}"
        if eval_batches is not None:
            metrics = evaluate(eval_step, state, eval_batches())
            history.eval.append({"epoch": epoch, "step": step} | metrics)
            line += f", held-out accuracy {metrics['accuracy']:.1%}"
        if losses:
            print0(line)
        if checkpoints is not None:  # each process writes its shards
            checkpoints.save(step, args=ocp.args.StandardSave(state))
            checkpoints.wait_until_finished()  # complete before anything may fail
    return state, history


def restore_latest(
    workdir: str, like: TrainState | Any, shardings: Any
) -> tuple[TrainState, int] | None:
    """``(state, steps done)`` from the latest checkpoint ``fit`` saved in ``workdir``, or ``None``."""
    with ocp.CheckpointManager(os.path.abspath(workdir)) as manager:
        step = manager.latest_step()
        if step is None:
            return None
        target = with_shardings(like, shardings)
        return manager.restore(step, args=ocp.args.StandardRestore(target)), step


# --- The orchestrator ---------------------------------------------------------------------------

MODELS: dict[str, Callable[..., nn.Module]] = {
    "ResNet18": resnet.ResNet18,
    "ResNet34": resnet.ResNet34,
    "ResNet50": resnet.ResNet50,
    "ResNet101": resnet.ResNet101,
    "ResNet152": resnet.ResNet152,
    "SmallCNN": small.SmallCNN,
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """The model ``MODELS[name]`` with ``kwargs`` (``build_model('ResNet50', width=0.125)``)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {sorted(MODELS)}")
    return MODELS[name](**kwargs)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything ``train_and_evaluate`` needs, as plain values: data, model, mesh and rules, optimisation, schedule."""

    model: str = "ResNet50"  # a name in MODELS
    model_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dataset: str = data.DIGITS
    data_dir: str | None = None
    preprocess: data.Preprocess = data.Preprocess()
    # Mesh axis sizes; -1 takes the devices left over (``mesh.mesh_shape``). Auto axes.
    mesh: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
    devices: int | None = None  # the first devices of jax.devices(); None: all
    rules: Rules = ()
    global_batch: int = 64
    epochs: int = 2
    steps_per_epoch: int | None = None  # None: one pass over the training split
    learning_rate: float = 3e-3
    seed: int = 0
    augment: bool = True
    evaluate: bool = True
    progress: bool = True

    def make_model(self) -> nn.Module:
        """The model this config names."""
        return build_model(self.model, **self.model_kwargs)


@dataclasses.dataclass
class Result:
    """What ``train_and_evaluate`` did: the final state, its history, and what it was built with."""

    state: TrainState
    history: History
    mesh: Mesh
    shardings: Any
    train_step: Callable
    eval_step: Callable
    first_step: int  # 0, or the steps done by the checkpoint it resumed from


@functools.cache
def adam(learning_rate: float) -> optax.GradientTransformation:
    """``optax.adam(learning_rate)``, one object per rate. A ``TrainState``'s tree
    structure holds its optimizer, so a second run at the same rate (resumed, or on the
    same mesh) reuses the first run's traced steps instead of tracing them again."""
    return optax.adam(learning_rate)


def train_and_evaluate(
    config: Config,
    workdir: str | None = None,
    before_step: Callable[[int], bool] | None = None,
) -> Result:
    """Train as ``config`` says; checkpoint each epoch into ``workdir`` (by step), resuming from its latest.

    Every process of a job calls it alike: each reads its own rows of every batch, and Orbax
    writes each process's shards. Only process 0 prints. ``before_step``: see ``fit``.
    """
    used = jax.devices()[: config.devices or jax.device_count()]
    mesh = jax.make_mesh(
        mesh_lib.mesh_shape(len(used), **config.mesh),
        tuple(config.mesh),
        axis_types=(AxisType.Auto,) * len(config.mesh),
        devices=used,
    )
    train_source = data.source(config.dataset, "train", config.data_dir)
    input_shape = data.input_shape(train_source, config.preprocess)
    model, tx = config.make_model(), adam(config.learning_rate)
    shapes = create_train_state(
        model, tx, input_shape, rule_shardings(mesh, config.rules), abstract=True
    )
    shardings = shardings_of(shapes)
    jitted_train, jitted_eval = make_steps(shardings, mesh)

    state, first_step = None, 0
    if workdir is not None:
        restored = restore_latest(workdir, shapes, shardings)
        if restored is not None:
            state, first_step = restored
            print0(f"resumed from {os.path.join(workdir, str(first_step))}")
    if state is None:
        rng = jax.random.key(config.seed)
        state = jax.jit(init_fn(model, tx, input_shape), out_shardings=shardings)(rng)

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

    eval_batches = None
    if config.evaluate:
        split = data.eval_split(config.dataset, config.data_dir)
        eval_source = data.source(config.dataset, split, config.data_dir)

        def eval_batches() -> Iterable[Batch]:
            return data.batches(
                eval_source,
                config.global_batch,
                mesh,
                shuffle=False,
                drop_remainder=False,
                preprocess=config.preprocess,
            )

    per_epoch = data.num_batches(len(train_source), config.global_batch, True)
    manager = (
        contextlib.nullcontext()
        if workdir is None
        else ocp.CheckpointManager(os.path.abspath(workdir))
    )
    with manager as checkpoints:
        state, history = fit(
            state,
            jitted_train,
            jitted_eval,
            train_batches,
            eval_batches,
            config.epochs,
            steps_per_epoch=min(config.steps_per_epoch or per_epoch, per_epoch),
            first_step=first_step,
            checkpoints=checkpoints,
            before_step=before_step,
            progress=config.progress,
        )
    return Result(
        state, history, mesh, shardings, jitted_train, jitted_eval, first_step
    )
