"""The collectives the recipe's program would send on a GPU (predicted: no GPU has compiled them
for this book): weights gathered and gradients reduce-scattered in the compute type,
Megatron's sequence-parallel activations, ring attention's K and V, the experts' tokens; split
into those that overlap with the compute and those it waits for. A TPU is priced the
same way, but for the share of tensor parallelism's collectives its compiler overlaps.
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist_lessons.planning.footprint import F32
from jaxdist_lessons.planning.layouts import Layout, Run, micro_rows
from jaxdist_lessons.planning.shapes import attention_weights, mlp_weights
from jaxdist_lessons.planning.xla_cpu import (
    activation_transfers,
    collective,
    embedding_transfers,
    stage_parts,
    transfers,
    weight_transfers,
)
from jaxdist_lessons.strategies import NAMES
from jaxdist_lessons.traffic import Transfer
from jaxdist_lm.model_config import count_params

# Of the bytes a device sends over the tensor axis, the share the TPU compiler schedules
# a matrix product beside (between the collective's start and its done; the rest it
# waits for, as a GPU does): the LM recipe's step, 8b on fsdp=4,tensor=4 with MaxText's
# overlap flags, compiled by libtpu 0.0.42.1 for a v5e 4x4 and a v5p 2x2x4, no chip
# timed (benchmarks/tpu_overlap.py, book/data/tpu_overlap.json, which
# tests/test_tpu_overlap.py checks these against). The 125m model's are 0.18 and 0.26:
# the share moves with the model. A TPU compiled for no such step takes the lowest.
TPU_TENSOR_OVERLAP = {"TPU v5e": 0.37, "TPU v5p": 0.18}


def tensor_overlap(run: Run) -> float:
    """The share of tensor parallelism's activation collectives hidden behind compute:
    ``TPU_TENSOR_OVERLAP`` on a TPU (compiled; never timed), none on a GPU."""
    if not run.chip.name.startswith("TPU"):
        return 0.0
    return TPU_TENSOR_OVERLAP.get(run.chip.family, min(TPU_TENSOR_OVERLAP.values()))


def split_waited(
    run: Run, moves: list[Transfer]
) -> tuple[list[Transfer], list[Transfer]]:
    """Activation collectives as (overlapped, exposed): each over the tensor axis split
    by ``tensor_overlap``'s share of its bytes; the rest waited for."""
    share = tensor_overlap(run)
    hidden = [
        dataclasses.replace(m, bytes=share * m.bytes)
        for m in moves
        if share and "tensor" in m.axes
    ]
    waited = [
        dataclasses.replace(m, bytes=(1 - share) * m.bytes)
        if share and "tensor" in m.axes
        else m
        for m in moves
    ]
    return hidden, waited


def passes(run: Run) -> int:
    """How often a layer's forward collectives run in a step: the forward, the backward's
    transposes, and (remat 'dots' or 'full') the forward again for the backward."""
    return 2 if run.remat == "none" else 3


def gpu_weight_transfers(run: Run, c: Layout) -> list[Transfer]:
    """FSDP's moves as the recipe's program would make them on a GPU (predicted): the weights
    gathered in the compute type (``step.cast`` casts each shard before the gather), each
    layer's in the forward and again in the backward, the output projection's too, the
    embedding table's once for the lookup; each micro-batch's gradient reduce-scattered in
    the compute type (the gradient of a bfloat16 weight is bfloat16; XLA:CPU's float32 is
    its own normalisation); then one all-reduce over each other batch axis, in float32
    after an accumulation (the sums), in the compute type otherwise.

    Calls: the layers are scanned, so each layer's weights are gathered at once, in each
    pass, and its gradients reduced at once; the output projection and the table are one
    more each. A micro-batch repeats the gathers and the reduce-scatters."""
    m, f, t, e = run.shape, c.size("fsdp"), c.size("tensor"), c.size("expert")
    layers, D, V, G = m.num_layers, m.width, m.vocab_size, run.grad_accum
    size, params = run.itemsize, count_params(m)
    summed = F32 if G > 1 else size
    per_pass = (
        layers * (attention_weights(m) + mlp_weights(m) / e) / t + layers * 2 * D + D
    )
    per_pass += V * D / t  # the output projection (or the tied table as it)
    table = 0 if m.tie_embeddings else V * D / t  # the lookup's, forward only
    grads = layers + 1 + (1 if table else 0)  # reductions a step: a layer's at once
    # what a device holds before FSDP: tensor parallelism splits the blocks and vocabulary
    held = params if t == 1 else per_pass + table
    if c.strategy in (NAMES["data"], NAMES["zero1"]) or f == 1:
        return collective(
            "all-reduce", summed * held, c, "data", what="gradients", calls=grads
        )
    out = collective(
        "all-gather",
        G * size * (2 * per_pass + table),
        c,
        "fsdp",
        what="weights (FSDP)",
        calls=G * (2 * (layers + 1) + (1 if table else 0)),
    )
    out += collective(
        "reduce-scatter",
        G * size * (per_pass + table) / f,
        c,
        "fsdp",
        what="gradients (FSDP)",
        calls=G * grads,
    )
    out += collective(
        "all-reduce",
        summed * held / f,
        c,
        "data",
        what="gradients over data",
        calls=grads,
    )
    out += collective(
        "all-reduce",
        G * size * held / f,
        c,
        "sequence",
        what="gradients over sequence",
        calls=G * grads,
    )
    # not the experts' own
    shared = held - layers * (mlp_weights(m) - D * m.num_experts) / t
    out += collective(
        "all-reduce",
        G * size * shared / f,
        c,
        "expert",
        what="gradients of shared weights",
        calls=G * grads,
    )
    return out


