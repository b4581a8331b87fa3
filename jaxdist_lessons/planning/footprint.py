"""Memory per device on a GPU (predicted): the float32 weights, Adam's moments and the
gradients as each layout splits them, the gathered weights under FSDP, the activations
(Korthikanti et al. 2022 for the recipe's ``--remat``), the input tokens; and the compiled
step's argument bytes and an estimate of XLA:CPU's temporaries, which ``check`` compares
with compiled programs.
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist_lessons.activations import layer_activation_bytes
from jaxdist_lessons.planning.layouts import Layout, Run, micro_rows
from jaxdist_lessons.planning.shapes import (
    attention_weights,
    mlp_weights,
    weight_shapes,
)
from jaxdist_lessons.strategies import NAMES
from jaxdist_lm.model_config import count_params

F32 = 4  # XLA:CPU's collectives and the recipe's weights and Adam moments: float32


USABLE = 0.9  # of a chip's memory a layout may fill (the rest: runtime, fragmentation)


def local_weights(run: Run, c: Layout) -> int:
    """Weights one device holds: each dimension split over its mesh axis, rounded up (XLA pads)."""
    total = sum(
        math.prod(math.ceil(d / (c.size(a) if a else 1)) for d, a in zip(dims, axes))
        for dims, axes in weight_shapes(run.shape)
    )
    if c.strategy.startswith("ZeRO"):
        return count_params(run.shape)
    return math.ceil(total / c.stages)


def token_bytes(run: Run, c: Layout) -> int:
    """The step's input: this device's rows of (global batch, seq_len + 1) int32 tokens."""
    return run.global_batch // c.batch_ways * (run.seq_len + 1) * 4


def argument_bytes(run: Run, c: Layout) -> int:
    """The compiled step's arguments: float32 weights and Adam's two moments, the tokens, and
    three int32 step counters (TrainState's, Adam's and the schedule's)."""
    weights = local_weights(run, c)
    optimizer = (
        math.ceil(2 * count_params(run.shape) / run.devices)
        if c.strategy.startswith("ZeRO")
        else 2 * weights
    )
    return F32 * (weights + optimizer) + token_bytes(run, c) + 3 * 4


def sequences_in_flight(run: Run, c: Layout) -> int:
    """Sequences whose activations a device holds at once: one micro-batch's rows; in a
    pipeline, every micro-batch (GPipe) or one per stage (1F1B, interleaved)."""
    rows = run.global_batch // c.batch_ways
    if c.stages == 1:
        return micro_rows(run, c)
    return rows if c.schedule == "GPipe" else min(rows, c.stages)


def kept_input_bytes(run: Run, c: Layout) -> float:
    """Each layer's input, which remat 'full' keeps for the backward, sequence-parallel
    under a tensor axis (the inputs of the micro-batches in flight, in a pipeline): what
    ``--offload activations`` sends to the host for each micro-batch."""
    m, t, s = run.shape, c.size("tensor"), c.size("sequence")
    tokens = run.seq_len // s
    per_layer = sequences_in_flight(run, c) * tokens / t * m.width * run.itemsize
    return per_layer * m.num_layers / c.stages


def host_bytes(run: Run, c: Layout) -> float:
    """What ``--offload optimizer,activations`` moves over the host link each step, one
    way and back: Adam's two float32 moments of the local weights, and the layers'
    inputs of every micro-batch."""
    if not c.offload:
        return 0.0
    return 2 * (
        2 * F32 * local_weights(run, c) + run.grad_accum * kept_input_bytes(run, c)
    )


def expert_copies(run: Run, c: Layout) -> float:
    """How many times an MoE layer's activations a dense one's are: top-k copies of each
    token, times a capacity's spare slots or dropless's worst-case buffers (the expert
    axis times the pairs)."""
    m = run.shape
    if not m.num_experts:
        return 1.0
    return m.top_k * (
        m.capacity_factor if c.dispatch == "capacity" else c.size("expert")
    )


def xla_cpu_activation_bytes(run: Run, c: Layout) -> float:
    """What XLA:CPU's program keeps besides the state, as estimated to set against its
    temporaries (remat 'full'): each layer's input, one layer's activations while it is
    recomputed (Korthikanti et al. 2022, eq. 2, with the T x T scores XLA's attention
    keeps on a CPU), and the float32 logits and their gradient."""
    m, t, s = run.shape, c.size("tensor"), c.size("sequence")
    micro, tokens = micro_rows(run, c), run.seq_len // s
    kept = 0 if c.offload else kept_input_bytes(run, c)
    layer = layer_activation_bytes(tokens, micro, m.width, m.num_heads, t)
    layer *= run.itemsize / 2 * expert_copies(run, c)
    logits = micro * tokens * m.vocab_size / t * (4 + 4)
    return kept + layer + logits


def saved_dots_bytes(run: Run, c: Layout) -> float:
    """What remat 'dots' keeps of one layer (``dots_with_no_batch_dims_saveable``): the
    outputs of its weight matmuls, Q, K, V, the attention's output projection, the
    MLP's gate, up and down, in the compute type, split over the tensor axis."""
    m, t, s = run.shape, c.size("tensor"), c.size("sequence")
    width = (m.num_heads + 2 * m.num_kv_heads) * m.head_width + 2 * m.width
    width += 2 * m.mlp_width
    tokens = sequences_in_flight(run, c) * run.seq_len // s
    return tokens * width / t * run.itemsize * expert_copies(run, c)


def activation_bytes(run: Run, c: Layout) -> float:
    """What the step keeps besides its state on a GPU (an estimate). One layer's
    activations follow Korthikanti et al. 2022 (arXiv:2205.05198): eq. 2, s b h (10 +
    24/t), or with sequence parallelism (the recipe's residual under a tensor axis, their
    section 4.2.2) 34/t; with cuDNN's fused attention, no T x T scores. Remat 'full'
    keeps each layer's input and one layer's activations while it is recomputed; 'dots'
    each layer's matmul outputs (``saved_dots_bytes``) too; 'none' every layer's. The
    logits and their gradient in the compute type, one micro-batch's."""
    m, t, s = run.shape, c.size("tensor"), c.size("sequence")
    tokens, layers = run.seq_len // s, m.num_layers // c.stages
    layer = layer_activation_bytes(
        tokens,
        sequences_in_flight(run, c),
        m.width,
        m.num_heads,
        t,
        flash_attention=True,
        sequence_parallel=t > 1,
    )
    layer *= run.itemsize / 2 * expert_copies(run, c)
    if run.remat == "none":
        kept = layers * layer
    else:
        kept = (0 if c.offload else kept_input_bytes(run, c)) + layer
        kept += layers * saved_dots_bytes(run, c) if run.remat == "dots" else 0
    logits = micro_rows(run, c) * tokens * m.vocab_size / t * 2 * run.itemsize
    return kept + logits


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device: float32 weights (and, under FSDP, two layers gathered), Adam's two
    moments, the gradients, the activations (an estimate), the input tokens."""

    weights: float
    optimizer: float
    gradients: float
    activations: float
    tokens: float

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.optimizer
            + self.gradients
            + self.activations
            + self.tokens
        )


def gathered_weights(run: Run, c: Layout) -> float:
    """Under FSDP, two layers and the output projection gathered, in the compute type."""
    m = run.shape
    layer = attention_weights(m) + mlp_weights(m) / c.size("expert")
    return (2 * layer + m.vocab_size * m.width) / c.size("tensor") * run.itemsize


def memory(run: Run, c: Layout) -> Memory:
    """Memory per device for a layout, on a GPU. Under FSDP the weights add two layers and
    the output projection gathered (in the compute dtype), and the gradients the output
    projection's whole gradient (in the compute type), before it is reduced."""
    m, f, t = run.shape, c.size("fsdp"), c.size("tensor")
    local = local_weights(run, c)
    zero = c.strategy.startswith("ZeRO")
    optimizer = 2 * F32 * (count_params(m) / run.devices if zero else local)
    optimizer *= not c.offload  # in host memory
    weights, gradients = F32 * local, F32 * local
    if f > 1:
        weights += gathered_weights(run, c)
        gradients += run.itemsize * m.vocab_size * m.width / t
    if run.grad_accum > 1:  # one micro-batch's gradient beside the float32 sum
        gradients += run.itemsize * local
    # its share, and one layer's whole while it is reduced
    if c.strategy == NAMES["zero2"]:
        layer = attention_weights(m) + mlp_weights(m)
        gradients = F32 * count_params(m) / run.devices + run.itemsize * layer
    activations = activation_bytes(run, c)
    return Memory(weights, optimizer, gradients, activations, token_bytes(run, c))


def temporaries_estimate(run: Run, c: Layout) -> float:
    """What the estimate says XLA:CPU's temporaries hold: the activations with the T x T
    scores its attention keeps, the float32 gradients and, under FSDP, the gathered
    weights (beyond the arguments)."""
    m, f, t = run.shape, c.size("fsdp"), c.size("tensor")
    gradients = F32 * local_weights(run, c)
    gathered = 0.0
    if f > 1:
        gathered = gathered_weights(run, c)
        gradients += F32 * m.vocab_size * m.width / t
    return xla_cpu_activation_bytes(run, c) + gradients + gathered
