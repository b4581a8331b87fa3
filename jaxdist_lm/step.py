"""The training step: the state's shapes and shardings, the loss and its gradient (over
micro-batches, or pipeline.py's stages), the optimizer's update; the held-out loss."""

import functools
import math
from collections.abc import Callable, Collection
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import loss as loss_lib
from . import model as model_lib
from .inputs import cast, make_inputs, micro_batches
from .layout import BATCH, RULES, without
from .pipeline import make_pipeline_grads, make_pipeline_loss
from .run_config import RunConfig

# (apply_fn, params, tokens_BT) -> (the batch's mean loss, its gradient), where
# apply_fn(params) is the model holding params (abstract_state's)
Grads = Callable[..., tuple[jax.Array, Any]]


def abstract_state(model, tx, mesh, offload: Collection[str] = (), zero1: bool = False):
    """The train state's shapes and shardings, from tracing init under the rules (the
    weights' logical names, through logical_params), and init; with ``zero1`` the
    optimizer's state split over 'data' (ZeRO stage 1)."""

    # apply_fn(params): the model holding params (an nnx.Module), whose methods compute
    apply_fn = functools.partial(model_lib.with_params, model)

    def init(rng):
        params = model_lib.logical_params(model_lib.initialized(model, rng))
        return train_state.TrainState.create(apply_fn=apply_fn, params=params, tx=tx)

    # The weights carry their logical axes. The key is traced too: a mesh of chips that
    # are not here (train.py --topology) runs nothing, not even the key's creation.
    boxed = jax.eval_shape(lambda: init(jax.random.key(0)))
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    strip = lambda tree: jax.tree.map(
        lambda x: x.unbox(False) if is_box(x) else x, tree, is_leaf=is_box
    )
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
    if zero1:
        moments = jax.tree.map(
            lambda s, x: over_data(s, x.shape),
            shardings.opt_state,
            strip(boxed).opt_state,
        )
        shardings = shardings.replace(opt_state=moments)
    # --offload optimizer: the moments live in host memory (JAX's memory kinds).
    if "optimizer" in offload:
        host = lambda s: s.with_memory_kind("pinned_host")
        shardings = shardings.replace(opt_state=jax.tree.map(host, shardings.opt_state))
    shapes = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        strip(boxed),
        shardings,
    )
    return shapes, lambda rng: nn.meta.unbox(init(rng))


