"""Plan a run before renting the cluster: which layouts fit, what they send, how fast (predicted).

    python -m jaxdist_lessons.plan --model 8b --devices 16 --nodes 2 --chip h100 \\
        --seq-len 8192 --global-batch 256 [--json] [--check]

One row per candidate layout of the LM recipe (``examples/lm/train.py``): DP, ZeRO-1, FSDP,
HSDP, FSDP with tensor parallelism inside a node, ring attention over a ``sequence`` axis,
experts over an ``expert`` axis (with a capacity, or dropless), pipeline schedules, and FSDP
with Adam's moments and the saved activations in host memory (priced over the chip's PCIe
link). Each row gives the memory per device,
the bytes each device sends per step inside a node and across nodes, a predicted step time and
MFU, and the recipe's flags. ``--check`` compiles the best rows with the recipe's
``--compile-only`` on simulated CPU devices and prints predicted and compiled numbers side by side.

The bytes sent and the step time are a GPU's, predicted: weights gathered and gradients
reduce-scattered in the compute type, Megatron's sequence-parallel activations, the matmuls at
``COMPUTE_EFFICIENCY`` of the datasheet peak (one constant fitted to published GPU runs,
``benchmarks/plan_published.py``), FSDP's collectives hidden behind the compute and tensor
parallelism's waited for. ``--bytes xla-cpu`` prices instead the collectives of the program
XLA:CPU compiles from the recipe (JAX 0.10.2): every one moves float32, even under
``--dtype bfloat16``, and their counts per layer were read from compiled programs
(``benchmarks/plan_check.py`` checks them on 35 layouts); those are what ``--check`` compares.
Written here rather than taken from a library: no planner we know of reads JAX meshes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

# Standard library only below (no JAX, no NumPy): the "Plan your run" page runs this module
# in the browser, in Pyodide (tests/test_plan.py imports it with JAX made unimportable).
from jaxdist_lessons import hardware
from jaxdist_lessons.activations import layer_activation_bytes
from jaxdist_lessons.bubble import bubble_fraction
from jaxdist_lessons.tables import Table
from jaxdist_lessons.traffic import Transfer, sent_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "lm" / "train.py"
AXES = (
    "data",
    "fsdp",
    "expert",
    "sequence",
    "tensor",
)  # layout.AXES (examples/lm/layout.py), in its order
F32 = 4  # XLA:CPU's collectives and the recipe's weights and Adam moments: float32
USABLE = 0.9  # of a chip's memory a layout may fill (the rest: runtime, fragmentation)
MAX_DEVICES = 65_536  # the page runs the planner in a browser tab: keep it to seconds

# --- Models --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LMShape:
    """A Llama-style decoder's shape, with the field names of the recipe's ``ModelConfig``."""

    vocab_size: int
    num_layers: int
    width: int  # D
    num_heads: int  # N
    num_kv_heads: int  # K
    mlp_width: int  # F
    tie_embeddings: bool = False
    num_experts: int = 0  # E; 0: a dense MLP
    top_k: int = 1
    capacity_factor: float = 1.25
    group_size: int = 512

    @property
    def head_width(self) -> int:  # A
        return self.width // self.num_heads


# examples/lm/model.py's PRESETS (tests/test_plan.py checks that they are equal).
PRESETS = {
    "tiny": LMShape(2048, 4, 128, 4, 2, 384),
    "125m": LMShape(32_768, 12, 768, 12, 4, 2048),
    "1b": LMShape(128_256, 16, 2048, 32, 8, 8192, tie_embeddings=True),
    "8b": LMShape(128_256, 32, 4096, 32, 8, 14_336),
    "70b": LMShape(128_256, 80, 8192, 64, 8, 28_672),
}

CHIP_NAMES = {
    "a100": "A100 80GB",
    "a100-40gb": "A100 40GB",
    "h100": "H100 80GB",
    "h200": "H200 141GB",
    "v5p": "TPU v5p",
}


def attention_weights(m: LMShape) -> int:
    """One layer's Q, K, V and output projections."""
    return m.width * m.head_width * (2 * m.num_heads + 2 * m.num_kv_heads)


def mlp_weights(m: LMShape) -> int:
    """One layer's MLP: gate, up and down, for each expert; and the router."""
    return max(m.num_experts, 1) * 3 * m.width * m.mlp_width + m.width * m.num_experts


def param_count(m: LMShape) -> int:
    """Parameters (``model.count_params``)."""
    layers = m.num_layers * (attention_weights(m) + mlp_weights(m) + 2 * m.width)
    return layers + m.vocab_size * m.width * (1 if m.tie_embeddings else 2) + m.width


def model_flops_per_token(m: LMShape, seq_len: int) -> int:
    """Training flops per token (``model.flops_per_token``): 6 per matmul weight a token uses,
    plus attention's 12 L T N A."""
    used = param_count(m) - m.vocab_size * m.width * (0 if m.tie_embeddings else 1)
    used -= m.width * (2 * m.num_layers + 1)
    if m.num_experts:
        used -= m.num_layers * (m.num_experts - m.top_k) * 3 * m.width * m.mlp_width
    return 6 * used + 12 * m.num_layers * seq_len * m.num_heads * m.head_width


# Each weight of the recipe: its shape and the mesh axis splitting each dimension (layout.RULES).
def weight_shapes(m: LMShape) -> list[tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """(shape, mesh axes) of every weight; the layers' weights are stacked on a leading L."""
    D, N, K, A, F, E, V, L = (m.width, m.num_heads, m.num_kv_heads, m.head_width,  # noqa: N806
                              m.mlp_width, m.num_experts, m.vocab_size, m.num_layers)  # fmt: skip
    out = [((L, D), (None, "fsdp"))] * 2  # the two norms
    out += [((L, D, N, A), (None, "fsdp", "tensor", None))]
    out += [((L, D, K, A), (None, "fsdp", "tensor", None))] * 2
    out += [((L, N, A, D), (None, "tensor", None, "fsdp"))]
    if E:
        out += [((L, D, E), (None, "fsdp", None))]
        out += [((L, E, D, F), (None, "expert", "fsdp", "tensor"))] * 2
        out += [((L, E, F, D), (None, "expert", "tensor", "fsdp"))]
    else:
        out += [((L, D, F), (None, "fsdp", "tensor"))] * 2 + [
            ((L, F, D), (None, "tensor", "fsdp"))
        ]
    out += [((V, D), ("tensor", "fsdp")), ((D,), ("fsdp",))]  # embedding, final norm
    if not m.tie_embeddings:
        out += [((D, V), ("fsdp", "tensor"))]
    return out


# --- Layouts -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout: devices per mesh axis (``layout.AXES``), or a pipeline of ``stages`` (FSDP
    inside each stage), or ZeRO-1 over all devices; only the recipe's own meshes run."""

    strategy: str
    mesh: tuple[int, int, int, int, int]  # data, fsdp, expert, sequence, tensor
    stages: int = 1
    schedule: str = ""  # GPipe, 1F1B, interleaved
    virtual: int = 1
    offload: bool = False  # Adam's moments and the layers' inputs in host memory
    dispatch: str = "capacity"  # the experts': or "dropless"

    def size(self, axis: str) -> int:
        """Devices along one of ``AXES``."""
        return self.mesh[AXES.index(axis)]

    @property
    def batch_ways(self) -> int:
        """Mesh axes that split the batch rows: data, fsdp, expert (layout.BATCH)."""
        return self.size("data") * self.size("fsdp") * self.size("expert")

    @property
    def mesh_flag(self) -> str:
        """``data=2,fsdp=8``: the axes above 1 (``data=1`` for one device)."""
        return (
            ",".join(f"{a}={n}" for a, n in zip(AXES, self.mesh) if n > 1) or "data=1"
        )


@dataclasses.dataclass(frozen=True)
class Run:
    """What the reader asks for: a model, a batch and the machines."""

    model: str
    shape: LMShape
    devices: int
    nodes: int
    chip: hardware.Chip
    seq_len: int
    global_batch: int
    dtype: str = "bfloat16"
    remat: str = "full"  # train.py's --remat: none, dots or full
    grad_accum: int = 1  # train.py's --grad-accum: micro-batches a step
    fit_accum: bool = False  # --grad-accum auto: each layout's fewest that fit (plan)
    bytes: str = (
        "gpu"  # the collectives priced: "gpu" (predicted) or "xla-cpu" (compiled)
    )
    efficiency: float | None = None  # of the chip's peak; None: COMPUTE_EFFICIENCY

    @property
    def per_node(self) -> int:
        return self.devices // self.nodes

    @property
    def itemsize(self) -> int:
        """Bytes of one value in the compute type (activations, gathered weights)."""
        return 2 if self.dtype == "bfloat16" else 4


