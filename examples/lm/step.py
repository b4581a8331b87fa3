"""The training step: AdamW, the train state's shapes and shardings, the loss, and
its gradient over one batch or over --grad-accum micro-batches; the held-out loss.
"""

import dataclasses
import math
from collections.abc import Collection

import flax.linen as nn
import jax
import jax.numpy as jnp
import model as model_lib
import numpy as np
import optax
import pipeline
import schedules
from attention import document_starts
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layout import BATCH, RULES, without, zigzag


def make_optimizer(args) -> optax.GradientTransformation:
    """AdamW, warmup + cosine decay, global-norm clipping; only the kernels decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        args.learning_rate,
        args.warmup_steps,
        max(args.total_steps or args.steps, args.warmup_steps + 1),
        end_value=args.learning_rate / 10,
    )

    def decay(params):  # only matmul weights ('kernel'); not 'scale' nor 'embedding'
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "kernel" in jax.tree_util.keystr(p), params
        )

    # Under jit the gradients are sharded arrays, and clip_by_global_norm sums over all
    # of them: the clipping sees the whole model's norm, whatever the mesh.
    adamw = optax.chain(
        optax.clip_by_global_norm(args.clip_norm),
        optax.adamw(
            schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay
        ),
    )
    moments = jnp.dtype(getattr(args, "moments", "float32"))
    if getattr(args, "balance", "loss") != "bias":
        return kept_in(moments, adamw)

    # --balance bias: the experts' routing biases move by sign descent, --bias-rate a
    # step against their gradient (load - 1/E: model.Experts.route); AdamW the rest.
    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: (
                "bias" if "router_bias" in jax.tree_util.keystr(p) else "adamw"
            ),
            params,
        )

    sign_descent = optax.chain(optax.scale_by_sign(), optax.scale(-args.bias_rate))
    both = optax.multi_transform({"adamw": adamw, "bias": sign_descent}, labels)
    return kept_in(moments, both)


def kept_in(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` with its floating-point state (Adam's moments) kept in ``dtype``
    between steps and updated in float32 (--moments bfloat16: half the bytes, 4 a
    weight instead of 8). Unchanged for float32."""
    if dtype == jnp.float32:
        return inner
    floats = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
    to = lambda tree, dtype: jax.tree.map(
        lambda x: x.astype(dtype) if floats(x) else x, tree
    )

    def update(updates, state, params=None):
        updates, state = inner.update(updates, to(state, jnp.float32), params)
        return updates, to(state, dtype)

    return optax.GradientTransformation(lambda p: to(inner.init(p), dtype), update)


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