def over_data(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """``sharding`` with 'data' added on the first dimension it splits evenly, for
    ZeRO-1; unchanged where none does."""
    data = sharding.mesh.shape["data"]
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for dim, (size, part) in enumerate(zip(shape, spec, strict=True)):
        axes = () if part is None else (part,) if isinstance(part, str) else part
        ways = math.prod(sharding.mesh.shape[a] for a in axes)
        if data > 1 and size % (ways * data) == 0:
            spec[dim] = (*axes, "data") if axes else "data"
            return NamedSharding(sharding.mesh, P(*spec))
    return sharding


def make_loss(shardings, mesh, dtype=jnp.float32, eod_id: int | None = None):
    """loss(apply_fn, params, tokens_BT) -> (loss + the experts' losses, loss); with
    ``eod_id``, documents masked, the loss still counting every next token."""
    prepare = make_inputs(mesh, eod_id)

    def loss(apply_fn, params, tokens_BT):
        inputs_BT, targets_BT, positions_T, starts_BT = prepare(tokens_BT)
        params = cast(params, shardings, dtype)
        x_BTD, aux_loss = apply_fn(params).features(inputs_BT, positions_T, starts_BT)
        loss = head_loss(apply_fn, params, shardings, mesh, x_BTD, targets_BT)
        # The experts' losses train the router; the loss alone is logged.
        return loss + aux_loss, loss

    return loss


def head_loss(apply_fn, params, shardings, mesh, x_BTD, targets_BT) -> jax.Array:
    """The final norm, the output projection and the mean next-token loss, in chunks
    of columns (loss.fused_cross_entropy) where the logits would take more than
    loss.LOSS_CHUNK_BYTES a device."""
    names = (
        ("final_norm", "unembed") if "unembed" in params else ("final_norm", "embed")
    )
    head = {name: params[name] for name in names}
    specs = {
        name: jax.tree.map(lambda s: s.spec, shardings.params[name]) for name in names
    }
    vocab = params["embed"]["embedding"].shape[0]
    tokens, length = targets_BT.size, targets_BT.shape[1]
    # Where the batch is split, the devices already cut the logits, and chunks would
    # reduce the head's gradient over them once a chunk, not once a step.
    splits_batch = any(mesh.shape[axis] > 1 for axis in BATCH)
    chunks = (
        1 if splits_batch else loss_lib.loss_chunks(tokens, length, vocab, mesh.size)
    )
    return loss_lib.fused_cross_entropy(
        lambda head, x_BTD: apply_fn(head).logits(x_BTD),
        head,
        x_BTD,
        targets_BT,
        chunks,
        layout=lambda tree: jax.tree.map(jax.lax.with_sharding_constraint, tree, specs),
    )


def make_step_loss(
    model, shardings, mesh, dtype=jnp.float32, eod_id=None, microbatches: int = 1
):
    """make_loss's loss, or with a 'pipeline' axis pipeline.make_pipeline_loss's."""
    if mesh.shape["pipeline"] > 1:
        return make_pipeline_loss(model, shardings, mesh, dtype, eod_id, microbatches)
    return make_loss(shardings, mesh, dtype, eod_id)


def train_step(state, tokens_BT, *, loss_and_grads: Grads, shardings, zero1=False):
    """One optimizer step: the batch's mean loss and gradient (``loss_and_grads``, from
    make_grads), then AdamW's update of the weights."""
    loss, grads = loss_and_grads(state.apply_fn, state.params, tokens_BT)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    # ZeRO-1: each replica needs its share of the gradient, a reduce-scatter where
    # XLA finds one (XLA:CPU all-reduces, then each replica slices its share).
    if zero1:
        grads = jax.tree.map(
            lambda g, s: jax.lax.with_sharding_constraint(g, over_data(s, g.shape)),
            grads,
            shardings.params,
        )
    # --offload optimizer: Adam's moments come to the device for the update, then go
    # back to host memory.
    if in_host := offloaded(shardings):
        state = state.replace(opt_state=moved(state.opt_state, shardings, "device"))
    state = state.apply_gradients(grads=grads)
    if in_host:
        back = moved(state.opt_state, shardings, "pinned_host")
        state = state.replace(opt_state=back)
    return state, metrics


def make_train_step(shardings, mesh, run: RunConfig, model=None):
    """train_step, jitted for the state's ``shardings``, with make_grads' gradients
    (``model``: needed on a 'pipeline' axis), the state donated."""
    step = functools.partial(
        train_step,
        loss_and_grads=make_grads(shardings, mesh, run, model),
        shardings=shardings,
        zero1=run.zero1,
    )
    return jax.jit(
        step,
        in_shardings=(shardings, NamedSharding(mesh, P(BATCH))),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )


def make_grads(shardings, mesh, run: RunConfig, model=None) -> Grads:
    """The loss and gradient train_step takes: over the whole batch, over --grad-accum
    micro-batches one at a time, or through a 'pipeline' axis's stages."""
    dtype, micro = jnp.dtype(run.dtype), run.grad_accum
    pipelined = mesh.shape["pipeline"] > 1
    if pipelined and model is None:
        raise ValueError("a 'pipeline' axis needs the model, to cut it into stages")
    # 1F1B and interleaved 1F1B write their own backward
    if pipelined and run.schedule != "gpipe":
        return make_pipeline_grads(
            model,
            shardings,
            mesh,
            dtype,
            run.eod_id,
            micro,
            run.schedule,
            run.virtual_stages,
        )
    loss_fn = make_step_loss(model, shardings, mesh, dtype, run.eod_id, micro)
    whole = functools.partial(value_and_grads, loss_fn)
    # GPipe's loss cuts its own micro-batches
    if pipelined or micro == 1:
        return whole
    return functools.partial(
        accumulate_per_replica, whole, shardings=shardings, mesh=mesh, grad_accum=micro
    )


def value_and_grads(loss_fn, apply_fn, params, tokens_BT):
    """One micro-batch's mean loss and its gradient (``loss_fn``: make_step_loss's)."""
    grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
    # The gradient is the objective's (the experts' balance losses included); the
    # loss returned, and logged, is the cross-entropy alone.
    (_, loss), grads = grad_fn(apply_fn, params, tokens_BT)
    return loss, grads


def in_layout(tree, shardings):
    """``tree`` (gradients) held to the weights' layouts."""
    specs = jax.tree.map(lambda s: s.spec, shardings.params)
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, specs)


