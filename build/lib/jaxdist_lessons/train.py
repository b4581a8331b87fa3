"""Training a Flax model across devices: sharded state, donated steps, a fit loop, Orbax checkpoints.

The recipe (big_vision's, and the JAX docs'):

1. ``jax.eval_shape(init)`` gives the state's shapes without computing anything;
2. rules on the leaves' paths give each leaf a ``PartitionSpec`` (``sharding.shardings_from_rules``);
3. ``jax.jit(init, out_shardings=...)`` creates the state *already sharded*: no device ever holds
   the whole thing.

``train_step`` donates the old state, so its buffers are reused for the new one.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxdist_lessons import sharding

Batch = dict[str, jax.Array]  # images, labels, mask


class TrainState(train_state.TrainState):
    """Flax's TrainState plus the BatchNorm statistics, which the step updates but the optimizer does not."""

    batch_stats: Any


def _init_fn(
    model: nn.Module, tx: optax.GradientTransformation, image_shape: Sequence[int]
) -> Callable:
    def init(rng: jax.Array) -> TrainState:
        variables = model.init(rng, jnp.zeros((1, *image_shape), jnp.float32), train=False)
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


def abstract_state(
    model: nn.Module, tx: optax.GradientTransformation, image_shape: Sequence[int]
) -> TrainState:
    """The train state's structure, shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), computing nothing."""
    return jax.eval_shape(_init_fn(model, tx, image_shape), jax.random.key(0))


def state_shardings(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: sharding.Rules,
    image_shape: Sequence[int],
) -> Any:
    """The ``NamedSharding`` of every leaf of the train state, from ``rules``, without building the state."""
    return sharding.shardings_from_rules(
        abstract_state(model, tx, image_shape), mesh, rules
    )


def create_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: sharding.Rules,
    rng: jax.Array,
    image_shape: Sequence[int],
) -> TrainState:
    """Parameters, batch statistics and optimizer state, born sharded by ``rules`` on ``mesh``."""
    shardings = state_shardings(model, tx, mesh, rules, image_shape)
    return jax.jit(_init_fn(model, tx, image_shape), out_shardings=shardings)(rng)


def _weighted_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["images"],
            train=True,
            mutable=["batch_stats"],
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return _weighted_mean(losses, batch["mask"]), (logits, updates["batch_stats"])

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params
    )
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    accuracy = _weighted_mean(
        (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32), batch["mask"]
    )
    return state, {"loss": loss, "accuracy": accuracy}


def _eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
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


def make_steps(
    shardings: Any, mesh: Mesh, data_axis: str = "data"
) -> tuple[Callable, Callable]:
    """``(train_step, eval_step)`` jitted for a state sharded as ``shardings`` and batches over ``data_axis``.

    ``train_step(state, batch) -> (state, {loss, accuracy})`` donates ``state``;
    ``eval_step(state, batch) -> {loss_sum, correct, count}`` counts only rows whose mask is 1.
    """
    replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P(data_axis))
    train_step = jax.jit(
        _train_step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        _eval_step, in_shardings=(shardings, batch_sharding), out_shardings=replicated
    )
    return train_step, eval_step


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
    state: TrainState,
    train_step: Callable,
    eval_step: Callable,
    train_batches: Callable[[int], Iterable[Batch]],
    eval_batches: Callable[[], Iterable[Batch]] | None,
    epochs: int,
    history: History | None = None,
    first_epoch: int = 0,
    steps_per_epoch: int | None = None,
    progress: bool = True,
) -> tuple[TrainState, History]:
    """Train for ``epochs`` epochs, evaluating after each; ``train_batches(epoch)`` yields that epoch's batches.

    ``steps_per_epoch`` cuts every epoch short (for quick runs on large datasets).
    """
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(
            f"steps_per_epoch must be a positive integer or None, got {steps_per_epoch}"
        )
    history = History() if history is None else history
    for epoch in range(first_epoch, first_epoch + epochs):
        epoch_batches = itertools.islice(train_batches(epoch), steps_per_epoch)
        bar = tqdm(
            epoch_batches,
            desc=f"epoch {epoch + 1}",
            total=steps_per_epoch,
            disable=not progress,
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
    return state, history


# --- Checkpoints ------------------------------------------------------------------------------


def save_checkpoint(path: str, state: TrainState) -> None:
    """Write ``state`` (sharded or not) to ``path`` with Orbax, replacing what is there; each device writes its shards."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(
            os.path.abspath(path), state, force=True
        )  # force: re-running a cell overwrites
        checkpointer.wait_until_finished()


def with_shardings(like: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct``s shaped like ``like``'s leaves and placed by ``shardings``: a state that is never built."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), like, shardings
    )


def restore_checkpoint(path: str, like: TrainState | Any, shardings: Any) -> TrainState:
    """Read a checkpoint into the structure of ``like`` with the given ``shardings``: any mesh, any layout."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.abspath(path), with_shardings(like, shardings))
