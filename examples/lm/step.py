"""The training step: the train state's shapes and shardings, the loss, and its gradient
over one batch or over --grad-accum micro-batches (through pipeline.py's stages with a
'pipeline' axis); the held-out loss.
"""

import dataclasses
import math
from collections.abc import Collection

import flax.linen as nn
import jax
import jax.numpy as jnp
import model as model_lib
import optax
from flax.training import train_state
from inputs import cast, make_inputs, micro_batches
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layout import BATCH, RULES, without
from pipeline import make_pipeline_grads, make_pipeline_loss


def abstract_state(
    model, tx, mesh, seq_len: int, offload: Collection[str] = (), zero1: bool = False
):
    """The train state's shapes and shardings, from tracing init under the rules; with
    "optimizer" in ``offload``, Adam's state kept in the host's pinned memory; with
    ``zero1``, split over 'data' (ZeRO stage 1)."""

    # The weights are the same whatever the attention and the experts' dispatch: traced
    # for one row, with XLA's attention and the capacity's dispatch.
    config = dataclasses.replace(model.config, dispatch="capacity")

    def init(rng):
        plain = model.clone(config=config, context_parallel=False, attention="xla")
        params = plain.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

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
    if "optimizer" in offload:  # JAX's memory kinds: the moments live in host memory
        host = lambda s: s.with_memory_kind("pinned_host")
        shardings = shardings.replace(opt_state=jax.tree.map(host, shardings.opt_state))
    shapes = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        strip(boxed),
        shardings,
    )
    return shapes, lambda rng: nn.meta.unbox(init(rng))


