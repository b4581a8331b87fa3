"""What the loss takes in, for the step and the pipeline alike: a batch's inputs and
next tokens (in ring attention's zigzag order, with each document's start), the weights
cast to the compute type on each device's shard, and a batch cut into micro-batches.
"""

import jax
import numpy as np
from attention import document_starts
from jax.sharding import PartitionSpec as P
from layout import zigzag


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
