"""What the step's and the pipeline's loss take in: inputs and next tokens (zigzagged
for ring attention), the weights cast on each device's shard, micro-batches."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from .attention import document_starts
from .layout import zigzag


def micro_batches(tokens_BT: jax.Array, grad_accum: int, batch_axes) -> jax.Array:
    """(B, T) -> (K, B / K, T), K = grad_accum; micro-batch k: rows k, k + K, ..."""
    # Every K-th row, not K blocks of rows: each device holds a contiguous block of
    # rows, so every micro-batch takes rows from every device and no row moves.
    B, *rest = tokens_BT.shape
    micro_KBT = tokens_BT.reshape(B // grad_accum, grad_accum, *rest).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(micro_KBT, P(None, batch_axes))


def make_inputs(mesh, eod_id: int | None = None):
    """tokens_BT -> (inputs_BT, targets_BT, positions_T, starts_BT), in ring attention's
    zigzag order on a 'sequence' axis; starts_BT None without ``eod_id``."""
    sequence = mesh.shape["sequence"]

    def inputs(tokens_BT):
        inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
        positions_T = np.arange(inputs_BT.shape[1])
        starts_BT = None
        # Found in text order, then moved with the tokens.
        if eod_id is not None:
            starts_BT = document_starts(inputs_BT, eod_id)
        # Zigzag: each device of the ring gets early and late tokens.
        if sequence > 1:
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
    specs = jax.tree.map(lambda s: s.spec, shardings.params)
    return jax.tree.map(
        lambda p, spec: jax.lax.with_sharding_constraint(p.astype(dtype), spec),
        params,
        specs,
    )
