"""Pipeline parallelism over the 'pipeline' mesh axis: GPipe.

The layers are cut into as many stages as the axis has devices: the rules put the
stacked layers' leading axis on 'pipeline', so device p of it holds layers
p·L/P ... (p+1)·L/P - 1. Inside a stage, 'data', 'fsdp' and 'tensor' split the work as
they do without a pipeline: the stage runs in a jax.shard_map that is manual over
'pipeline' alone. The batch goes through in M micro-batches (--grad-accum): at tick t,
stage p works on micro-batch t - p and hands its output to stage p + 1 with one
ppermute, so M + P - 1 ticks run them all; the last stage turns each output into its
loss. jax.grad writes the backward, which runs the ticks in reverse (GPipe: Huang et al.
2019, arXiv:1811.06965): each stage keeps what its M micro-batches' backward needs.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "pipeline"


def gpipe(stage, last, params, layer_specs, x_MBTD, per_micro):
    """The mean over M micro-batches of ``last``'s loss, and of the stages' auxiliary
    losses, computed GPipe's way over the 'pipeline' axis.

    ``stage(params, x_BTD, micro) -> (x_BTD, aux)`` runs one stage's layers, with
    ``params`` holding this stage's share of them; ``last(params, x_BTD, micro) ->
    loss`` runs on the last stage only. ``x_MBTD`` is every micro-batch's input to the
    first stage; ``per_micro`` is a pytree of arrays with a leading M, the micro-batch's
    own (targets, document starts) given to both. ``layer_specs`` is a pytree like
    ``params``: P('pipeline') where a leaf is split into stages, P() where every stage
    holds it whole."""
    M = x_MBTD.shape[0]  # noqa: N806

    def per_stage(params, x_MBTD, per_micro):
        P_ = jax.lax.axis_size(AXIS)  # noqa: N806
        index = jax.lax.axis_index(AXIS)
        to_next = [(p, p + 1) for p in range(P_ - 1)]  # the last stage sends nothing

        def tick(carry, t):
            held_BTD, loss, aux = carry
            m = jnp.clip(t - index, 0, M - 1)  # the micro-batch this stage works on
            micro = jax.tree.map(lambda a: a[m], per_micro)
            x_BTD = jnp.where(index == 0, x_MBTD[m], held_BTD)
            x_BTD, stage_aux = stage(params, x_BTD, micro)
            active = (t >= index) & (t - index < M)
            aux += jnp.where(active, stage_aux, 0.0)
            loss += jax.lax.cond(
                active & (index == P_ - 1),
                lambda: last(params, x_BTD, micro).astype(jnp.float32),
                lambda: jnp.zeros((), jnp.float32),
            )
            return (jax.lax.ppermute(x_BTD, AXIS, to_next), loss, aux), None

        zero = jnp.zeros((), jnp.float32)
        start = (jnp.zeros_like(x_MBTD[0]), zero, zero)
        (_, loss, aux), _ = jax.lax.scan(tick, start, jnp.arange(M + P_ - 1))
        return loss[None], aux[None]  # the last stage's loss; each stage's aux losses

    # check_vma=False: the stages' values differ (the loss is on the last one only), and
    # are summed outside, so that each gradient reaches the stage that made it once.
    on_stages = jax.shard_map(
        per_stage,
        in_specs=(layer_specs, P(), P()),
        out_specs=(P(AXIS), P(AXIS)),
        axis_names={AXIS},
        check_vma=False,
    )
    loss_P, aux_P = on_stages(params, x_MBTD, per_micro)
    return loss_P.sum() / M, aux_P.sum() / M