def over_data(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """``sharding`` with 'data' added on the first dimension it splits evenly (ZeRO-1:
    each data replica updates its share of the optimizer's state; XLA then gathers
    the updated weights). Unchanged where none does."""
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
    """loss(apply_fn, params, tokens_BT) -> (loss + the experts' losses, loss).

    With ``eod_id``, each document of a row (ending with that token) is attended to and
    positioned on its own; the loss still counts every next token."""
    prepare = make_inputs(mesh, eod_id)

    def loss(apply_fn, params, tokens_BT):
        inputs_BT, targets_BT, positions_T, starts_BT = prepare(tokens_BT)
        params = cast(params, shardings, dtype)
        x_BTD, aux_loss = apply_fn(
            {"params": params}, inputs_BT, positions_T, starts_BT, method="features"
        )
        loss = head_loss(apply_fn, params, shardings, mesh, x_BTD, targets_BT)
        return loss + aux_loss, loss  # the experts' losses train the router

    return loss


def head_loss(apply_fn, params, shardings, mesh, x_BTD, targets_BT) -> jax.Array:
    """The final norm, the output projection and the mean next-token loss, a chunk of
    columns at a time where all the float32 logits would take more than
    model.LOSS_CHUNK_BYTES a device (model.fused_cross_entropy), on a mesh that does not
    split the batch (one device; tensor, sequence or pipeline axes). Where the batch is
    split, the devices already cut the logits, and each chunk's share of the head's
    gradient would be reduced over the batch's devices: one all-reduce a chunk, not one
    a step (--grad-accum cuts the logits there)."""
    names = (
        ("final_norm", "unembed") if "unembed" in params else ("final_norm", "embed")
    )
    head = {name: params[name] for name in names}
    specs = {
        name: jax.tree.map(lambda s: s.spec, shardings.params[name]) for name in names
    }
    vocab = params["embed"]["embedding"].shape[0]
    tokens, length = targets_BT.size, targets_BT.shape[1]
    splits_batch = any(mesh.shape[axis] > 1 for axis in BATCH)
    chunks = (
        1 if splits_batch else model_lib.loss_chunks(tokens, length, vocab, mesh.size)
    )
    return model_lib.fused_cross_entropy(
        lambda head, x_BTD: apply_fn({"params": head}, x_BTD, method="logits"),
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


def make_train_step(
    shardings,
    mesh,
    dtype=jnp.float32,
    grad_accum: int = 1,
    eod_id: int | None = None,
    model=None,
    schedule: str = "gpipe",
    virtual: int = 1,
    zero1: bool = False,
):
    """The jitted training step. With a 'pipeline' axis (``model`` given), the
    --grad-accum micro-batches go through the pipeline's stages on ``schedule``
    (GPipe, 1F1B, or interleaved 1F1B with ``virtual`` stages per device)."""
    specs = jax.tree.map(lambda s: s.spec, shardings.params)  # the weights' layouts
    keep_layout = lambda tree: jax.tree.map(
        jax.lax.with_sharding_constraint, tree, specs
    )
    loss_fn = make_step_loss(model, shardings, mesh, dtype, eod_id, grad_accum)
    pipelined = mesh.shape["pipeline"] > 1
    micro, grad_accum = grad_accum, 1 if pipelined else grad_accum  # the pipeline's

    def loss_and_grads(apply_fn, params, tokens_BT):
        """One micro-batch's mean loss and its gradient."""
        grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
        (_, loss), grads = grad_fn(apply_fn, params, tokens_BT)
        return loss, grads

    if pipelined and schedule != "gpipe":  # 1F1B writes its own backward
        loss_and_grads = make_pipeline_grads(
            model, shardings, mesh, dtype, eod_id, micro, schedule, virtual
        )

    def accumulate(apply_fn, params, tokens_BT, batch_axes):
        """The mean loss and gradient over grad_accum micro-batches, one at a time."""

        def add(sum_, micro_BT):
            loss, grads = loss_and_grads(apply_fn, params, micro_BT)
            # The running sum keeps the weights' layout: under FSDP each device holds
            # 1/fsdp of it, so each micro-batch's gradient is reduce-scattered into it
            # (a whole-size sum on every device would undo what FSDP saves).
            return keep_layout(jax.tree.map(jnp.add, sum_, grads)), loss

        zeros = keep_layout(jax.tree.map(jnp.zeros_like, params))
        micro_KBT = micro_batches(tokens_BT, grad_accum, batch_axes)
        sums, losses_K = jax.lax.scan(add, zeros, micro_KBT)
        # Micro-batches of equal size: the mean of their means is the batch's mean.
        return losses_K.mean(), jax.tree.map(lambda g: g / grad_accum, sums)

    def accumulated(apply_fn, params, tokens_BT):
        """accumulate, with the gradients reduced over 'data' once per step, not once
        per micro-batch. The batch is cut into one part per data replica and the step
        vmapped over the parts (spmd_axis_name: the parts lie along 'data'), so each
        replica adds up its own gradient, kept apart from the others' (a leading axis
        split over 'data': no more bytes per device); one sum after the loop reduces
        them. Without the parts, each micro-batch's gradient would be all-reduced."""
        replicas = mesh.shape["data"]
        if replicas == 1:
            return accumulate(apply_fn, params, tokens_BT, BATCH)
        B, T = tokens_BT.shape
        parts_RBT = tokens_BT.reshape(replicas, B // replicas, T)
        with nn.logical_axis_rules(without("data")):  # 'data' is the vmapped axis
            losses_R, grads_R = jax.vmap(
                lambda part_BT: accumulate(apply_fn, params, part_BT, BATCH[1:]),
                spmd_axis_name="data",
            )(parts_RBT)
        return losses_R.mean(), jax.tree.map(lambda g: g.mean(0), grads_R)

    host_kinds = {s.memory_kind for s in jax.tree.leaves(shardings.opt_state)}
    in_host = host_kinds == {"pinned_host"}  # abstract_state(offload={"optimizer"})

    def moved(tree, kind: str):
        """``tree`` (the optimizer's state) put in memory ``kind``, as laid out."""
        to = jax.tree.map(lambda s: s.with_memory_kind(kind), shardings.opt_state)
        return jax.device_put(tree, to)

    def train_step(state, tokens_BT):
        step_grads = loss_and_grads if grad_accum == 1 else accumulated
        loss, grads = step_grads(state.apply_fn, state.params, tokens_BT)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        # ZeRO-1: each replica needs its share of the gradient, a reduce-scatter where
        # XLA finds one (XLA:CPU all-reduces, then each replica slices its share).
        if zero1:
            grads = jax.tree.map(
                lambda g, s: jax.lax.with_sharding_constraint(g, over_data(s, g.shape)),
                grads,
                shardings.params,
            )
        if in_host:  # Adam's moments in for the update, and back out
            state = state.replace(opt_state=moved(state.opt_state, "device"))
        state = state.apply_gradients(grads=grads)
        if in_host:
            state = state.replace(opt_state=moved(state.opt_state, "pinned_host"))
        return state, metrics

    batch = NamedSharding(mesh, P(BATCH))
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )


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
    pipelined = mesh.shape["pipeline"] > 1  # the pipeline cuts its own micro-batches

    def eval_step(state, tokens_BT):
        loss = lambda tokens_BT: loss_fn(state.apply_fn, state.params, tokens_BT)[1]
        if pipelined or microbatches == 1:
            return loss(tokens_BT)
        micro_KBT = micro_batches(tokens_BT, microbatches, BATCH)
        return jax.lax.map(loss, micro_KBT).mean()  # equal sizes: the mean of means

    return jax.jit(
        eval_step,
        in_shardings=(shardings, NamedSharding(mesh, P(BATCH))),
        out_shardings=NamedSharding(mesh, P()),
    )
