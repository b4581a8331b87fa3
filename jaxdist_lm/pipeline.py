"""Pipeline parallelism over the 'pipeline' mesh axis: GPipe, 1F1B, interleaved 1F1B.

The layers are cut into P x V stages of equal depth (V virtual stages per device,
interleaved's); device p runs stages p, p + P, ... in a jax.shard_map manual over
'pipeline' alone, so 'data', 'fsdp' and 'tensor' split each stage as without a pipeline.
gpipe runs the forwards and lets jax.grad write the backward (GPipe, arXiv:1811.06965);
scheduled runs forwards and backwards as 1F1B orders them (PipeDream-Flush,
arXiv:2006.09503; interleaved: Megatron-LM, arXiv:2104.04473).
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import loss as loss_lib
from . import model as model_lib
from . import schedules
from .inputs import cast, make_inputs, micro_batches
from .layout import BATCH

AXIS = "pipeline"


def gpipe(stage, last, layers, rest, x_MBTD, per_micro):
    """The sums over M micro-batches of ``last``'s loss and of the stages' auxiliary
    losses, GPipe's way: ``stage(layers, x_BTD, micro) -> (x_BTD, aux)`` on every
    stage, ``last(rest, x_BTD, micro) -> loss`` on the last."""
    M = x_MBTD.shape[0]

    def per_stage(layers, rest, x_MBTD, per_micro):
        P_ = jax.lax.axis_size(AXIS)
        index = jax.lax.axis_index(AXIS)
        # the last stage sends nothing
        to_next = [(p, p + 1) for p in range(P_ - 1)]

        # At tick t, stage p works on micro-batch t - p.
        def tick(carry, t):
            held_BTD, loss, aux = carry
            m = jnp.clip(t - index, 0, M - 1)
            micro = jax.tree.map(lambda a: a[m], per_micro)
            x_BTD = jnp.where(index == 0, x_MBTD[m], held_BTD)
            x_BTD, stage_aux = stage(layers, x_BTD, micro)
            active = (t >= index) & (t - index < M)
            aux += jnp.where(active, stage_aux, 0.0)
            # The loss recomputed in the backward (jax.checkpoint): else each tick would
            # keep its float32 logits, B x T x V, until then (at 8B, 2.1 GB a sequence).
            loss += jax.lax.cond(
                active & (index == P_ - 1),
                lambda: jax.checkpoint(last)(rest, x_BTD, micro).astype(jnp.float32),
                lambda: jnp.zeros((), jnp.float32),
            )
            return (jax.lax.ppermute(x_BTD, AXIS, to_next), loss, aux), None

        zero = jnp.zeros((), jnp.float32)
        start = (jnp.zeros_like(x_MBTD[0]), zero, zero)
        (_, loss, aux), _ = jax.lax.scan(tick, start, jnp.arange(M + P_ - 1))
        # the last stage's loss; each stage's auxiliary losses
        return loss[None], aux[None]

    # check_vma=False: the stages' values differ (the loss is on the last one only), and
    # are summed outside, so that each gradient reaches the stage that made it once.
    on_stages = jax.shard_map(
        lambda layers, rest, x_MBTD, per_micro: per_stage(
            layers, low(rest, dtype), x_MBTD.astype(dtype), per_micro
        ),
        in_specs=(P(AXIS), P(), P(), P()),
        out_specs=(P(AXIS), P(AXIS)),
        axis_names={AXIS},
        check_vma=False,
    )
    # What every stage gets whole goes in as float32 (see high), and back in dtype.
    dtype = x_MBTD.dtype
    loss_P, aux_P = on_stages(layers, high(rest), high(x_MBTD), per_micro)
    return loss_P.sum(), aux_P.sum()


def scheduled(stage, last, chunks, rest, x_MBTD, per_micro, table, mesh=None):
    """Run a 1F1B or interleaved ``table`` forward and backward: -> the sums of the
    losses, and their gradients. ``chunks``: the layers' weights as (V, P, L / (P V),
    ...), stage c P + p at [c, p]; the other arguments as in gpipe."""
    arrays, num_inputs, num_grads = schedules.slot_tables(table)
    V, P_ = jax.tree.leaves(chunks)[0].shape[:2]
    last_chunk = V - 1
    # Interleaved, the last device's stage feeds the first device's next one.
    ring = V > 1
    to_next = [(p, (p + 1) % P_) for p in range(P_ if ring else P_ - 1)]
    to_prev = [(p, (p - 1) % P_) for p in range(0 if ring else 1, P_)]

    def per_device(chunks, rest, x_MBTD, per_micro):
        device = jax.lax.axis_index(AXIS)
        # The table's columns, read one tick and device at a time: [tick, device].
        tabs = {k: jnp.asarray(a) for k, a in arrays.items()}
        # this device's stages: (V, L / (P V), ...)
        chunks = jax.tree.map(lambda c: c[:, 0], chunks)
        zero_BTD = jnp.zeros_like(x_MBTD[0])
        zeros32 = lambda tree: jax.tree.map(
            partial(jnp.zeros_like, dtype=jnp.float32), tree
        )

        def forward(carry, m, c, slot, gslot):
            inputs, grads_in, sums = carry
            first = (device == 0) & (c == 0)
            x_BTD = jnp.where(first, x_MBTD[m], inputs[slot])
            # the stage's input, kept for the backward, which recomputes the stage
            inputs = inputs.at[slot].set(x_BTD)
            micro = jax.tree.map(lambda a: a[m], per_micro)
            y_BTD, _ = stage(jax.tree.map(lambda a: a[c], chunks), x_BTD, micro)
            return (inputs, grads_in, sums), y_BTD, zero_BTD

        def backward(carry, m, c, slot, gslot):
            inputs, grads_in, (g_chunks, g_rest, g_x_MBTD, loss, aux) = carry
            micro = jax.tree.map(lambda a: a[m], per_micro)
            mine = jax.tree.map(lambda a: a[c], chunks)
            # Recompute the stage from its kept input, then run its backward.
            (y_BTD, stage_aux), vjp = jax.vjp(
                lambda w, x: stage(w, x, micro), mine, inputs[slot]
            )

            # the last stage: the loss, and its gradient
            def head():
                value, (g_head, g_y) = jax.value_and_grad(last, argnums=(0, 1))(
                    rest, y_BTD, micro
                )
                return value.astype(jnp.float32), high(g_head), g_y

            # any other: the gradient the next stage sent back
            def inner():
                return jnp.zeros((), jnp.float32), zeros32(rest), grads_in[gslot]

            is_last = (device == P_ - 1) & (c == last_chunk)
            value, g_head, g_y = jax.lax.cond(is_last, head, inner)
            g_mine, g_x = vjp((g_y, jnp.ones_like(stage_aux)))
            g_chunks = jax.tree.map(
                lambda s, g: s.at[c].add(g.astype(jnp.float32)), g_chunks, g_mine
            )
            g_rest = jax.tree.map(jnp.add, g_rest, g_head)
            # only the first stage's input gradient flows on, to the embedding
            first = (device == 0) & (c == 0)
            g_x_MBTD = g_x_MBTD.at[m].add(jnp.where(first, g_x, 0))
            loss, aux = loss + value, aux + stage_aux.astype(jnp.float32)
            sums = (g_chunks, g_rest, g_x_MBTD, loss, aux)
            return (inputs, grads_in, sums), zero_BTD, g_x

        def idle(carry, *op):
            return carry, zero_BTD, zero_BTD

        def tick(carry, t):
            op = [tabs[k][t, device] for k in ("micro", "chunk", "slot", "gslot")]
            (inputs, grads_in, sums), y_BTD, g_x = jax.lax.switch(
                tabs["kind"][t, device], (idle, forward, backward), carry, *op
            )
            got_f = jax.lax.ppermute(y_BTD, AXIS, to_next)
            got_b = jax.lax.ppermute(g_x, AXIS, to_prev)
            rf, rb = tabs["recv_f"][t, device] - 1, tabs["recv_b"][t, device] - 1
            inputs = jnp.where(rf >= 0, inputs.at[rf].set(got_f), inputs)
            grads_in = jnp.where(rb >= 0, grads_in.at[rb].set(got_b), grads_in)
            return (inputs, grads_in, sums), None

        # Each device keeps its stages' inputs, and the gradients it gets back, in pools
        # of slots that schedules.slot_tables sizes.
        pool = lambda n: jnp.zeros((n, *zero_BTD.shape), zero_BTD.dtype)
        zero = jnp.zeros((), jnp.float32)
        sums = (zeros32(chunks), zeros32(rest), jnp.zeros_like(x_MBTD), zero, zero)
        start = (pool(num_inputs), pool(num_grads), sums)
        steps = jnp.arange(len(table))
        (_, _, (g_chunks, g_rest, g_x_MBTD, loss, aux)), _ = jax.lax.scan(
            tick, start, steps
        )
        # Summed over the stages: the head's gradient is the last device's, the first
        # stage's input gradient the first device's.
        g_rest, g_x_MBTD = jax.lax.psum(high((g_rest, g_x_MBTD)), AXIS)
        g_chunks = jax.tree.map(lambda g: g[:, None], g_chunks)
        return loss[None], aux[None], g_chunks, g_rest, g_x_MBTD

    # check_vma=False: the devices run different operations each tick (a switch on
    # the table), and the gradients are summed over the stages by hand.
    on_devices = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(None, AXIS), P(), P(), P()),
        out_specs=(P(AXIS), P(AXIS), P(None, AXIS), P(), P()),
        axis_names={AXIS},
        check_vma=False,
    )
    loss_P, aux_P, g_chunks, g_rest, g_x_MBTD = on_devices(
        chunks, rest, x_MBTD, per_micro
    )
    return loss_P.sum(), aux_P.sum(), g_chunks, g_rest, g_x_MBTD.astype(x_MBTD.dtype)


def high(tree):
    """bfloat16 leaves as float32, so that each sum over 'pipeline' runs in float32."""
    # XLA:CPU cannot compile a bfloat16 all-reduce from a shard_map's psum or transpose
    # ("Invalid binary instruction opcode copy", jax 0.10.2).
    return jax.tree.map(
        lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, tree
    )


def low(tree, dtype):
    """high's float32 leaves back in ``dtype``."""
    back = lambda a: a.astype(dtype) if a.dtype == jnp.float32 else a
    return jax.tree.map(back, tree)


