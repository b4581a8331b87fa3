"""The exercises of ``book/07_troubleshooting.md``, and the answers it includes."""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons.exercises.checking import (
    Exercise,
    Hint,
    _number,
    equals,
    named,
)

# Slice sizes of TPU v5e: https://cloud.google.com/tpu/docs/v5e
V5E_SLICES = (1, 4, 8, 16, 32, 64, 128, 256)


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    from jaxdist_lessons import oom

    n, mesh = ctx["n"], ctx["mesh"]
    slices = V5E_SLICES

    def fits(chips: int) -> bool:
        return oom.fits(
            ctx["params_7b"], chips, "TPU v5e", strategy="fsdp", precision="mixed"
        ).ok

    fewest = next(k for k in range(1, slices[-1] + 1) if fits(k))
    smallest = next(k for k in slices if fits(k))
    return {
        1: Exercise(
            asks="(the axis name pmean must use, how many times the whole-batch update the "
            "renamed step's update is)",
            expected=None,
            kind="tuple",
            why="'batch' was the pmap's axis name and the mesh binds other names; renamed, the "
            "step still hits chapter 04_gradients's trap, so average the loss, not the gradients.",
            parts=(
                Exercise(
                    asks="an axis name",
                    expected=mesh.axis_names[0],
                    kind="name",
                    hints=(
                        named(
                            ["batch"],
                            "'batch' is the name the old pmap bound: which names does the "
                            "mesh bind?",
                        ),
                    ),
                ),
                Exercise(
                    asks="a ratio (a number)",
                    expected=n,
                    rel_tol=0.01,
                    hints=(
                        equals(
                            1,
                            "run it: renaming the axis alone leaves chapter 04_gradients's trap in place."
                            if n != 1
                            else "",
                        ),
                        equals(n * n, "the gradients are summed once, then averaged."),
                    ),
                ),
            ),
        ),
        2: Exercise(
            asks="the number of chips of the smallest v5e slice (an integer)",
            expected=smallest,
            rel_tol=0,
            why="FSDP divides the whole training state by the chips; the fewest chips that "
            "hold it round up to the next slice you can rent.",
            hints=(
                equals(
                    fewest,
                    "that many chips would hold it, but no v5e slice has that size.",
                    0,
                )
                if fewest != smallest
                else equals(math.nan, ""),
                Hint(
                    "that is not a v5e slice size.",
                    lambda a, e: _number(a) not in slices,
                ),
            ),
        ),
        3: Exercise(
            asks="a number of compilations (an integer)",
            expected=2,
            rel_tol=0,
            why="jit compiles once per input shape: the full batches share one program, the "
            "smaller last batch needs another.",
            hints=(
                equals(
                    1,
                    "the last batch has another shape, and jit compiles per shape.",
                    0,
                ),
                equals(4, "batches of the same shape reuse the compiled program.", 0),
            ),
        ),
    }


# --- The answers ----------------------------------------------------------------------

Step = Callable[[Any, jax.Array, jax.Array], Any]


def sgd_update(params: Any, grads: Any) -> Any:
    """One plain SGD update at learning rate 0.1, as the colleague's step makes it."""
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def update_size(before: Any, after: Any) -> float:
    """The sum of the absolute changes of every parameter."""
    pairs = zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    return sum(float(jnp.abs(p - q).sum()) for p, q in pairs)


