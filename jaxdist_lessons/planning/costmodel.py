"""Chapter 11_pipelines_mesh_shape's cost model of one training step: a Transformer's flops, weights and
collectives per device, for a layout of the devices.

For a Transformer (a ViT or a GPT-style LM) it counts:

- **compute**: the step's flops per device (``flops_per_device``), split as the layout splits
  the blocks and the rest;
- **communication**: the collectives the layout needs (``predict_transfers``), each as
  ``comms`` reports one read from a compiled program (kind, bytes of its result on one device,
  group size), so prediction and compiler can be compared line by line
  (``layer_collectives.transfers_from_hlo``);
- **memory**: the parameters each device holds (``params_per_device``).

``roofline`` turns them into seconds and bytes per device on a chip (the roofline estimate),
and ``layer_collectives`` holds one layer's collectives for chapters 12_long_sequences and 13_experts.

A layout is the planner's ``Layout`` (``planning.layouts``) on its ``data``, ``fsdp`` and
``tensor`` axes: batch split ``data x fsdp`` ways, parameters split over ``fsdp`` (ZeRO-3),
attention heads and MLP units split over ``tensor`` (Megatron tensor parallelism). ``(8, 1)`` in
the article's notation is ``Layout(data=8)``, ``(4, 2)`` is ``Layout(data=4, tensor=2)``. The
sizes follow the planner's vocabulary: ``width``, ``mlp_width``, ``chip``.

Where this model teaches (any Transformer, ViTs included, checked against compiled programs on
simulated devices), the planner (``python -m jaxdist_lessons.planning``) predicts the recipe's
runs on GPUs: bytes as a GPU sends them, a fitted compute efficiency, overlap.
"""

from __future__ import annotations

import dataclasses

from jaxdist_lessons import memory

# traffic.py's and activations.py's arithmetic, re-exported for chapter 11_pipelines_mesh_shape's cells.
from jaxdist_lessons.activations import layer_activation_bytes as layer_activation_bytes
from jaxdist_lessons.models.vit import vit_params
from jaxdist_lessons.planning.layer_collectives import tensor_parallel_transfers
from jaxdist_lessons.planning.layouts import Layout
from jaxdist_lessons.traffic import Transfer
from jaxdist_lessons.traffic import sent_bytes as sent_bytes

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
        problems.append(
            f"the cost model has data, fsdp and tensor axes only, not "
            f"{', '.join(others or ['pipeline stages'])}"
        )
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


def with_batch(spec: TransformerSpec, global_batch: int) -> TransformerSpec:
    """The same model with another global batch."""
    return dataclasses.replace(spec, global_batch=global_batch)