def gpu_activation_transfers(run: Run, c: Layout) -> list[Transfer]:
    """What moves activations on a GPU (predicted), in the compute type, each micro-batch:
    Megatron's sequence parallelism (Korthikanti et al. 2022, section 4.2.2: an all-gather
    before attention and before the MLP, a reduce-scatter after each, in every pass; one
    of each for the embedding and the logits), ring attention's K and V, the experts'
    router logits (float32) and their tokens out and back (dropless: the pairs each
    device routes, with ``ragged_all_to_all``, not XLA:CPU's worst-case buffers)."""
    m, t, s, e = run.shape, c.size("tensor"), c.size("sequence"), c.size("expert")
    T, D, layers, G = run.seq_len, m.width, m.num_layers, run.grad_accum
    rows, size, k = micro_rows(run, c), run.itemsize, passes(run)
    out = []
    if t > 1:
        act = size * rows * T * D  # one micro-batch's, whole sequence
        count = G * (2 * k * layers + 2)
        out += collective(
            "all-gather", count * act, c, "tensor", what="activations (SP)", calls=count
        )
        out += collective(
            "reduce-scatter",
            count * act / t,
            c,
            "tensor",
            what="activations (SP)",
            calls=count,
        )
    if s > 1:
        kv = size * rows * (T // s) * m.num_kv_heads * m.head_width
        out += collective(
            "collective-permute",
            G * layers * k * (s - 1) * 2 * kv,
            c,
            "sequence",
            what="K and V around the ring",
            calls=G * layers * k * (s - 1) * 2,
        )
    if m.num_experts and e > 1:
        logits = F32 * 2 * layers * run.global_batch * T * m.num_experts
        out += collective(
            "all-gather",
            logits,
            c,
            "fsdp",
            "expert",
            what="router logits",
            calls=2 * layers,
        )
        if c.dispatch == "dropless":
            pairs = G * rows * T * m.top_k
            return out + collective(
                "all-to-all",
                layers * k * 2 * pairs * D * size,
                c,
                "expert",
                what="pairs to experts and back",
                calls=G * layers * k * 2,
            )
        group = min(m.group_size, T)
        slots = math.ceil(m.top_k * group * m.capacity_factor / m.num_experts)
        buffer = size * m.num_experts * rows * (T // group) * slots * D
        out += collective(
            "all-to-all",
            G * layers * k * 2 * buffer,
            c,
            "expert",
            what="tokens to experts and back",
            calls=G * layers * k * 2,
        )
    return out


def gpu_transfers(run: Run, c: Layout) -> tuple[list[Transfer], list[Transfer]]:
    """A step's collectives on a GPU (predicted), as (overlapped, exposed): the weights'
    gathers and the gradients' reductions overlap with compute (XLA:GPU's latency-hiding
    scheduler and its pipelined collectives, as FSDP2 prefetches), and so do ring
    attention's sends and a pipeline's; the activations' collectives of tensor
    parallelism and experts wait on the compute before and hold up the compute after,
    but for the share of tensor parallelism's that a TPU's compiler overlaps
    (``tensor_overlap``)."""
    if c.stages > 1:
        sends, per_stage, inside = stage_parts(run, c, run.itemsize)
        per_stage = dataclasses.replace(per_stage, grad_accum=1)
        # tensor parallelism inside a stage: each micro-batch (one sequence) in turn
        rows = run.global_batch // c.batch_ways
        each = dataclasses.replace(per_stage, grad_accum=rows)
        hidden, exposed = split_waited(run, gpu_activation_transfers(each, c))
        # each micro-batch's activations forward and gradient back, per virtual stage
        sends = dataclasses.replace(sends, calls=2 * c.virtual * rows)
        return [sends, *gpu_weight_transfers(per_stage, inside), *hidden], exposed
    # gradients' shards, then float32 weights gathered
    if c.strategy.startswith("ZeRO"):
        n, params = run.devices, count_params(run.shape)
        summed = F32 if run.grad_accum > 1 else run.itemsize
        calls = run.shape.num_layers + 1  # a layer's at once, and the rest
        return [
            Transfer(
                "reduce-scatter", summed * params / n, n, "gradients", ("data",), calls
            ),
            Transfer("all-gather", F32 * params, n, "weights", ("data",), calls),
        ], []
    activations = gpu_activation_transfers(run, c)
    ring = [move for move in activations if move.kind == "collective-permute"]
    waited = [move for move in activations if move.kind != "collective-permute"]
    hidden, exposed = split_waited(run, waited)
    return gpu_weight_transfers(run, c) + ring + hidden, exposed


def priced_transfers(run: Run, c: Layout) -> tuple[list[Transfer], list[Transfer]]:
    """The collectives the step time prices, (overlapped, exposed): a GPU's (predicted), or
    with ``run.bytes == "xla-cpu"`` the program XLA:CPU compiles, split the same way."""
    if run.bytes == "gpu":
        return gpu_transfers(run, c)
    if c.stages > 1 or c.strategy.startswith("ZeRO"):
        return transfers(run, c), []
    activations = activation_transfers(run, c)
    ring = [move for move in activations if move.kind == "collective-permute"]
    exposed = [move for move in activations if move.kind != "collective-permute"]
    return weight_transfers(run, c) + embedding_transfers(run, c) + ring, exposed