class Pipeline:
    """The model cut for the 'pipeline' axis into ``stages`` stages of equal depth: the
    embedding before the first, the final norm and the output projection after the
    last, run by gpipe or scheduled."""

    def __init__(self, model, shardings, mesh, dtype, eod_id, microbatches, stages):
        self.model, self.shardings, self.dtype = model, shardings, dtype
        self.prepare = make_inputs(mesh, eod_id)
        self.microbatches = microbatches
        config = model.config
        self.stage_model = model_lib.variant(
            model,
            config=dataclasses.replace(config, num_layers=config.num_layers // stages),
        )

    def stage(self, positions_T):
        """stage(layers, x_BTD, micro) -> (x_BTD, the experts' losses)."""

        def run(layers, x_BTD, micro):
            _, starts_BT = micro
            stage = model_lib.with_params(self.stage_model, {"layers": layers})
            return stage.run_layers(x_BTD, positions_T, starts_BT)

        return run

    def last(self, rest, x_BTD, micro):
        """The last stage's loss: the final norm, the output projection, the mean
        next-token loss of the micro-batch."""
        targets_BT, _ = micro
        logits_BTV = model_lib.with_params(self.model, rest).logits(x_BTD)
        return loss_lib.cross_entropy(logits_BTV, targets_BT)

    def split(self, a):
        """(B, ...) -> (M, B / M, ...), the micro-batches (None stays None)."""
        return None if a is None else micro_batches(a, self.microbatches, BATCH)

    def inputs(self, apply_fn, params, tokens_BT):
        """-> (the weights cast, the first stage's input, positions, per micro-batch
        (targets, document starts))."""
        inputs_BT, targets_BT, positions_T, starts_BT = self.prepare(tokens_BT)
        params = cast(params, self.shardings, self.dtype)
        x_BTD = apply_fn(params).embed_tokens(inputs_BT)
        per_micro = (self.split(targets_BT), self.split(starts_BT))
        return params, x_BTD, positions_T, per_micro


def make_pipeline_loss(
    model, shardings, mesh, dtype=jnp.float32, eod_id=None, microbatches: int = 1
):
    """step.make_loss's loss, its layers run as a pipeline over the 'pipeline' axis
    (gpipe) in ``microbatches`` micro-batches; the embedding on every stage, the
    final norm and output projection on the last."""
    stages = mesh.shape["pipeline"]
    pipe = Pipeline(model, shardings, mesh, dtype, eod_id, microbatches, stages)

    def loss(apply_fn, params, tokens_BT):
        params, x_BTD, positions_T, per_micro = pipe.inputs(apply_fn, params, tokens_BT)
        rest = {name: tree for name, tree in params.items() if name != "layers"}
        loss, aux_loss = gpipe(
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
    1F1B or interleaved 1F1B (scheduled), which computes the gradients itself."""
    stages = mesh.shape["pipeline"]
    cut = stages * virtual
    pipe = Pipeline(model, shardings, mesh, dtype, eod_id, microbatches, cut)
    table = schedules.schedule(schedule, stages, microbatches, virtual)
    specs = shardings.params["layers"]

    # (L, ...) -> (V, P, L / (P V), ...), P over 'pipeline'. The weights stay in the
    # model's order, so that checkpoints restore on any mesh; interleaved, this is an
    # all-to-all over 'pipeline' once a step, and from_chunks one for the gradients.
    def to_chunks(layers):
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
        # the cast weights and the first stage's input
        def front(params):
            cast_params, x_BTD, positions_T, per_micro = pipe.inputs(
                apply_fn, params, tokens_BT
            )
            return (cast_params, x_BTD), (positions_T, per_micro)

        (cast_params, x_BTD), front_vjp, (positions_T, per_micro) = jax.vjp(
            front, params, has_aux=True
        )
        rest = {name: tree for name, tree in cast_params.items() if name != "layers"}
        loss, aux_loss, g_chunks, g_rest, g_x_MBTD = scheduled(
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
