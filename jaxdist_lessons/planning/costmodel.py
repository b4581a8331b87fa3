"""Chapter 11's roofline cost model of one training step: time and memory per device.

For a Transformer (a ViT or a GPT-style LM), a layout of the devices, and an accelerator, it
estimates:

- **compute**: the step's flops over the device's peak, or its memory traffic over the HBM
  bandwidth, whichever is slower (the roofline);
- **communication**: the collectives the layout needs, each as ``comms`` reports one read
  from a compiled program (kind, bytes of its result on one device, group size), turned into
  bytes sent by a ring algorithm and divided by the interconnect bandwidth. ``transfers_from_hlo``
  reads the same records from a real compiled program, so prediction and compiler can be
  compared line by line, and the same ``comm_seconds`` prices both;
- **memory**: training state (weights, gradients, Adam moments, fp32 master weights) and the
  activations kept for the backward pass (Korthikanti et al. 2022).

A layout is the planner's ``Layout`` (``planning.layouts``) on its ``data``, ``fsdp`` and
``tensor`` axes: batch split ``data x fsdp`` ways, parameters split over ``fsdp`` (ZeRO-3),
attention heads and MLP units split over ``tensor`` (Megatron tensor parallelism). ``(8, 1)`` in
the article's notation is ``Layout(data=8)``, ``(4, 2)`` is ``Layout(data=4, tensor=2)``. The
sizes follow the planner's vocabulary: ``width``, ``mlp_width``, ``chip``.

Where this model teaches (any Transformer, ViTs included, checked against compiled programs on
simulated devices), the planner (``python -m jaxdist_lessons.planning``) predicts the recipe's
runs on GPUs: bytes as a GPU sends them, a fitted compute efficiency, overlap.

Beside the layout's collectives, one layer's collectives for the strategies of chapters 12 and 13,
each as the ``Transfer`` records ``transfers_from_hlo`` reads from the compiled layer:
``tensor_parallel_transfers`` (an all-reduce, or Megatron sequence parallelism's all-gather and
reduce-scatter), ``context_parallel_transfers`` (ring attention's K/V permutes, the all-gather of
K and V, Ulysses's all-to-alls) and ``expert_parallel_transfers`` (dispatch and combine).

What it leaves out, on purpose: kernel efficiency (it assumes peak flops, the case most
favourable to communication mattering), overlap is bracketed (``step_s`` adds compute and
communication, ``overlapped_s`` takes the larger), latency per collective, and pipelines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxdist_lessons import comms, experts, hardware, memory, sequence
from jaxdist_lessons._checks import positive_int

# JAX-free arithmetic (traffic.py, activations.py), re-exported: the planner page imports it.
from jaxdist_lessons.activations import layer_activation_bytes as layer_activation_bytes
from jaxdist_lessons.models.vit import vit_params
from jaxdist_lessons.planning.layouts import Layout
from jaxdist_lessons.traffic import Transfer, comm_seconds
from jaxdist_lessons.traffic import sent_bytes as sent_bytes


def _chip(chip: hardware.Chip | str) -> hardware.Chip:
    """The chip itself, or the one ``hardware`` calls ``chip``; it must have an interconnect figure."""
    chip = hardware.chip(chip) if isinstance(chip, str) else chip
    if chip.link_bytes_per_s is None:
        with_links = [c.name for c in hardware.CHIPS.values() if c.link_bytes_per_s]
        raise ValueError(
            f"{chip.name} has no chip-to-chip bandwidth in hardware.CHIPS, which the cost model "
            f"needs; use one of {', '.join(with_links)}"
        )
    return chip


# --- Models -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """A Transformer's sizes and one global batch: what the cost model needs to know about a model.

    ``token_matmul_params``: weights outside the blocks that multiply every token (the patch
    embedding, or an LM's output projection); ``sequence_matmul_params``: those applied once per
    sequence (a ViT's classification head); ``logits_per_token``: output logits kept per token (LM vocab).
    ``vocab_parallel``: tensor parallelism also splits the (tied) embedding and output projection
    over the vocabulary, as Megatron-LM does.
    """

    name: str
    num_layers: int
    width: int
    num_heads: int
    mlp_width: int
    seq_len: int
    params: int
    global_batch: int
    token_matmul_params: int = 0
    sequence_matmul_params: int = 0
    logits_per_token: int = 0
    vocab_parallel: bool = False

    @property
    def layer_tp_params(self) -> int:
        """Parameters of one block that tensor parallelism splits: Q, K, V, output and MLP kernels, Q/K/V and up biases."""
        h, f = self.width, self.mlp_width
        return 4 * h * h + 3 * h + 2 * h * f + f

    @property
    def tp_params(self) -> int:
        """All parameters that tensor parallelism splits."""
        return self.num_layers * self.layer_tp_params + (
            self.token_matmul_params if self.vocab_parallel else 0
        )

    @property
    def tokens(self) -> int:
        """Tokens in one global batch."""
        return self.global_batch * self.seq_len


def vit_spec(
    name: str,
    width: int,
    num_layers: int,
    num_heads: int,
    mlp_width: int,
    patch_size: int = 16,
    image_size: int = 224,
    num_classes: int = 1000,
    global_batch: int = 256,
) -> TransformerSpec:
    """A ViT (``models/vit.py``'s architecture) as a ``TransformerSpec``."""
    tokens = (image_size // patch_size) ** 2 + 1
    params = vit_params(
        width, num_layers, mlp_width, patch_size, image_size, num_classes
    )
    return TransformerSpec(
        name,
        num_layers,
        width,
        num_heads,
        mlp_width,
        tokens,
        params,
        global_batch,
        token_matmul_params=patch_size * patch_size * 3 * width,
        sequence_matmul_params=width * num_classes,
    )


def gpt_spec(
    name: str,
    width: int,
    num_layers: int,
    num_heads: int,
    vocab_size: int = 50257,
    seq_len: int = 1024,
    global_batch: int = 64,
) -> TransformerSpec:
    """A GPT-style decoder (``memory.transformer_params``: tied embeddings, MLP 4x) as a ``TransformerSpec``.

    Tensor parallelism splits its vocabulary too (``vocab_parallel``).
    """
    params = memory.transformer_params(num_layers, width, vocab_size, seq_len)
    return TransformerSpec(
        name,
        num_layers,
        width,
        num_heads,
        4 * width,
        seq_len,
        params,
        global_batch,
        token_matmul_params=vocab_size * width,
        logits_per_token=vocab_size,
        vocab_parallel=True,
    )


MODELS: dict[str, TransformerSpec] = {
    m.name: m
    for m in [
        vit_spec("ViT-B/16", 768, 12, 12, 3072),
        vit_spec("ViT-L/16", 1024, 24, 16, 4096),
        gpt_spec("GPT-2 (124M)", 768, 12, 12),
        gpt_spec("GPT-2 medium (355M)", 1024, 24, 16),
    ]
}


# --- Layouts ------------------------------------------------------------------------------------


def article_layouts(num_devices: int = 8) -> list[Layout]:
    """The article's meshes for ``num_devices`` devices, ``(n,1)`` ... ``(1,n)`` over powers of two, then FSDP."""
    tensors = [2**k for k in range(num_devices.bit_length()) if num_devices % 2**k == 0]
    return [Layout(data=num_devices // t, tensor=t) for t in tensors] + [
        Layout(fsdp=num_devices)
    ]


def check_layout(spec: TransformerSpec, layout: Layout) -> list[str]:
    """Reasons ``layout`` cannot run ``spec`` as is (an empty list when it can)."""
    problems = []
    others = [a for a in ("expert", "sequence") if layout.size(a) > 1]
    if others or layout.stages > 1:
        problems.append(f"the cost model has data, fsdp and tensor axes only, not "
                        f"{', '.join(others or ['pipeline stages'])}")  # fmt: skip
    if spec.num_heads % layout.tensor:
        problems.append(
            f"{spec.num_heads} heads do not split over tensor={layout.tensor}"
        )
    if spec.mlp_width % layout.tensor:
        problems.append(
            f"MLP width {spec.mlp_width} does not split over tensor={layout.tensor}"
        )
    if spec.vocab_parallel and spec.logits_per_token % layout.tensor:
        problems.append(
            f"vocabulary of {spec.logits_per_token} does not split over tensor={layout.tensor}"
        )
    if spec.global_batch % (layout.data * layout.fsdp):
        problems.append(
            f"global batch {spec.global_batch} does not split over {layout.data * layout.fsdp} devices"
        )
    return problems


def params_per_device(spec: TransformerSpec, layout: Layout) -> float:
    """Parameters one device holds: tensor parallelism splits the block kernels, FSDP everything."""
    return (
        spec.tp_params / layout.tensor + (spec.params - spec.tp_params)
    ) / layout.fsdp


# --- Communication ------------------------------------------------------------------------------


def transfers_from_hlo(hlo_text: str) -> list[Transfer]:
    """The collectives of a compiled program (``comms.collectives``) as ``Transfer`` records."""
    return [
        Transfer(c.kind, c.bytes, c.group_size, c.name)
        for c in comms.collectives(hlo_text)
    ]


def tensor_parallel_transfers(
    activation_bytes: float, tensor: int, sequence_parallel: bool = False
) -> list[Transfer]:
    """One Megatron all-reduce site: an all-reduce of the activation over ``tensor`` devices, or, with
    sequence parallelism, an all-gather of it and a reduce-scatter into ``1/tensor`` of it.

    ``activation_bytes`` is the whole activation one device computes a partial sum of (its tokens x
    width x itemsize). A ring sends the same bytes either way: ``2 (t-1)/t`` of the activation.
    """
    if not sequence_parallel:
        return [
            Transfer(
                "all-reduce", activation_bytes, tensor, "activations (tensor parallel)"
            )
        ]
    return [
        Transfer(
            "all-gather", activation_bytes, tensor, "activations (sequence parallel)"
        ),
        Transfer(
            "reduce-scatter",
            activation_bytes / tensor,
            tensor,
            "activations (sequence parallel)",
        ),
    ]


def context_parallel_transfers(
    kind: str,
    batch: int,
    seq_len: int,
    heads: int,
    head_dim: int,
    num_devices: int,
    itemsize: int = 4,
) -> list[Transfer]:
    """One causal attention's forward collectives with the sequence split over ``num_devices`` (chapter 12).

    ``kind`` is a key of ``sequence.ATTENTIONS``. ``heads`` are the K/V heads (all of them for
    Ulysses, whose Q, K, V and output have as many). With ``block`` one device's share of K (or V):
    ring attention permutes K and V ``n-1`` times each; all-gather-KV gathers K and V whole;
    Ulysses sends Q, K, V and the output through one all-to-all each, of ``block`` bytes.
    """
    n = positive_int("num_devices", num_devices)
    whole = sequence.kv_bytes(batch, seq_len, heads, head_dim, itemsize) // 2  # K or V
    block = whole // n
    if kind == "ring":
        return [
            Transfer("collective-permute", block, None, "K or V to the next device")
        ] * (2 * (n - 1))
    if kind == "all-gather KV":
        return [Transfer("all-gather", whole, n, "K or V, gathered")] * 2
    if kind == "Ulysses":
        return [Transfer("all-to-all", block, n, "Q, K, V to heads; output back")] * 4
    raise ValueError(
        f"unknown attention {kind!r}; allowed: {', '.join(sequence.ATTENTIONS)}"
    )


def expert_parallel_transfers(
    tokens_per_device: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float,
    width: int,
    expert_devices: int,
    itemsize: int = 4,
) -> list[Transfer]:
    """One mixture-of-experts layer's forward collectives over an ``expert`` axis (chapter 13).

    Each device fills a buffer of ``E x C`` slots of ``width`` (``experts.capacity`` of its own
    tokens), all-to-alls it to the experts' devices (dispatch), and the results come back the same
    way (combine). The backward pass sends the gradients the same two ways again.
    """
    slots = experts.capacity(tokens_per_device, num_experts, top_k, capacity_factor)
    buffer = experts.all_to_all_bytes(num_experts, slots, width, itemsize)
    return [
        Transfer(
            "all-to-all", buffer, expert_devices, "tokens to their experts (dispatch)"
        ),
        Transfer("all-to-all", buffer, expert_devices, "results home (combine)"),
    ]


def predict_transfers(
    spec: TransformerSpec,
    layout: Layout,
    param_bytes: int = 2,
    activation_bytes: int = 2,
    tp_allreduces_per_layer: int = 4,
    fsdp_gathers: int = 2,
    sequence_parallel: bool = False,
) -> list[Transfer]:
    """The collectives one training step needs on ``layout``, per device, as ``comms``
    would report them.

    - Tensor parallelism (Megatron): per block, an all-reduce of the activations after
      attention and after the MLP going forward, and two for their input gradients going
      back: ``tp_allreduces_per_layer=4`` (6 where Q, K and V are separate matmuls whose
      input gradients are all-reduced one by one). A vocabulary-parallel LM adds two
      more: the embedding lookup going forward, and the gradient of the output
      projection's input going back (the softmax's per-token maximum and sum, 8 bytes a
      token, are left out).
      ``sequence_parallel`` (Megatron's, Korthikanti et al. 2022): each all-reduce
      becomes an all-gather and a reduce-scatter (``tensor_parallel_transfers``), the
      same bytes on a ring.
    - FSDP: every weight gathered ``fsdp_gathers`` times (forward, and again for the
      backward pass), and the gradients reduce-scattered.
    - Data parallelism: the (sharded) gradients all-reduced over ``data``.
    """
    out = []
    local_tokens = spec.tokens / (layout.data * layout.fsdp)
    if layout.tensor > 1:
        size = local_tokens * spec.width * activation_bytes
        count = spec.num_layers * tp_allreduces_per_layer + (
            2 if spec.vocab_parallel else 0
        )
        out += tensor_parallel_transfers(size, layout.tensor, sequence_parallel) * count
    shard = params_per_device(spec, layout) * param_bytes
    if layout.fsdp > 1:
        out += [
            Transfer("all-gather", shard * layout.fsdp, layout.fsdp, "weights (FSDP)")
        ] * fsdp_gathers
        out.append(Transfer("reduce-scatter", shard, layout.fsdp, "gradients (FSDP)"))
    if layout.data > 1:
        out.append(
            Transfer("all-reduce", shard, layout.data, "gradients (data parallel)")
        )
    return out


# --- Compute and memory -------------------------------------------------------------------------


def train_flops(spec: TransformerSpec) -> tuple[float, float]:
    """Flops of one training step (forward and backward, 3x the forward) on the whole global batch.

    Returned as ``(in_blocks, outside)``: tensor parallelism splits the first part, not the second.
    Matmuls: ``6 x params x tokens`` for the block kernels and the per-token weights outside them,
    ``6 x params x sequences`` for a per-sequence head; attention scores and their weighted sum:
    ``3 x 4 x T^2 x H`` per sequence and layer.
    """
    block_matmuls = spec.num_layers * (
        4 * spec.width**2 + 2 * spec.width * spec.mlp_width
    )
    attention = 12 * spec.num_layers * spec.seq_len**2 * spec.width * spec.global_batch
    outside = (
        6 * spec.token_matmul_params * spec.tokens
        + 6 * spec.sequence_matmul_params * spec.global_batch
    )
    return 6 * block_matmuls * spec.tokens + attention, outside


def flops_per_device(spec: TransformerSpec, layout: Layout) -> float:
    """Training flops one device runs: the blocks split over every device, the rest over the batch only
    (over every device too for a vocabulary-parallel LM)."""
    in_blocks, outside = train_flops(spec)
    if spec.vocab_parallel:
        return (in_blocks + outside) / layout.devices
    return in_blocks / layout.devices + outside / (layout.data * layout.fsdp)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The cost model's answer for one model, layout and accelerator (seconds and bytes per device)."""

    model: str
    layout: Layout
    chip: str
    flops: float
    compute_s: float
    comm_s: float
    state_bytes: float
    activation_bytes: float
    transfers: tuple[Transfer, ...]
    problems: tuple[str, ...]

    @property
    def step_s(self) -> float:
        """Compute then communication, no overlap: the slower end of the bracket."""
        return self.compute_s + self.comm_s

    @property
    def overlapped_s(self) -> float:
        """Communication fully hidden behind compute (or the reverse): the faster end."""
        return max(self.compute_s, self.comm_s)

    @property
    def memory_bytes(self) -> float:
        """State and activations per device."""
        return self.state_bytes + self.activation_bytes


def estimate(
    spec: TransformerSpec,
    layout: Layout,
    chip: hardware.Chip | str,
    optimizer: str = "adam",
    precision: str = "mixed",
    flash_attention: bool = False,
    **transfer_options: Any,
) -> Estimate:
    """Step time and memory per device for ``spec`` on ``layout`` devices of ``chip`` (a roofline estimate).

    Compute is ``max(flops / peak, HBM traffic / bandwidth)``; the HBM traffic counts weights read
    twice and gradients written once (at the precision's weight width, 2 bytes in ``mixed``, and at
    their gathered size under FSDP), the optimizer reading and writing its local state, and
    activations written forward and read back. The collectives carry weights and gradients at that
    width too, unless ``param_bytes`` says otherwise.
    """
    chip = _chip(chip)
    flops = flops_per_device(spec, layout)
    state_per_param = memory.bytes_per_param(
        optimizer, precision
    )  # also checks both names
    weight_bytes = memory.PRECISIONS[precision][
        "params"
    ]  # what is gathered, read and sent
    transfer_options.setdefault("param_bytes", weight_bytes)
    local_params = params_per_device(spec, layout)
    state = local_params * state_per_param
    if layout.fsdp > 1:  # the gathered weights of the layer in use and the next one
        state += 2 * weight_bytes * spec.layer_tp_params / layout.tensor
    local_batch = spec.global_batch / (layout.data * layout.fsdp)
    activations = spec.num_layers * layer_activation_bytes(
        spec.seq_len,
        local_batch,
        spec.width,
        spec.num_heads,
        layout.tensor,
        flash_attention,
    )
    logits_split = layout.tensor if spec.vocab_parallel else 1
    activations += (
        local_batch * spec.seq_len * spec.logits_per_token * 4 / logits_split
    )  # fp32, for the loss
    # FSDP reads the gathered weights and writes full gradients before the reduce-scatter; only the
    # optimizer's update touches the local shard.
    gathered_params = spec.tp_params / layout.tensor + (spec.params - spec.tp_params)
    hbm = (
        gathered_params * 3 * weight_bytes
        + local_params * 2 * state_per_param
        + 2 * activations
    )
    compute = max(flops / chip.peak_bf16_flops, hbm / chip.hbm_bytes_per_s)
    transfers = tuple(predict_transfers(spec, layout, **transfer_options))
    return Estimate(
        spec.name,
        layout,
        chip.name,
        flops,
        compute,
        comm_seconds(transfers, chip),
        state,
        activations,
        transfers,
        tuple(check_layout(spec, layout)),
    )


def estimates(
    specs: Sequence[TransformerSpec],
    layouts: Sequence[Layout],
    chip: hardware.Chip | str,
    **options: Any,
) -> dict[str, list[Estimate]]:
    """``estimate`` for every model and layout: ``{model name: [Estimate per layout]}``."""
    return {
        spec.name: [estimate(spec, layout, chip, **options) for layout in layouts]
        for spec in specs
    }


def speedup(base: Estimate, other: Estimate, overlapped: bool = False) -> float:
    """How many times faster ``other`` is than ``base`` (above 1: faster)."""
    if overlapped:
        return base.overlapped_s / other.overlapped_s
    return base.step_s / other.step_s


def table_rows(results: Sequence[Estimate]) -> list[list[Any]]:
    """Rows for ``tables.Table`` (``TABLE_HEADERS``): one per estimate."""
    rows = []
    for e in results:
        rows.append(
            [
                e.model,
                e.layout.label,
                e.compute_s * 1e3,
                e.comm_s * 1e3,
                e.step_s * 1e3,
                e.overlapped_s * 1e3,
                e.memory_bytes / hardware.GB,
                "; ".join(e.problems) or "yes",
            ]
        )
    return rows


TABLE_HEADERS = [
    "model",
    "mesh",
    "compute ms",
    "comm ms",
    "step ms (no overlap)",
    "step ms (overlap)",
    "memory GB",
    "runs as is",
]


def with_batch(spec: TransformerSpec, global_batch: int) -> TransformerSpec:
    """The same model with another global batch."""
    return dataclasses.replace(spec, global_batch=global_batch)


def speedups_over_batch(
    spec: TransformerSpec,
    base: Layout,
    other: Layout,
    chip: hardware.Chip | str,
    global_batches: Sequence[int],
    overlapped: bool = False,
) -> list[float]:
    """``speedup(base, other)`` for each global batch: how the answer to "which mesh?" moves with the batch."""
    return [
        speedup(
            estimate(with_batch(spec, b), base, chip),
            estimate(with_batch(spec, b), other, chip),
            overlapped,
        )
        for b in global_batches
    ]