def accumulate(
    grads_of: Grads, apply_fn, params, tokens_BT, *, shardings, grad_accum, batch_axes
):
    """The mean loss and gradient over grad_accum micro-batches, one at a time."""

    def add(sum_, micro_BT):
        loss, grads = grads_of(apply_fn, params, micro_BT)
        # The running sum keeps the weights' layout: under FSDP each device holds
        # 1/fsdp of it, so each micro-batch's gradient is reduce-scattered into it
        # (a whole-size sum on every device would undo what FSDP saves).
        return in_layout(jax.tree.map(jnp.add, sum_, grads), shardings), loss

    zeros = in_layout(jax.tree.map(jnp.zeros_like, params), shardings)
    micro_KBT = micro_batches(tokens_BT, grad_accum, batch_axes)
    sums, losses_K = jax.lax.scan(add, zeros, micro_KBT)
    # Micro-batches of equal size: the mean of their means is the batch's mean.
    return losses_K.mean(), jax.tree.map(lambda g: g / grad_accum, sums)


def accumulate_per_replica(
    grads_of: Grads, apply_fn, params, tokens_BT, *, shardings, mesh, grad_accum
):
    """accumulate, with the gradients reduced over 'data' once per step, not once per
    micro-batch (which an all-reduce of each micro-batch's gradient would do)."""
    each = dict(shardings=shardings, grad_accum=grad_accum)
    replicas = mesh.shape["data"]
    if replicas == 1:
        return accumulate(
            grads_of, apply_fn, params, tokens_BT, **each, batch_axes=BATCH
        )
    # One part per data replica, the step vmapped over the parts along 'data': each
    # replica sums its own gradient apart from the others' (a leading axis split over
    # 'data', no more bytes a device), and one mean after the loop reduces them.
    # Inside the vmap, layouts may not name 'data', the vmapped axis.
    B, T = tokens_BT.shape
    parts_RBT = tokens_BT.reshape(replicas, B // replicas, T)
    with nn.logical_axis_rules(without("data")):
        losses_R, grads_R = jax.vmap(
            lambda part_BT: accumulate(
                grads_of, apply_fn, params, part_BT, **each, batch_axes=BATCH[1:]
            ),
            spmd_axis_name="data",
        )(parts_RBT)
    return losses_R.mean(), jax.tree.map(lambda g: g.mean(0), grads_R)


def offloaded(shardings) -> bool:
    """Whether abstract_state's shardings keep the optimizer's state in host memory."""
    kinds = {s.memory_kind for s in jax.tree.leaves(shardings.opt_state)}
    return kinds == {"pinned_host"}


def moved(tree, shardings, kind: str):
    """``tree`` (the optimizer's state) put in memory ``kind``, as laid out."""
    to = jax.tree.map(lambda s: s.with_memory_kind(kind), shardings.opt_state)
    return jax.device_put(tree, to)


def make_eval_step(
    shardings,
    mesh,
    dtype=jnp.float32,
    eod_id: int | None = None,
    model=None,
    microbatches: int = 1,
):
    """The held-out loss of a batch: the training loss, without gradients, in the
    training step's ``microbatches`` (so it needs no more memory than the step)."""
    loss_fn = make_step_loss(model, shardings, mesh, dtype, eod_id, microbatches)
    # a pipeline cuts its own micro-batches
    pipelined = mesh.shape["pipeline"] > 1

    def eval_step(state, tokens_BT):
        loss = lambda tokens_BT: loss_fn(state.apply_fn, state.params, tokens_BT)[1]
        if pipelined or microbatches == 1:
            return loss(tokens_BT)
        micro_KBT = micro_batches(tokens_BT, microbatches, BATCH)
        # Micro-batches of equal size: the mean of their means is the batch's.
        return jax.lax.map(loss, micro_KBT).mean()

    return jax.jit(
        eval_step,
        in_shardings=(shardings, NamedSharding(mesh, P(BATCH))),
        out_shardings=NamedSharding(mesh, P()),
    )
