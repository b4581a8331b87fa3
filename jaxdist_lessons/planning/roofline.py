"""Chapter 11_pipelines_mesh_shape's roofline estimate of one training step, from ``costmodel``'s flops, memory and
collectives: compute is the slower of the flops at the chip's peak and the HBM traffic at its
bandwidth; communication is the collectives at the interconnect's bandwidth; the step time is
bracketed, with no overlap (``Estimate.step_s``) and full overlap (``Estimate.overlapped_s``);
memory is the training state and the activations kept for the backward pass (Korthikanti et
al. 2022).

What it leaves out, on purpose: kernel efficiency (it assumes peak flops, the case most
favourable to communication mattering), latency per collective, and pipelines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxdist_lessons import hardware, memory
from jaxdist_lessons.activations import layer_activation_bytes
from jaxdist_lessons.planning.costmodel import (
    TransformerSpec,
    check_layout,
    flops_per_device,
    params_per_device,
    predict_transfers,
    with_batch,
)
from jaxdist_lessons.planning.layouts import Layout
from jaxdist_lessons.traffic import Transfer, comm_seconds


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
    # also checks both names
    state_per_param = memory.bytes_per_param(optimizer, precision)
    # what is gathered, read and sent
    weight_bytes = memory.PRECISIONS[precision]["params"]
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
    # fp32, for the loss
    activations += local_batch * spec.seq_len * spec.logits_per_token * 4 / logits_split
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