def micro_batches(tokens_BT: jax.Array, grad_accum: int, batch_axes) -> jax.Array:
    """(B, T) -> (grad_accum, B / grad_accum, T); micro-batch k holds rows k, k + K, ...

    Every K-th row, not K blocks of rows: each device's rows are a contiguous block of
    the batch, so each micro-batch takes B / (K x devices) rows from every device and
    no row moves (a block split would put micro-batch 0 on the first devices alone).
    """
    B, *rest = tokens_BT.shape
    micro_KBT = tokens_BT.reshape(B // grad_accum, grad_accum, *rest).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(micro_KBT, P(None, batch_axes))


def make_inputs(mesh, eod_id: int | None = None):
    """tokens_BT -> (inputs_BT, targets_BT, positions_T, starts_BT): the model's inputs
    and the next tokens, in ring attention's zigzag order if there is a 'sequence'
    axis. With ``eod_id``, each document of a row (ending with that token) is attended
    to and positioned on its own (starts_BT); else starts_BT is None."""
    sequence = mesh.shape["sequence"]

    def inputs(tokens_BT):
        inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
        positions_T = np.arange(inputs_BT.shape[1])
        starts_BT = None
        if eod_id is not None:  # found in text order, then moved with the tokens
            starts_BT = document_starts(inputs_BT, eod_id)
        if sequence > 1:  # zigzag: each device of the ring gets early and late tokens
            positions_T = zigzag(inputs_BT.shape[1], sequence)
            inputs_BT, targets_BT = (
                inputs_BT[:, positions_T],
                targets_BT[:, positions_T],
            )
            starts_BT = None if starts_BT is None else starts_BT[:, positions_T]
        return inputs_BT, targets_BT, positions_T, starts_BT

    return inputs


def cast(params, shardings, dtype):
    """Float32 master weights, cast to the compute type on each device's shard: FSDP
    then gathers bfloat16 weights, half the bytes (as FSDP2's param_dtype does)."""
    specs = jax.tree.map(lambda s: s.spec, shardings.params)  # the weights' layouts
    return jax.tree.map(
        lambda p, spec: jax.lax.with_sharding_constraint(p.astype(dtype), spec),
        params,
        specs,
    )


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


class Pipeline:
    """The model cut for the 'pipeline' axis into ``stages`` stages of equal depth
    (pipeline.py): the embedding before the first, the final norm and the output
    projection after the last, run by any of pipeline.py's schedules."""

    def __init__(self, model, shardings, mesh, dtype, eod_id, microbatches, stages):
        self.model, self.shardings, self.dtype = model, shardings, dtype
        self.prepare = make_inputs(mesh, eod_id)
        self.microbatches = microbatches
        config = model.config
        self.stage_model = model.clone(
            config=dataclasses.replace(config, num_layers=config.num_layers // stages)
        )

    def stage(self, positions_T):
        """stage(layers, x_BTD, micro) -> (x_BTD, the experts' losses)."""

        def run(layers, x_BTD, micro):
            _, starts_BT = micro
            return self.stage_model.apply(
                {"params": {"layers": layers}},
                x_BTD,
                positions_T,
                starts_BT,
                method="run_layers",
            )

        return run

    def last(self, rest, x_BTD, micro):
        """The last stage's loss: the final norm, the output projection, the mean
        next-token loss of the micro-batch."""
        targets_BT, _ = micro
        logits_BTV = self.model.apply({"params": rest}, x_BTD, method="logits")
        return model_lib.cross_entropy(logits_BTV, targets_BT)

    def split(self, a):
        """(B, ...) -> (M, B / M, ...), the micro-batches (None stays None)."""
        return None if a is None else micro_batches(a, self.microbatches, BATCH)

    def inputs(self, apply_fn, params, tokens_BT):
        """-> (the weights cast, the first stage's input, positions, per micro-batch
        (targets, document starts))."""
        inputs_BT, targets_BT, positions_T, starts_BT = self.prepare(tokens_BT)
        params = cast(params, self.shardings, self.dtype)
        x_BTD = apply_fn({"params": params}, inputs_BT, method="embed_tokens")
        per_micro = (self.split(targets_BT), self.split(starts_BT))
        return params, x_BTD, positions_T, per_micro


def make_pipeline_loss(
    model, shardings, mesh, dtype=jnp.float32, eod_id=None, microbatches: int = 1
):
    """make_loss's loss, its layers run as a pipeline over the 'pipeline' axis (GPipe,
    pipeline.py) in ``microbatches`` micro-batches; the embedding on every stage, the
    final norm and output projection on the last."""
    stages = mesh.shape["pipeline"]
    pipe = Pipeline(model, shardings, mesh, dtype, eod_id, microbatches, stages)

    def loss(apply_fn, params, tokens_BT):
        params, x_BTD, positions_T, per_micro = pipe.inputs(apply_fn, params, tokens_BT)
        rest = {name: tree for name, tree in params.items() if name != "layers"}
        loss, aux_loss = pipeline.gpipe(
            pipe.stage(positions_T),
            pipe.last,
            params["layers"],
            rest,
            pipe.split(x_BTD),
            per_micro,
        )
        return (loss + aux_loss) / microbatches, loss / microbatches

    return loss


def make_pipeline_grads(
    model,
    shardings,
    mesh,
    dtype=jnp.float32,
    eod_id=None,
    microbatches: int = 1,
    schedule: str = "1f1b",
    virtual: int = 1,
):
    """(apply_fn, params, tokens_BT) -> (the loss, its gradient), the layers run on
    1F1B or interleaved 1F1B (pipeline.scheduled), which computes the gradients itself.

    Interleaved 1F1B runs stage c P + p on device p: the layers' weights, kept in the
    model's order (P blocks of layers, so that checkpoints restore on any mesh), are
    reordered into (V, P, layers per stage) once per step, an all-to-all over
    'pipeline', and their gradients back."""
    stages = mesh.shape["pipeline"]
    cut = stages * virtual
    pipe = Pipeline(model, shardings, mesh, dtype, eod_id, microbatches, cut)
    table = schedules.schedule(schedule, stages, microbatches, virtual)
    specs = shardings.params["layers"]

    def to_chunks(layers):  # (L, ...) -> (V, P, L / (P V), ...), P over 'pipeline'
        return jax.tree.map(
            lambda a, s: jax.lax.with_sharding_constraint(
                a.reshape(virtual, stages, -1, *a.shape[1:]),
                P(None, "pipeline", None, *s.spec[1:]),
            ),
            layers,
            specs,
        )

    def from_chunks(chunks):
        return jax.tree.map(
            lambda a, s: jax.lax.with_sharding_constraint(
                a.reshape(-1, *a.shape[3:]), s.spec
            ),
            chunks,
            specs,
        )

    def loss_and_grads(apply_fn, params, tokens_BT):
        def front(params):  # the cast weights and the first stage's input
            cast_params, x_BTD, positions_T, per_micro = pipe.inputs(
                apply_fn, params, tokens_BT
            )
            return (cast_params, x_BTD), (positions_T, per_micro)

        (cast_params, x_BTD), front_vjp, (positions_T, per_micro) = jax.vjp(
            front, params, has_aux=True
        )
        rest = {name: tree for name, tree in cast_params.items() if name != "layers"}
        loss, aux_loss, g_chunks, g_rest, g_x_MBTD = pipeline.scheduled(
            pipe.stage(positions_T),
            pipe.last,
            to_chunks(cast_params["layers"]),
            rest,
            pipe.split(x_BTD),
            per_micro,
            table,
        )
        g_cast = {**g_rest, "layers": from_chunks(g_chunks)}
        g_cast = jax.tree.map(lambda g, w: g.astype(w.dtype), g_cast, cast_params)
        B, *rest_shape = x_BTD.shape
        g_x_BTD = g_x_MBTD.swapaxes(0, 1).reshape(B, *rest_shape)
        (grads,) = front_vjp((g_cast, g_x_BTD))
        mean = lambda a: a / microbatches
        return mean(loss), jax.tree.map(mean, grads)

    return loss_and_grads


def make_step_loss(
    model, shardings, mesh, dtype=jnp.float32, eod_id=None, microbatches: int = 1
):
    """make_loss's loss, or with a 'pipeline' axis make_pipeline_loss's."""
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