def checked(run: Run, c: Candidate) -> bool:
    """Whether ``--check`` compares this row with the compiled recipe: the XLA:CPU counts
    were read under full remat, one micro-batch a step. Not yet for pipelines (their
    predicted bytes and memory are not the compiled program's), nor ZeRO-1 (XLA:CPU
    all-reduces the gradient where the prediction has a reduce-scatter), nor offloading
    (XLA:CPU's program keeps everything in device memory)."""
    plain = run.remat == "full" and run.grad_accum == 1
    return (
        plain and c.stages == 1 and not c.strategy.startswith("ZeRO") and not c.offload
    )


def micro_rows(run: Run, c: Candidate) -> int:
    """Sequences one device runs at once: its rows over --grad-accum, or one in a
    pipeline (a micro-batch of one sequence a device)."""
    rows = run.global_batch // c.batch_ways
    return 1 if c.stages > 1 else rows // run.grad_accum


def mesh_sizes(flag: str) -> tuple[int, int, int, int, int]:
    """``'fsdp=4,tensor=2'`` -> devices per axis of ``AXES``."""
    sizes = dict.fromkeys(AXES, 1)
    for item in flag.split(","):
        axis, _, size = item.partition("=")
        if axis not in sizes or not size.isdigit() or int(size) < 1:
            raise PlanError(
                f"mesh {flag!r}: expected axis=size with axes {', '.join(AXES)}"
            )
        sizes[axis] = int(size)
    return tuple(sizes.values())