def answer_1(
    ported_step: Step, loss_fn: Callable, params: Any, mesh: Mesh, batch: Sequence
) -> tuple[str, float]:
    """The axis name pmean must use; the renamed step's update over the whole batch's.

    ``loss_fn(params, images, labels, weights)`` is the page's weighted loss and
    ``batch`` its ``(images, labels)``. Raises ``AssertionError`` if the fixed step
    differs from the whole-batch step.
    """
    from jaxdist_lessons import errors

    axis = mesh.axis_names[0]
    specs = dict(mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=P())
    exc = errors.caught(jax.jit(jax.shard_map(ported_step, **specs)), params, *batch)
    # The last frame of the reader's own code in the traceback is the line that failed.
    hidden = {"jax", "jaxlib", "jaxdist_lessons"}
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if not hidden & set(f.filename.split(os.sep))]
    print(f"1. {type(exc).__name__}({str(exc)!r}), raised by our line: {ours[-1].line}")
    print(f"   the mesh binds {mesh.axis_names}, not 'batch'")
    unchecked = jax.jit(jax.shard_map(ported_step, **specs, check_vma=False))
    print("   with check_vma=False:", errors.caught(unchecked, params, *batch))

    def ones(labels: jax.Array) -> jax.Array:
        return jnp.ones(labels.shape[0])

    def renamed_step(params: Any, images: jax.Array, labels: jax.Array) -> Any:
        grads = jax.grad(loss_fn)(params, images, labels, ones(labels))
        # The axis name fixed, nothing else.
        return sgd_update(params, jax.lax.pmean(grads, axis))

    def fixed_step(params: Any, images: jax.Array, labels: jax.Array) -> Any:
        # Average the loss, not the gradients.
        def global_loss(p: Any) -> jax.Array:
            return jax.lax.pmean(loss_fn(p, images, labels, ones(labels)), axis)

        return sgd_update(params, jax.grad(global_loss)(params))

    def whole_batch_step(params: Any, images: jax.Array, labels: jax.Array) -> Any:
        return sgd_update(
            params, jax.grad(loss_fn)(params, images, labels, ones(labels))
        )

    reference = jax.jit(whole_batch_step)(params, *batch)
    renamed = jax.jit(jax.shard_map(renamed_step, **specs))(params, *batch)
    ratio = update_size(params, renamed) / update_size(params, reference)
    print(f"   renamed to {axis!r}, it runs, but its update is {ratio:.2f} times the")
    print("   whole-batch one: the gradients of replicated parameters are already")
    print(f"   summed over {axis!r} (chapter 4's trap)")
    fixed = jax.jit(jax.shard_map(fixed_step, **specs))(params, *batch)
    gaps = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), fixed, reference)
    gap = max(jax.tree.leaves(gaps))
    print(f"   fixed: pmean of the loss; largest difference from it {gap:.1e}")
    if not (isinstance(exc, AssertionError) and "pmean" in ours[-1].line):
        raise AssertionError(f"expected the pmean line to fail, got {exc!r}")
    if gap > 1e-5:
        raise AssertionError(f"the fixed step differs from the whole-batch one: {gap}")
    return axis, ratio


def answer_2(params_7b: float) -> int:
    """Chips of the smallest v5e slice that holds the 7B model (FSDP, Adam, mixed)."""
    from jaxdist_lessons import oom

    def fits_7b(chips: int) -> oom.Fit:
        return oom.fits(params_7b, chips, "TPU v5e", strategy="fsdp", precision="mixed")

    fewest = next(k for k in range(1, V5E_SLICES[-1] + 1) if fits_7b(k).ok)
    slice_chips = next(k for k in V5E_SLICES if fits_7b(k).ok)
    print(f"2. {fewest} chips would hold it: {fits_7b(fewest)}")
    print(f"   the smallest v5e slice that holds it has {slice_chips} chips:")
    print(f"   {fits_7b(slice_chips)}")
    return slice_chips


def answer_3(model: Any, tx: optax.GradientTransformation, mesh: Mesh) -> int:
    """Compilations of chapter 4's jit step: 3 batches of 8n examples, one of 4n."""
    from jaxdist_lessons import gradients, recompiles, train

    n = mesh.size
    jit_step = gradients.jit_data_parallel_step(model, tx, mesh)
    state = jax.jit(train.init_fn(model, tx, (8, 8, 3)))(jax.random.key(0))
    shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh.axis_names[0])))
    sizes = [8 * n] * 3 + [4 * n]
    with recompiles.count_compiles(jit_step) as counter:
        for size in sizes:
            batch = (jnp.ones((size, 8, 8, 3)), jnp.zeros(size, jnp.int32))
            state, _ = jit_step(*jax.device_put((state, batch), shardings))
    print(f"3. batches of {sizes}: {counter.compiles} compilations")
    return counter.compiles