def candidates(run: Run) -> list[Candidate]:
    """Every layout family at the sizes the devices allow; ``problems`` filters what cannot run."""
    n, p, m = run.devices, run.per_node, run.shape
    mesh = lambda **sizes: tuple(sizes.get(a, 1) for a in AXES)
    out = [Candidate("DP", mesh(data=n))]
    out += [Candidate(z, mesh(data=n)) for z in ("ZeRO-1", "ZeRO-2")]
    out.append(Candidate("FSDP", mesh(fsdp=n)))
    # HSDP: FSDP inside groups of k devices (powers of two, a node's among them), replicas
    # across them
    inner = {2**i for i in range(1, n.bit_length()) if n % 2**i == 0 and 2**i < n}
    inner |= {p} if 1 < p < n else set()
    out += [Candidate("HSDP", mesh(data=n // k, fsdp=k)) for k in sorted(inner)]
    # Inside a node, not all devices, powers of two: on an odd ring XLA:CPU moves the embedding
    # table instead of the activations, which the counts below do not follow.
    inside = [k for k in (2, 4, 8) if p % k == 0 and k < n]
    out += [Candidate("FSDP+TP", mesh(fsdp=n // t, tensor=t)) for t in inside]
    out += [Candidate("sequence", mesh(fsdp=n // s, sequence=s)) for s in inside]
    if m.num_experts:
        for dispatch, name in (
            ("capacity", "experts"),
            ("dropless", "experts dropless"),
        ):
            out += [Candidate(name, mesh(fsdp=n // e, expert=e), dispatch=dispatch)
                    for e in inside]  # fmt: skip
    if run.chip.host_bytes_per_s and n > 1:
        out.append(Candidate("FSDP + offload", mesh(fsdp=n), offload=True))
    stages = run.nodes if run.nodes > 1 else 2
    if n % stages == 0 and n > 1:
        for schedule, virtual in (("GPipe", 1), ("1F1B", 1), ("interleaved", 2)):
            out.append(Candidate(f"pipeline {schedule}", mesh(fsdp=n // stages), stages,
                                 schedule, virtual))  # fmt: skip
        stage = (
            n // stages
        )  # tensor parallelism inside each stage's node, FSDP beside it
        out += [Candidate("pipeline 1F1B + TP", mesh(fsdp=stage // t, tensor=t), stages,
                          "1F1B") for t in inside if stage % t == 0 and t <= p]  # fmt: skip
    return out


NEEDS = {"ZeRO-2": "needs: ZeRO-2 in the recipe (it has --zero1, and FSDP, which shards "
                   "the gradients too)"}  # fmt: skip


def runnable(c: Candidate) -> bool:
    """Whether ``examples/lm/train.py`` runs this layout (``NEEDS`` says what the others
    need)."""
    return c.strategy not in NEEDS


def problems(run: Run, c: Candidate) -> list[str]:
    """Why the recipe (or the pipeline's stages) cannot split this model this way (layout.check_fits)."""
    m, t, s = run.shape, c.size("tensor"), c.size("sequence")
    out = [f"{name} {getattr(m, name)} does not split over tensor={t}"
           for name in ("num_heads", "num_kv_heads", "mlp_width", "vocab_size")
           if getattr(m, name) % t]  # fmt: skip
    for name, axis in (("width", "fsdp"), ("num_experts", "expert")):
        if getattr(m, name) % c.size(axis):  # JAX shards evenly or not at all
            out.append(
                f"{name} {getattr(m, name)} does not split over {axis}={c.size(axis)}"
            )
    if run.global_batch % c.batch_ways:
        out.append(
            f"global batch {run.global_batch} does not split over {c.batch_ways}"
        )
    if s > 1 and run.seq_len % (2 * s * t):
        out.append(f"seq-len {run.seq_len} does not split into 2 x sequence={s} chunks")
    if t > 1 and run.seq_len % t:
        out.append(f"seq-len {run.seq_len} does not split over tensor={t}")
    group = min(m.group_size, run.seq_len)
    if m.num_experts and (run.seq_len % group or (run.seq_len // group) % s):
        out.append(f"seq-len {run.seq_len} does not make groups of {group} tokens")
    if c.stages > 1 and m.num_layers % (c.stages * c.virtual):
        out.append(
            f"{m.num_layers} layers do not split into {c.stages * c.virtual} stages"
        )
    micro = run.global_batch // c.batch_ways  # one sequence per device per microbatch
    if c.stages > 1 and micro < c.stages:
        out.append(f"fewer sequences per replica than the {c.stages} stages")
    if c.schedule == "interleaved" and micro % c.stages:
        out.append(f"{micro} microbatches do not make groups of the {c.stages} stages")
    if c.stages == 1 and micro % run.grad_accum:
        out.append(f"{micro} sequences a device do not split into --grad-accum "
                   f"{run.grad_accum} micro-batches")  # fmt: skip
    if c.offload and run.remat != "full":
        out.append("offloading activations is full remat (--remat full)")
    return out


# --- Memory --------------------------------------------------------------------------------------


def local_weights(run: Run, c: Candidate) -> int:
    """Weights one device holds: each dimension split over its mesh axis, rounded up (XLA pads)."""
    total = sum(
        math.prod(math.ceil(d / (c.size(a) if a else 1)) for d, a in zip(dims, axes))
        for dims, axes in weight_shapes(run.shape)
    )
    if c.strategy.startswith("ZeRO"):
        return param_count(run.shape)
    return math.ceil(total / c.stages)


def token_bytes(run: Run, c: Candidate) -> int:
    """The step's input: this device's rows of (global batch, seq_len + 1) int32 tokens."""
    return run.global_batch // c.batch_ways * (run.seq_len + 1) * 4


def argument_bytes(run: Run, c: Candidate) -> int:
    """The compiled step's arguments: float32 weights and Adam's two moments, the tokens, and
    three int32 step counters (TrainState's, Adam's and the schedule's)."""
    weights = local_weights(run, c)
    optimizer = (
        math.ceil(2 * param_count(run.shape) / run.devices)
        if c.strategy.startswith("ZeRO")
        else 2 * weights
    )
    return F32 * (weights + optimizer) + token_bytes(run, c) + 3 * 4


def in_flight(run: Run, c: Candidate) -> int:
    """Sequences whose activations a device holds at once: one micro-batch's rows; in a
    pipeline, every micro-batch (GPipe) or one per stage (1F1B, interleaved)."""
    rows = run.global_batch // c.batch_ways
    if c.stages == 1:
        return micro_rows(run, c)
    return rows if c.schedule == "GPipe" else min(rows, c.stages)


def kept_input_bytes(run: Run, c: Candidate) -> float:
    """Each layer's input, which remat 'full' keeps for the backward, sequence-parallel
    under a tensor axis (the inputs of the micro-batches in flight, in a pipeline): what
    ``--offload activations`` sends to the host for each micro-batch."""
    m, t, s = run.shape, c.size("tensor"), c.size("sequence")
    tokens = run.seq_len // s
    per_layer = in_flight(run, c) * tokens / t * m.width * run.itemsize
    return per_layer * m.num_layers / c.stages


def host_bytes(run: Run, c: Candidate) -> float:
    """What ``--offload optimizer,activations`` moves over the host link each step, one
    way and back: Adam's two float32 moments of the local weights, and the layers'
    inputs of every micro-batch."""
    if not c.offload:
        return 0.0
    return 2 * (
        2 * F32 * local_weights(run, c) + run.grad_accum * kept_input_bytes(run, c)
    )


def expert_copies(run: Run, c: Candidate) -> float:
    """How many times an MoE layer's activations a dense one's are: top-k copies of each
    token, times a capacity's spare slots or dropless's worst-case buffers (the expert
    axis times the pairs)."""
    m = run.shape
    if not m.num_experts:
        return 1.0
    return m.top_k * (
        m.capacity_factor if c.dispatch == "capacity" else c.size("expert")
    )


def xla_cpu_activation_bytes(run: Run, c: Candidate) -> float:
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


def saved_dots_bytes(run: Run, c: Candidate) -> float:
    """What remat 'dots' keeps of one layer (``dots_with_no_batch_dims_saveable``): the
    outputs of its weight matmuls, Q, K, V, the attention's output projection, the
    MLP's gate, up and down, in the compute type, split over the tensor axis."""
    m, t, s = run.shape, c.size("tensor"), c.size("sequence")
    width = (m.num_heads + 2 * m.num_kv_heads) * m.head_width + 2 * m.width
    width += 2 * m.mlp_width
    tokens = in_flight(run, c) * run.seq_len // s
    return tokens * width / t * run.itemsize * expert_copies(run, c)


def activation_bytes(run: Run, c: Candidate) -> float:
    """What the step keeps besides its state on a GPU (an estimate). One layer's
    activations follow Korthikanti et al. 2022 (arXiv:2205.05198): eq. 2, s b h (10 +
    24/t), or with sequence parallelism (the recipe's residual under a tensor axis, their
    section 4.2.2) 34/t; with cuDNN's fused attention, no T x T scores. Remat 'full'
    keeps each layer's input and one layer's activations while it is recomputed; 'dots'
    each layer's matmul outputs (``saved_dots_bytes``) too; 'none' every layer's. The
    logits and their gradient in the compute type, one micro-batch's."""
    m, t, s = run.shape, c.size("tensor"), c.size("sequence")
    tokens, layers = run.seq_len // s, m.num_layers // c.stages
    layer = layer_activation_bytes(tokens, in_flight(run, c), m.width, m.num_heads, t,
                                   flash_attention=True, sequence_parallel=t > 1)  # fmt: skip
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


def gathered_weights(run: Run, c: Candidate) -> float:
    """Under FSDP, two layers and the output projection gathered, in the compute type."""
    m = run.shape
    layer = attention_weights(m) + mlp_weights(m) / c.size("expert")
    return (2 * layer + m.vocab_size * m.width) / c.size("tensor") * run.itemsize


def memory(run: Run, c: Candidate) -> Memory:
    """Memory per device for a layout, on a GPU. Under FSDP the weights add two layers and
    the output projection gathered (in the compute dtype), and the gradients the output
    projection's whole gradient (in the compute type), before it is reduced."""
    m, f, t = run.shape, c.size("fsdp"), c.size("tensor")
    local = local_weights(run, c)
    zero = c.strategy.startswith("ZeRO")
    optimizer = 2 * F32 * (param_count(m) / run.devices if zero else local)
    optimizer *= not c.offload  # in host memory
    weights, gradients = F32 * local, F32 * local
    if f > 1:
        weights += gathered_weights(run, c)
        gradients += run.itemsize * m.vocab_size * m.width / t
    if run.grad_accum > 1:  # one micro-batch's gradient beside the float32 sum
        gradients += run.itemsize * local
    if c.strategy == "ZeRO-2":  # its share, and one layer's whole while it is reduced
        layer = attention_weights(m) + mlp_weights(m)
        gradients = F32 * param_count(m) / run.devices + run.itemsize * layer
    activations = activation_bytes(run, c)
    return Memory(weights, optimizer, gradients, activations, token_bytes(run, c))


# --- Collectives (XLA:CPU's program) ------------------------------------------------------------


def _t(
    kind: str, nbytes: float, c: Candidate, *axes: str, what: str = ""
) -> list[Transfer]:
    """One collective over ``axes`` (an empty list if those axes have one device)."""
    group = math.prod(c.size(a) for a in axes)
    return [Transfer(kind, nbytes, group, what, axes)] if group > 1 and nbytes else []


def weight_transfers(run: Run, c: Candidate) -> list[Transfer]:
    """FSDP's weight gathers and the gradients' all-reduces, as XLA:CPU compiles the recipe.

    Measured: each layer weight gathered twice (forward, and remat's recomputation for the
    backward), the attention's output projection a third time under tensor parallelism, the
    norms three times; the output projection once, twice under tensor parallelism (a tied
    table too, as the output projection); the embedding table never for its lookup (which
    moves activations instead). Gradients: one all-reduce over fsdp
    of all but the embedding's (no reduce-scatter on XLA:CPU), then one over each other batch
    axis (data, sequence, expert) of the fsdp-split gradients; data parallelism alone: all of
    them and the loss.
    """
    m, f, t, e = run.shape, c.size("fsdp"), c.size("tensor"), c.size("expert")
    L, D, V = m.num_layers, m.width, m.vocab_size  # noqa: N806
    layer = attention_weights(m) + mlp_weights(m) / e
    out_projection = L * m.num_heads * m.head_width * D
    norms = L * 2 * D
    unembed = (
        V * D
    )  # untied, or the tied table as the output projection: the same moves
    P = param_count(m)  # noqa: N806
    out = []
    if c.strategy in ("DP", "ZeRO-1") or f == 1:
        return _t("all-reduce", F32 * P + 4, c, "data", what="gradients")
    gathered = (
        2 * L * layer / t + (out_projection / t if t > 1 else 0) + 3 * norms + 2 * D
    )
    gathered += unembed * (2 if t > 1 else 1) / t
    out += _t("all-gather", F32 * gathered, c, "fsdp", what="weights (FSDP)")
    reduced = L * layer / t + norms + unembed / t
    if m.num_experts and c.dispatch == "dropless":  # dropless.gathered's float32 sums
        experts = L * 3 * m.num_experts * D * m.mlp_width / (e * t)
        reduced -= experts
        out += _t("reduce-scatter", F32 * experts / f, c, "fsdp",
                  what="experts' gradients (FSDP)")  # fmt: skip
    out += _t("all-reduce", F32 * reduced, c, "fsdp", what="gradients (FSDP)")
    rest = P - V * D  # the embedding table's gradient: embedding_transfers
    for axis in ("data", "sequence"):
        out += _t("all-reduce", F32 * rest / f, c, axis, what=f"gradients over {axis}")
    shared = rest - L * (mlp_weights(m) - D * m.num_experts)  # not the experts' own
    out += _t(
        "all-reduce", F32 * shared / f, c, "expert", what="gradients of shared weights"
    )
    return out


def lookup_moves(run: Run, c: Candidate) -> list[Transfer]:
    """The embedding lookup with the table left split: the tokens' activations move to the
    table's fsdp shards and back, and its gradient is reduced over the other batch axes. With
    batch replicas (data or expert), the recipe's "rows" lookup (examples/lm/layout.py's
    ``lookup``): its output laid out as the table first, an all-to-all each way."""
    m, f, s, e, d, t = (run.shape, c.size("fsdp"), c.size("sequence"), c.size("expert"),
                        c.size("data"), c.size("tensor"))  # fmt: skip
    B, T, D = run.global_batch, run.seq_len, m.width  # noqa: N806
    rows, table, everything = B // c.batch_ways, F32 * m.vocab_size * D, F32 * B * T * D
    out = [t_ for axis in ("data", "sequence", "expert")
           for t_ in _t("all-reduce", table / f, c, axis, what="embedding gradient")]  # fmt: skip
    if d > 1:  # HSDP: to the table's layout and back, forward and backward
        return out + _t(
            "all-to-all", 2 * everything / (d * f), c, "fsdp", what="embeddings"
        )
    if e > 1:
        out += _t("all-to-all", 2 * everything / (f * e), c, "fsdp", what="embeddings")
        return out + _t(
            "collective-permute", 2 * F32 * rows * T * D, c, "expert", what="embeddings"
        )
    out += _t("all-to-all", everything / f, c, "fsdp", what="embeddings")
    out += _t("all-to-all", everything / (f * s * t), c, "fsdp", what="embeddings")
    out += _t("all-to-all", everything / (f * t), c, "tensor", what="embeddings")
    if s == 2 and f > 2:  # measured; with f = 2, the swaps below instead
        out += _t(
            "all-to-all", everything / (f * s), c, "sequence", what="zigzag order"
        )
    if s == 2 and f == 2:  # measured: the zigzag order by swaps between the two
        swap = F32 * (rows * T // s * D + B * T * D // f)
        out += _t("collective-permute", swap, c, "sequence", what="zigzag order")
    return out + _t("all-gather", everything / f + F32 * rows * T * D, c, "sequence",
                    what="embeddings")  # fmt: skip


def table_moves(run: Run, c: Candidate) -> list[Transfer]:
    """The embedding lookup in a gathered table: the table gathered over fsdp and its gradient
    all-reduced whole (with batch replicas, the recipe's "table" lookup)."""
    m, f, d = run.shape, c.size("fsdp"), c.size("data")
    table = F32 * m.vocab_size * m.width
    out = _t("all-gather", table, c, "fsdp", what="embedding table")
    if d > 1:
        return out + _t(
            "all-reduce", table, c, "data", "fsdp", what="embedding gradient"
        )
    if c.size("expert") > 1:
        return out + _t(
            "all-reduce", table, c, "fsdp", "expert", what="embedding gradient"
        )
    out += _t("all-reduce", table, c, "fsdp", what="embedding gradient")
    return out + _t(
        "all-reduce", 2 * table / f, c, "sequence", what="embedding gradient"
    )


def gathers_the_table(run: Run, c: Candidate) -> bool:
    """Whether the embedding table is gathered for the lookup (``table_moves``) rather than
    activations moved (``lookup_moves``). With batch replicas the recipe chooses
    (examples/lm/layout.py's ``lookup``): with a data axis, the table when each device has at
    least as many tokens as the table has rows; with an expert axis, when an fsdp group's
    share of a step's tokens is. Elsewhere XLA:CPU chooses, as read from compiled programs on
    both sides of each boundary (tiny, 125m, 8b): with fsdp and sequence axes, the table when
    it moves fewer bytes; with a tensor axis, never seen."""
    tokens, vocab = run.global_batch * run.seq_len, run.shape.vocab_size
    if c.size("tensor") > 1:
        return False
    if c.size("data") > 1:
        return tokens / c.batch_ways >= vocab
    if c.size("expert") > 1:
        return tokens / c.size("fsdp") >= vocab
    cost = lambda moves: sum(move.bytes for move in moves)
    return cost(table_moves(run, c)) < cost(lookup_moves(run, c))


def embedding_transfers(run: Run, c: Candidate) -> list[Transfer]:
    """The embedding lookup and its gradient under FSDP (the table split over fsdp, not over
    the batch), in whichever of its two ways XLA:CPU compiles it (``gathers_the_table``)."""
    if c.size("fsdp") == 1:  # data parallelism: the table is whole on every device
        return []
    return table_moves(run, c) if gathers_the_table(run, c) else lookup_moves(run, c)


def activation_transfers(run: Run, c: Candidate) -> list[Transfer]:
    """What moves activations inside the layers: Megatron's sequence-parallel activations,
    ring attention's K and V, the experts' router logits, dispatch and combine. Counts per
    layer read from XLA:CPU's programs."""
    m, t, s, e = run.shape, c.size("tensor"), c.size("sequence"), c.size("expert")
    B, T, D, L = run.global_batch, run.seq_len, m.width, m.num_layers  # noqa: N806
    rows = B // c.batch_ways
    out = []
    if (
        t > 1
    ):  # XLA:CPU all-reduces where Megatron's sequence parallelism reduce-scatters
        act = F32 * rows * T * D
        out += _t("all-gather", act * (6 * L + 2), c, "tensor", what="activations (SP)")
        out += _t("all-reduce", act * (8 * L + 1), c, "tensor", what="activations (SP)")
    if s > 1:
        kv = F32 * rows * (T // s) * m.num_kv_heads * m.head_width
        out += _t("collective-permute", L * 3 * (s - 1) * 2 * kv, c, "sequence",
                  what="K and V around the ring")  # fmt: skip
    if m.num_experts and e > 1:
        logits = (
            F32 * 2 * L * B * T * m.num_experts
        )  # gathered forward and for the backward
        out += _t("all-gather", logits, c, "fsdp", "expert", what="router logits")
        if c.dispatch == "dropless":  # dropless.padded_experts: worst-case buffers
            pairs = rows * T * m.top_k
            tokens = L * 6 * e * pairs * D * F32  # forward, remat, backward: 2 each
            ids = L * 2 * e * pairs * 4  # int32 expert ids, forward and remat
            return out + _t("all-to-all", tokens + ids, c, "expert",
                            what="pairs to experts and back (worst case)")  # fmt: skip
        group = min(m.group_size, T)
        slots = math.ceil(m.top_k * group * m.capacity_factor / m.num_experts)
        buffer = F32 * m.num_experts * rows * (T // group) * slots * D
        out += _t(
            "all-to-all",
            L * 3 * 2 * buffer,
            c,
            "expert",
            what="tokens to experts and back",
        )
    return out


def pipeline_transfers(run: Run, c: Candidate) -> list[Transfer]:
    """A pipeline's sends between stages (each microbatch's activations forward, their gradient
    back, once per virtual stage) and FSDP inside each stage: predicted, no recipe flag."""
    m = run.shape
    rows = run.global_batch // c.batch_ways
    act = 2 * rows * run.seq_len * m.width  # bf16 activations, all microbatches
    inside = dataclasses.replace(c, stages=1, strategy="FSDP")
    stage = dataclasses.replace(m, num_layers=m.num_layers // c.stages)
    per_stage = dataclasses.replace(run, shape=stage, devices=run.devices // c.stages)
    sends = [Transfer("collective-permute", 2 * c.virtual * act, None, "stage to stage",
                      ("pipeline",))]  # fmt: skip
    return sends + weight_transfers(per_stage, inside)


def transfers(run: Run, c: Candidate) -> list[Transfer]:
    """Every collective of one step on one device."""
    if c.stages > 1:
        return pipeline_transfers(run, c)
    if c.strategy.startswith(
        "ZeRO"
    ):  # gradients' shards, then the updated weights gathered
        n, P = run.devices, param_count(run.shape)  # noqa: N806
        return [Transfer("reduce-scatter", F32 * P / n, n, "gradients", ("data",)),
                Transfer("all-gather", F32 * P, n, "weights", ("data",))]  # fmt: skip
    return (
        weight_transfers(run, c)
        + embedding_transfers(run, c)
        + activation_transfers(run, c)
    )


# --- Collectives (a GPU's program, predicted) -----------------------------------------------------


def passes(run: Run) -> int:
    """How often a layer's forward collectives run in a step: the forward, the backward's
    transposes, and (remat 'dots' or 'full') the forward again for the backward."""
    return 2 if run.remat == "none" else 3


def gpu_weight_transfers(run: Run, c: Candidate) -> list[Transfer]:
    """FSDP's moves as the recipe's program would make them on a GPU (predicted): the weights
    gathered in the compute type (``step.cast`` casts each shard before the gather), each
    layer's in the forward and again in the backward, the output projection's too, the
    embedding table's once for the lookup; each micro-batch's gradient reduce-scattered in
    the compute type (the gradient of a bfloat16 weight is bfloat16; XLA:CPU's float32 is
    its own normalisation); then one all-reduce over each other batch axis, in float32
    after an accumulation (the sums), in the compute type otherwise."""
    m, f, t, e = run.shape, c.size("fsdp"), c.size("tensor"), c.size("expert")
    L, D, V, G = m.num_layers, m.width, m.vocab_size, run.grad_accum  # noqa: N806
    size, P = run.itemsize, param_count(m)  # noqa: N806
    summed = F32 if G > 1 else size
    if c.strategy in ("DP", "ZeRO-1") or f == 1:
        return _t("all-reduce", summed * P, c, "data", what="gradients")
    per_pass = L * (attention_weights(m) + mlp_weights(m) / e) / t + L * 2 * D + D
    per_pass += V * D / t  # the output projection (or the tied table as it)
    table = 0 if m.tie_embeddings else V * D / t  # the lookup's, forward only
    out = _t("all-gather", G * size * (2 * per_pass + table), c, "fsdp",
             what="weights (FSDP)")  # fmt: skip
    out += _t("reduce-scatter", G * size * (per_pass + table) / f, c, "fsdp",
              what="gradients (FSDP)")  # fmt: skip
    out += _t("all-reduce", summed * P / f, c, "data", what="gradients over data")
    out += _t("all-reduce", G * size * P / f, c, "sequence",
              what="gradients over sequence")  # fmt: skip
    shared = P - L * (mlp_weights(m) - D * m.num_experts)  # not the experts' own
    out += _t("all-reduce", G * size * shared / f, c, "expert",
              what="gradients of shared weights")  # fmt: skip
    return out


def gpu_activation_transfers(run: Run, c: Candidate) -> list[Transfer]:
    """What moves activations on a GPU (predicted), in the compute type, each micro-batch:
    Megatron's sequence parallelism (Korthikanti et al. 2022, section 4.2.2: an all-gather
    before attention and before the MLP, a reduce-scatter after each, in every pass; one
    of each for the embedding and the logits), ring attention's K and V, the experts'
    router logits (float32) and their tokens out and back (dropless: the pairs each
    device routes, with ``ragged_all_to_all``, not XLA:CPU's worst-case buffers)."""
    m, t, s, e = run.shape, c.size("tensor"), c.size("sequence"), c.size("expert")
    T, D, L, G = run.seq_len, m.width, m.num_layers, run.grad_accum  # noqa: N806
    rows, size, k = micro_rows(run, c), run.itemsize, passes(run)
    out = []
    if t > 1:
        act = size * rows * T * D  # one micro-batch's, whole sequence
        count = G * (2 * k * L + 2)
        out += _t("all-gather", count * act, c, "tensor", what="activations (SP)")
        out += _t("reduce-scatter", count * act / t, c, "tensor",
                  what="activations (SP)")  # fmt: skip
    if s > 1:
        kv = size * rows * (T // s) * m.num_kv_heads * m.head_width
        out += _t("collective-permute", G * L * k * (s - 1) * 2 * kv, c, "sequence",
                  what="K and V around the ring")  # fmt: skip
    if m.num_experts and e > 1:
        logits = F32 * 2 * L * run.global_batch * T * m.num_experts
        out += _t("all-gather", logits, c, "fsdp", "expert", what="router logits")
        if c.dispatch == "dropless":
            pairs = G * rows * T * m.top_k
            return out + _t("all-to-all", L * k * 2 * pairs * D * size, c, "expert",
                            what="pairs to experts and back")  # fmt: skip
        group = min(m.group_size, T)
        slots = math.ceil(m.top_k * group * m.capacity_factor / m.num_experts)
        buffer = size * m.num_experts * rows * (T // group) * slots * D
        out += _t("all-to-all", G * L * k * 2 * buffer, c, "expert",
                  what="tokens to experts and back")  # fmt: skip
    return out


def gpu_transfers(run: Run, c: Candidate) -> tuple[list[Transfer], list[Transfer]]:
    """A step's collectives on a GPU (predicted), as (overlapped, exposed): the weights'
    gathers and the gradients' reductions overlap with compute (XLA:GPU's latency-hiding
    scheduler and its pipelined collectives, as FSDP2 prefetches), and so do ring
    attention's sends and a pipeline's; the activations' collectives of tensor
    parallelism and experts wait on the compute before and hold up the compute after."""
    if c.stages > 1:
        m, rows = run.shape, run.global_batch // c.batch_ways
        act = run.itemsize * rows * run.seq_len * m.width  # every micro-batch's
        stage = dataclasses.replace(m, num_layers=m.num_layers // c.stages)
        per_stage = dataclasses.replace(run, shape=stage, devices=run.devices // c.stages,
                                        grad_accum=1)  # fmt: skip
        inside = dataclasses.replace(c, stages=1, strategy="FSDP")
        sends = [Transfer("collective-permute", 2 * c.virtual * act, None, "stage to stage",
                          ("pipeline",))]  # fmt: skip
        # tensor parallelism inside a stage: each micro-batch (one sequence) in turn
        each = dataclasses.replace(per_stage, grad_accum=rows)
        exposed = gpu_activation_transfers(each, c)
        return sends + gpu_weight_transfers(per_stage, inside), exposed
    if c.strategy.startswith(
        "ZeRO"
    ):  # gradients' shards, then float32 weights gathered
        n, P = run.devices, param_count(run.shape)  # noqa: N806
        summed = F32 if run.grad_accum > 1 else run.itemsize
        return [Transfer("reduce-scatter", summed * P / n, n, "gradients", ("data",)),
                Transfer("all-gather", F32 * P, n, "weights", ("data",))], []  # fmt: skip
    activations = gpu_activation_transfers(run, c)
    ring = [move for move in activations if move.kind == "collective-permute"]
    exposed = [move for move in activations if move.kind != "collective-permute"]
    return gpu_weight_transfers(run, c) + ring, exposed


def priced_transfers(run: Run, c: Candidate) -> tuple[list[Transfer], list[Transfer]]:
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


def transfer_bytes_by_kind(moves: Sequence[Transfer]) -> dict[str, float]:
    """Bytes per collective kind, counted as ``compiled.collective_bytes`` (examples/lm/compiled.py) counts them."""
    out: dict[str, float] = {}
    for move in moves:
        out[move.kind] = out.get(move.kind, 0) + move.bytes
    return out


def crossing_share(run: Run, c: Candidate, axes: Sequence[str]) -> float:
    """The share of a ring's sends over ``axes`` that cross nodes: a ring through a group
    of G devices on k nodes (k > 1) has k of its G edges between nodes, k / G; 0 inside a
    node. Devices are numbered over the mesh in ``AXES`` order (as ``jax.make_mesh`` lays
    them out), ``per_node`` to a node; pipeline stages are outermost, a node or more each,
    and every send between them crosses. With one network adapter per GPU, as in NVIDIA's
    reference systems (``hardware``'s network sources), NCCL runs a ring on each rail, so
    each device's adapter carries that share of its own sends."""
    if "pipeline" in axes:
        return 1.0 if run.nodes > 1 else 0.0
    return _crossing_share(c.mesh, run.per_node, tuple(axes))


@functools.cache  # a step has a dozen collectives over the same few groups
def _crossing_share(
    mesh: tuple[int, ...], per_node: int, axes: tuple[str, ...]
) -> float:
    nodes: dict[tuple[int, ...], set[int]] = {}
    sizes: dict[tuple[int, ...], int] = {}
    for device, coords in enumerate(itertools.product(*(range(n) for n in mesh))):
        group = tuple(i for a, i in zip(AXES, coords) if a not in axes)
        nodes.setdefault(group, set()).add(device // per_node)
        sizes[group] = sizes.get(group, 0) + 1
    return max(
        (
            len(found) / sizes[g] if len(found) > 1 else 0.0
            for g, found in nodes.items()
        ),
        default=0.0,
    )


def link_bytes(run: Run, c: Candidate, moves: Sequence[Transfer]) -> dict[str, float]:
    """Bytes one device sends per step (ring algorithms) inside its node and across nodes
    (``crossing_share`` of each collective's), and to its host and back (``--offload``)."""
    out = {"inside": 0.0, "across": 0.0, "host": host_bytes(run, c)}
    for move in moves:
        sent, share = sent_bytes(move), crossing_share(run, c, move.axes)
        out["across"] += share * sent
        out["inside"] += (1 - share) * sent
    return out


# --- Time ----------------------------------------------------------------------------------------

# Of the chip's datasheet peak that a step's matmuls reach: FITTED, one constant for every
# chip and run, to the bfloat16 runs of book/data/plan_published.json (least squares in
# log(predicted / measured); benchmarks/plan_published.py --fit prints it, and
# tests/test_plan_published.py refits it). --efficiency overrides it.
COMPUTE_EFFICIENCY = 0.41


def remat_flops(run: Run) -> float:
    """The flops a step runs over the model's: remat 'full' runs each layer's forward
    again (4/3: the forward is a third of 6 flops per weight and token); 'dots' only the
    attention's two batched matmuls (4 L T N A a token), whose outputs it does not keep."""
    if run.remat == "full":
        return 4 / 3
    if run.remat == "dots":
        m = run.shape
        attention = 4 * m.num_layers * run.seq_len * m.num_heads * m.head_width
        return 1 + attention / model_flops_per_token(m, run.seq_len)
    return 1.0


def collective_seconds(run: Run, c: Candidate, moves: Sequence[Transfer]) -> float:
    """Seconds to send ``moves`` one after another, each a ring whose sends inside the node
    and across it run at once, on NVLink and the network adapters: the slower sets the
    pace."""
    chip, total = run.chip, 0.0
    for move in moves:
        sent, share = sent_bytes(move), crossing_share(run, c, move.axes)
        across = share * sent / chip.network_bytes_per_s if share else 0.0
        total += max((1 - share) * sent / chip.link_bytes_per_s, across)
    return total


def step_seconds(
    run: Run, c: Candidate, moves: tuple[list, list] | None = None
) -> dict[str, float]:
    """Predicted seconds: the compute at ``COMPUTE_EFFICIENCY`` of the chip's peak, with
    remat's extra flops and a pipeline's bubble; the collectives that overlap with it
    (and the host copies) hidden behind it up to its length; the exposed ones added."""
    chip = run.chip
    overlapped, exposed = moves or priced_transfers(run, c)
    flops = (
        model_flops_per_token(run.shape, run.seq_len) * run.global_batch * run.seq_len
    )
    peak = chip.peak_bf16_flops if run.dtype == "bfloat16" else chip.peak_fp32_flops
    efficiency = run.efficiency or COMPUTE_EFFICIENCY
    compute = flops * remat_flops(run) / run.devices / (peak * efficiency)
    if c.stages > 1:
        micro = run.global_batch // c.batch_ways
        compute /= 1 - bubble_fraction(c.stages, micro, c.virtual)
    hidden = collective_seconds(run, c, overlapped)
    if c.offload:
        hidden += host_bytes(run, c) / chip.host_bytes_per_s
    waited = collective_seconds(run, c, exposed)
    step = max(compute, hidden) + waited
    return {"compute": compute, "overlapped": hidden, "exposed": waited,
            "comm": hidden + waited, "step": step,
            "mfu": flops / step / (run.devices * peak)}  # fmt: skip


# --- Rows ----------------------------------------------------------------------------------------


def recipe_flags(run: Run, c: Candidate) -> str:
    """The flags of ``examples/lm/train.py`` that run this layout: ``--model`` for a
    preset's shape, otherwise ``--model-config config.json`` (``hf_config`` writes it);
    for a layout the recipe does not run, what it needs."""
    if not runnable(c):
        return NEEDS[c.strategy]
    m = run.shape
    dense = dataclasses.replace(
        m, num_experts=0, top_k=1, capacity_factor=1.25, group_size=512
    )
    model = (
        f"--model {run.model}"
        if dense == PRESETS.get(run.model)
        else f"--model-config {CONFIG_FILE}"
    )
    flags = [model, f"--mesh {c.mesh_flag}", f"--seq-len {run.seq_len}",
             f"--global-batch {run.global_batch}", f"--dtype {run.dtype}"]  # fmt: skip
    if m.num_experts:
        flags += [f"--experts {m.num_experts}", f"--top-k {m.top_k}"]
        if c.dispatch == "dropless":
            flags.append("--dispatch dropless")
        else:
            flags += [f"--capacity-factor {m.capacity_factor:g}",
                      f"--group-size {m.group_size}"]  # fmt: skip
    if c.strategy == "ZeRO-1":
        flags.append("--zero1")
    if run.remat != "full":
        flags.append(f"--remat {run.remat}")
    if run.grad_accum > 1 and c.stages == 1:
        flags.append(f"--grad-accum {run.grad_accum}")
    if c.offload:
        flags.append("--offload optimizer,activations")
    if c.stages > 1:  # one sequence per device per microbatch, as step_seconds counts
        flags[1] = f"--mesh pipeline={c.stages},{c.mesh_flag}"
        flags += [f"--grad-accum {run.global_batch // c.batch_ways}",
                  f"--schedule {c.schedule.lower()}"]  # fmt: skip
        if c.virtual > 1:
            flags.append(f"--virtual-stages {c.virtual}")
    return " ".join(flags)


CONFIG_FILE = "config.json"  # a custom shape's, from --write-config


def hf_config(m: LMShape) -> dict[str, Any]:
    """A shape as the Hugging Face Llama config.json that ``--model-config`` reads
    (examples/lm/model.py's ``config_from_hf``)."""
    return {"model_type": "llama", "hidden_act": "silu", "vocab_size": m.vocab_size,
            "num_hidden_layers": m.num_layers, "hidden_size": m.width,
            "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
            "intermediate_size": m.mlp_width, "tie_word_embeddings": m.tie_embeddings}  # fmt: skip


def temporaries_estimate(run: Run, c: Candidate) -> float:
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


def row(run: Run, c: Candidate) -> dict[str, Any]:
    """Everything the table and the JSON say about one layout; its collectives worked out
    once for the bytes and the time (and XLA:CPU's, for ``--check``)."""
    priced = priced_transfers(run, c)
    mem, time = memory(run, c), step_seconds(run, c, priced)
    label = c.mesh_flag if c.stages == 1 else f"pipeline={c.stages},{c.mesh_flag}"
    if c.schedule == "interleaved":
        label += f" (v={c.virtual})"
    parts = {**dataclasses.asdict(mem), "total": mem.total}
    return {
        "strategy": c.strategy,
        "mesh": label,
        "fits": mem.total <= USABLE * run.chip.memory_bytes,
        "memory_bytes": parts,
        "memory_gb": {k: v / 1e9 for k, v in parts.items()},
        "arguments_bytes": argument_bytes(run, c),
        "temporaries_estimate_bytes": temporaries_estimate(run, c),
        "collective_bytes": transfer_bytes_by_kind(transfers(run, c)),
        "sent_bytes": link_bytes(run, c, priced[0] + priced[1]),
        "step_seconds": time["step"],
        "seconds": {k: time[k] for k in ("compute", "overlapped", "exposed")},
        "mfu": time["mfu"],
        "tokens_per_second_per_device": run.global_batch
        * run.seq_len
        / time["step"]
        / run.devices,
        "grad_accum": run.grad_accum if c.stages == 1 else 0,  # 0: a pipeline's own
        "flags": recipe_flags(run, c),
        "runnable": runnable(c),
        "checked": checked(run, c),
    }


def accumulated(run: Run, c: Candidate) -> Run:
    """``run`` with ``--grad-accum auto`` settled for this layout: the fewest micro-batches
    (a divisor of its rows a device) whose memory fits, or one a row if none does. A
    pipeline's micro-batches are its own (one sequence each)."""
    if not run.fit_accum or c.stages > 1:
        return run
    rows = run.global_batch // c.batch_ways
    for k in (k for k in range(1, rows + 1) if rows % k == 0):
        tried = dataclasses.replace(run, grad_accum=k)
        if memory(tried, c).total <= USABLE * run.chip.memory_bytes:
            return tried
    return dataclasses.replace(run, grad_accum=rows)


def plan(run: Run) -> list[dict[str, Any]]:
    """One row per layout that divides the model: fitting ones first, then those the
    recipe runs, fastest first."""
    rows = [
        row(accumulated(run, c), c) for c in candidates(run) if not problems(run, c)
    ]
    return sorted(rows, key=rank)


def rank(r: dict[str, Any]) -> tuple:
    """Fitting rows first, then those the recipe runs, then the fastest (to 3 figures:
    compute-bound layouts tie), then the fewest bytes across nodes, then to the host,
    then the least memory."""
    step, sent = float(f"{r['step_seconds']:.3g}"), r["sent_bytes"]
    return (not r["fits"], not r["runnable"], step, sent["across"], sent["host"],
            r["memory_bytes"]["total"])  # fmt: skip


HEADERS = ["strategy", "mesh", "fits", "micro-batches", "weights GB", "optimizer GB", "grads GB",
           "activations GB", "total GB", "in-node GB", "across GB", "host GB",
           "step s (predicted)", "MFU (predicted)"]  # fmt: skip


def table(run: Run, rows: Sequence[dict[str, Any]]) -> Table:
    """The rows as a ``tables.Table``."""
    gb = lambda x: x / 1e9
    cells = [[r["strategy"], r["mesh"], "yes" if r["fits"] else "no",
              r["grad_accum"] or "pipeline",
              *(gb(r["memory_bytes"][k]) for k in ("weights", "optimizer", "gradients",
                                                  "activations", "total")),
              gb(r["sent_bytes"]["inside"]), gb(r["sent_bytes"]["across"]),
              gb(r["sent_bytes"]["host"]),
              r["step_seconds"], f"{r['mfu']:.1%}"] for r in rows]  # fmt: skip
    sent = {"gpu": "a GPU's program (predicted)",
            "xla-cpu": "XLA:CPU's program (float32 collectives)"}[run.bytes]  # fmt: skip
    title = (f"{run.model} on {run.devices} x {run.chip.name} ({run.nodes} node"
             f"{'s' if run.nodes > 1 else ''}), {run.global_batch} x {run.seq_len} tokens a "
             f"step, {run.dtype}, remat {run.remat}; GB sent "
             f"per device per step by {sent}")  # fmt: skip
    return Table(HEADERS, cells, title=title)


# --- Checked against the compiler --------------------------------------------------------------

MINOR = (
    0.01  # a collective kind under 1% of a program's bytes is shown, not held to 10%
)


def compile_worker(devices: int, runs: Sequence[Sequence[str]]) -> None:
    """In a fresh process: compile train.py's step for each argv on ``devices`` simulated CPU
    devices and print one JSON line each (exact argument and temporary bytes, collective bytes
    as ``compiled.collective_bytes`` counts them). ``compiled.compile_only`` prints GB to 3 decimals."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    sys.path.insert(0, str(TRAIN.parent))
    import compiled as recipe_compiled
    import train

    for argv in runs:
        args = train.parse_args([*argv, "--compile-only"])
        try:  # what setup says (once-only notes) goes to stderr: stdout is the JSON
            with contextlib.redirect_stdout(sys.stderr):
                mesh, _, _, step, shapes, _ = train.setup(args)
            compiled = recipe_compiled.lower_step(step, shapes, args, mesh).compile()
        except (Exception, SystemExit) as error:  # the next layout may still compile
            print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
            continue
        memory_use = compiled.memory_analysis()
        print(json.dumps({"arguments": memory_use.argument_size_in_bytes,
                          "temporaries": memory_use.temp_size_in_bytes,
                          "collectives": recipe_compiled.collective_bytes(compiled.as_text())}),
              flush=True)  # fmt: skip


def compile_flags(
    devices: int, flag_lines: Sequence[str], progress: bool = True, strict: bool = True
) -> list[dict]:
    """Compile each line of recipe flags in one subprocess (JAX starts once), with a tqdm bar;
    a layout that does not compile raises, or with ``strict=False`` gives ``{"error": ...}``."""
    from tqdm import tqdm

    runs = [line.split() for line in flag_lines]
    program = (
        f"from jaxdist_lessons import plan; plan.compile_worker({devices}, {runs!r})"
    )
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    worker = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)  # fmt: skip
    results = []
    with tqdm(total=len(runs), desc=f"compiling on {devices} CPU devices", unit="layout",
              disable=not progress, file=sys.stderr) as bar:  # fmt: skip
        for line in worker.stdout:
            results.append(json.loads(line))
            bar.update()
    if worker.wait() or len(results) != len(runs):
        raise RuntimeError(f"compiling {flag_lines[len(results)]} failed:\n"
                           f"{worker.stderr.read()[-3000:]}")  # fmt: skip
    for line, result in zip(flag_lines, results):
        if "error" in result and strict:
            raise RuntimeError(f"train.py {line} --compile-only: {result['error']}")
    return results


def ratio(predicted: float, compiled: float) -> float | None:
    """predicted / compiled; ``None`` where the compiled program has none of it."""
    return predicted / compiled if compiled else None


def compare(plan_row: dict[str, Any], compiled: dict[str, Any]) -> dict[str, Any]:
    """Predicted against compiled: argument bytes, bytes per collective kind (kinds under
    ``MINOR`` of the program's bytes marked minor), and ``temporaries_estimate`` against
    XLA:CPU's temporaries."""
    total = sum(compiled["collectives"].values())
    kinds = sorted(set(plan_row["collective_bytes"]) | set(compiled["collectives"]))
    collectives = {}
    for kind in kinds:
        got = compiled["collectives"].get(kind, 0)
        want = plan_row["collective_bytes"].get(kind, 0)
        collectives[kind] = {"predicted": want, "compiled": got, "ratio": ratio(want, got),
                             "minor": got < MINOR * total and want < MINOR * total}  # fmt: skip
    estimate = plan_row["temporaries_estimate_bytes"]
    return {
        "arguments": {"predicted": plan_row["arguments_bytes"],
                      "compiled": compiled["arguments"],
                      "ratio": ratio(plan_row["arguments_bytes"], compiled["arguments"])},
        "collectives": collectives,
        "temporaries": {"estimate": estimate, "compiled": compiled["temporaries"],
                        "ratio": ratio(estimate, compiled["temporaries"])},
    }  # fmt: skip


def agrees(check: dict[str, Any], tolerance: float = 0.1) -> bool:
    """Arguments and every collective kind that is not minor within ``tolerance``."""
    ratios = [check["arguments"]["ratio"]]
    ratios += [c["ratio"] for c in check["collectives"].values() if not c["minor"]]
    return all(r is not None and abs(r - 1) <= tolerance for r in ratios)


def check_table(
    rows: Sequence[dict[str, Any]], checks: Sequence[dict[str, Any]]
) -> Table:
    """Predicted and compiled side by side: arguments, each collective kind, temporaries."""
    cells = []
    fmt = lambda r: "-" if r is None else f"{r:.3f}"
    for r, c in zip(rows, checks):
        parts = [("arguments", c["arguments"])]
        parts += [
            (k + (" (minor)" if v["minor"] else ""), v)
            for k, v in c["collectives"].items()
        ]
        for name, v in parts:
            cells.append([r["mesh"], name, v["predicted"] / 1e9, v["compiled"] / 1e9,
                          fmt(v["ratio"])])  # fmt: skip
        t = c["temporaries"]
        cells.append([r["mesh"], "temporaries vs activation estimate", t["estimate"] / 1e9,
                      t["compiled"] / 1e9, fmt(t["ratio"])])  # fmt: skip
    return Table(["mesh", "per device", "predicted GB", "compiled GB", "ratio"], cells,
                 title="predicted against XLA:CPU's compiled step (simulated devices)")  # fmt: skip


# --- Command line --------------------------------------------------------------------------------


class PlanError(ValueError):
    """Input the planner cannot plan for; the command line prints it on one line, status 2."""


def make_run(args: argparse.Namespace) -> Run:
    """The reader's request, checked; ``PlanError`` says what is wrong."""
    for name in ("devices", "nodes", "seq_len", "global_batch", "top_k", "group_size"):
        if getattr(args, name) < 1:
            raise PlanError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    if args.devices > MAX_DEVICES:  # crossing_share walks every device of every mesh
        raise PlanError(
            f"--devices {args.devices}: the planner plans up to {MAX_DEVICES:,}"
        )
    if args.experts < 0 or args.capacity_factor <= 0:
        raise PlanError("--experts must be 0 or more and --capacity-factor positive")
    if args.devices % args.nodes:
        raise PlanError(
            f"--devices {args.devices} do not divide into --nodes {args.nodes}"
        )
    name = CHIP_NAMES.get(args.chip.lower(), args.chip)
    if name not in hardware.CHIPS:
        raise PlanError(f"unknown chip {args.chip!r}; known: {', '.join(CHIP_NAMES)}, "
                        f"{', '.join(hardware.CHIPS)}")  # fmt: skip
    chip = hardware.CHIPS[name]
    if chip.link_bytes_per_s is None or (
        args.nodes > 1 and chip.network_bytes_per_s is None
    ):
        raise PlanError(f"{chip.name} has no {'network' if chip.link_bytes_per_s else 'chip-to-chip'}"
                        " bandwidth in hardware.CHIPS; pick another --chip")  # fmt: skip
    peak = chip.peak_bf16_flops if args.dtype == "bfloat16" else chip.peak_fp32_flops
    if peak is None:
        raise PlanError(f"{chip.name} has no {args.dtype} peak in hardware.CHIPS; pick another "
                        "--dtype or --chip")  # fmt: skip
    shape = model_shape(args)
    if not 1 <= args.top_k <= max(shape.num_experts, 1):
        raise PlanError(
            f"--top-k {args.top_k} must be between 1 and --experts {shape.num_experts}"
        )
    accum = args.grad_accum
    if accum != "auto" and not (accum.isdigit() and int(accum) > 0):
        raise PlanError(f"--grad-accum must be a positive integer or auto, got {accum}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise PlanError(
            f"--efficiency {args.efficiency}: a fraction of the peak, in (0, 1]"
        )
    return Run(args.model or "custom", shape, args.devices, args.nodes, chip, args.seq_len,
               args.global_batch, args.dtype, args.remat,
               1 if accum == "auto" else int(accum), fit_accum=accum == "auto",
               bytes=args.bytes, efficiency=args.efficiency)  # fmt: skip


SHAPE_FLAGS = {"layers": "num_layers", "width": "width", "heads": "num_heads",
               "kv_heads": "num_kv_heads", "mlp_width": "mlp_width", "vocab": "vocab_size"}  # fmt: skip


def model_shape(args: argparse.Namespace) -> LMShape:
    """A preset, or the shape the flags give; experts from --experts and --top-k either way."""
    given = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items()
             if getattr(args, flag) is not None}  # fmt: skip
    if args.model and args.model not in PRESETS:
        raise PlanError(f"unknown model {args.model!r}; presets: {', '.join(PRESETS)}, or give "
                        "--layers --width --heads --kv-heads --mlp-width --vocab")  # fmt: skip
    if min(given.values(), default=1) < 1:
        raise PlanError("the model's sizes must be positive")
    if args.model:
        shape = dataclasses.replace(PRESETS[args.model], **given)
    elif len(given) < len(SHAPE_FLAGS):
        missing = [
            f"--{f.replace('_', '-')}" for f in SHAPE_FLAGS if getattr(args, f) is None
        ]
        raise PlanError(
            f"give --model, or the model's shape: missing {' '.join(missing)}"
        )
    else:
        shape = LMShape(**given)
    if shape.width % shape.num_heads or shape.num_heads % shape.num_kv_heads:
        raise PlanError(f"width {shape.width}, {shape.num_heads} heads and {shape.num_kv_heads} "
                        "KV heads: heads must divide the width, KV heads the heads")  # fmt: skip
    return dataclasses.replace(shape, num_experts=args.experts, top_k=args.top_k,
                               capacity_factor=args.capacity_factor,
                               group_size=args.group_size)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2
        raise PlanError(message)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m jaxdist_lessons.plan", description=__doc__.split("\n")[0]
    )
    add = parser.add_argument
    add("--model", help=f"a preset of examples/lm/model.py: {', '.join(PRESETS)}")
    for flag in SHAPE_FLAGS:
        add(
            f"--{flag.replace('_', '-')}",
            type=int,
            help="the model's shape, without --model",
        )
    add("--experts", type=int, default=0, help="experts per MLP (0: dense)")
    add("--top-k", type=int, default=1)
    add("--capacity-factor", type=float, default=1.25)
    add("--group-size", type=int, default=512)
    add("--devices", type=int, required=True)
    add("--nodes", type=int, default=1)
    add(
        "--chip",
        default="h100",
        help=f"{', '.join(CHIP_NAMES)} or a name in hardware.CHIPS",
    )
    add("--seq-len", type=int, default=2048)
    add("--global-batch", type=int, required=True, help="sequences per step")
    add(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="compute type",
    )
    add("--remat", default="full", choices=["none", "dots", "full"],
        help="train.py's --remat: what each layer keeps for the backward")  # fmt: skip
    add("--grad-accum", default="auto",
        help="micro-batches a step (train.py's); auto: each layout's fewest that fit")  # fmt: skip
    add("--bytes", default="gpu", choices=["gpu", "xla-cpu"],
        help="the collectives to price: a GPU's (predicted) or XLA:CPU's compiled ones")  # fmt: skip
    add("--efficiency", type=float,
        help=f"of the chip's peak the matmuls reach (default {COMPUTE_EFFICIENCY}, fitted)")  # fmt: skip
    add("--json", action="store_true", help="print the rows as JSON")
    add(
        "--check",
        action="store_true",
        help="compile the best rows on simulated devices",
    )
    add("--check-rows", type=int, default=3, help="how many rows --check compiles")
    add(
        "--write-config",
        metavar="PATH",
        help="write the model's shape as the config.json that train.py's "
        "--model-config reads (for a shape that is not a preset)",
    )
    return parser.parse_args(argv)


def fitting_plan(run: Run) -> list[dict[str, Any]]:
    """``plan(run)`` when some layout fits; otherwise ``PlanError`` says why none does."""
    rows = plan(run)
    if not rows:  # every layout's split fails; the first family's reasons say why
        reasons = next(p for c in candidates(run) if (p := problems(run, c)))
        raise PlanError(f"no layout splits {run.model} on {run.devices} devices: "
                        f"{'; '.join(reasons)}")  # fmt: skip
    if not any(r["fits"] for r in rows):
        smallest = min(r["memory_bytes"]["total"] for r in rows)
        raise PlanError(f"{run.model} fits no layout on {run.devices} x {run.chip.name}: the "
                        f"smallest needs {smallest / 1e9:,.1f} GB a device, above "
                        f"{USABLE:.0%} of {run.chip.memory_label} ("
                        f"{'' if run.fit_accum else 'more --grad-accum, '}--remat full, a "
                        "shorter --seq-len or more --devices)")  # fmt: skip
    return rows


def page_json(argv: Sequence[str]) -> str:
    """What the "Plan your run" page shows for its form's flags, as JSON: the table (title,
    headers, cells as printed) and the rows, or ``{"error": ...}``, the line ``main`` prints."""
    try:
        run = make_run(parse_args(argv))
        rows = fitting_plan(run)
    except PlanError as error:
        return json.dumps({"error": f"plan: {error}"})
    shown = table(run, rows)
    return json.dumps({"run": run_summary(run), "rows": rows, "title": shown.title,
                       "headers": shown.headers, "cells": shown.rows,
                       "usable_bytes": USABLE * run.chip.memory_bytes})  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: the table (or JSON), and with --check the compiled comparison."""
    try:
        args = parse_args(argv)
        run = make_run(args)
        rows = fitting_plan(run)
    except PlanError as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    custom = any(f"--model-config {CONFIG_FILE}" in r["flags"] for r in rows)
    if args.write_config:
        pathlib.Path(args.write_config).write_text(json.dumps(hf_config(run.shape)))
        for r in rows:
            r["flags"] = r["flags"].replace(
                f"--model-config {CONFIG_FILE}", f"--model-config {args.write_config}"
            )
    checks = []
    if args.check:
        chosen = [r for r in rows if r["checked"]][: args.check_rows]  # fitting first
        with tempfile.TemporaryDirectory() as folder:
            config = pathlib.Path(folder, CONFIG_FILE)
            config.write_text(json.dumps(hf_config(run.shape)))
            lines = [r["flags"].replace(f"--model-config {CONFIG_FILE}",
                                        f"--model-config {config}") for r in chosen]  # fmt: skip
            compiled = compile_flags(run.devices, lines)
        checks = [compare(r, c) for r, c in zip(chosen, compiled)]
    if args.json:
        out: dict[str, Any] = {"run": run_summary(run), "rows": rows}
        if args.check:
            out["checks"] = [{"mesh": r["mesh"], **c} for r, c in zip(chosen, checks)]
        print(json.dumps(out, indent=1))
        return 0
    print(table(run, rows))
    print("\nflags for examples/lm/train.py (add --num-devices N --compile-only to check one "
          "on this machine):")  # fmt: skip
    for number, r in enumerate(rows, 1):
        print(f"{number:>3}. {r['strategy']:<22} {r['flags']}")
    if custom and not args.write_config:
        print(f"\n{CONFIG_FILE}: this shape for --model-config; add --write-config "
              f"{CONFIG_FILE} to write it")  # fmt: skip
    if args.check:
        print()
        print(check_table(chosen, checks))
    return 0


def run_summary(run: Run) -> dict[str, Any]:
    """The request, as JSON."""
    return {"model": run.model, "shape": dataclasses.asdict(run.shape), "devices": run.devices,
            "nodes": run.nodes, "chip": run.chip.name, "seq_len": run.seq_len,
            "global_batch": run.global_batch, "dtype": run.dtype, "remat": run.remat,
            "grad_accum": "auto" if run.fit_accum else run.grad_accum, "bytes": run.bytes,
            "efficiency": run.efficiency or COMPUTE_EFFICIENCY}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
