"""From bytes to seconds: which share of each ring crosses nodes, the bytes each device sends
inside its node, across nodes and to its host, and the step time: the matmuls at
``compute_efficiency`` of the chip's peak (fitted per chip to published runs), the
overlapped collectives hidden behind the compute but for what no compute can hide (the
first gather, the last reduction, and whatever outlasts the compute), the exposed ones
added; each collective with its latency per call and per hop (NCCL's on a GPU, the ICI's
on a TPU).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

from jaxdist_lessons import hardware
from jaxdist_lessons.bubble import bubble_fraction
from jaxdist_lessons.planning.footprint import host_bytes
from jaxdist_lessons.planning.gpu import priced_transfers
from jaxdist_lessons.planning.layouts import AXES, Layout, Run
from jaxdist_lessons.traffic import Transfer, ring_steps, sent_bytes
from jaxdist_lm.model_config import flops_per_token


def crossing_share(run: Run, c: Layout, axes: Sequence[str]) -> float:
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


def link_bytes(run: Run, c: Layout, moves: Sequence[Transfer]) -> dict[str, float]:
    """Bytes one device sends per step (ring algorithms) inside its node and across nodes
    (``crossing_share`` of each collective's), and to its host and back (``--offload``)."""
    out = {"inside": 0.0, "across": 0.0, "host": host_bytes(run, c)}
    for move in moves:
        sent, share = sent_bytes(move), crossing_share(run, c, move.axes)
        out["across"] += share * sent
        out["inside"] += (1 - share) * sent
    return out


# Of the chip's datasheet peak that a step's matmuls reach: FITTED per chip, end to end
# (this module's step, collectives and all), to the runs split "fit" in
# book/data/published_runs.json (``against_published.fit``: the least sum of absolute
# log errors, so a few runs the planner cannot explain do not pull the rest;
# tests/planning/test_against_published.py refits them). --efficiency overrides it.
COMPUTE_EFFICIENCY = {
    "A100 40GB": 0.68,
    "A100 80GB": 0.56,
    "H100 80GB": 0.53,
    "TPU v5e": 0.80,
    "TPU v5p": 0.74,
}
# For a chip no published run was fitted on: one number fitted on every chip's runs.
EFFICIENCY_ELSEWHERE = 0.64


def compute_efficiency(chip: hardware.Chip) -> float:
    """The planner's fraction of ``chip``'s peak: its own fitted number; else the lowest
    of the fitted chips of its family or with its bfloat16 peak (an H200 has an H100's
    989 TFLOP/s; only its memory differs); else ``EFFICIENCY_ELSEWHERE``."""
    if chip.name in COMPUTE_EFFICIENCY:
        return COMPUTE_EFFICIENCY[chip.name]
    kin = [
        value
        for name, value in COMPUTE_EFFICIENCY.items()
        for fitted in [hardware.CHIPS[name]]
        if fitted.family == chip.family
        or fitted.peak_bf16_flops == chip.peak_bf16_flops
    ]
    return min(kin, default=EFFICIENCY_ELSEWHERE)


def remat_flops(run: Run) -> float:
    """The flops a step runs over the model's: remat 'full' runs each layer's forward
    again (4/3: the forward is a third of 6 flops per weight and token); 'dots' only the
    attention's two batched matmuls (4 x layers x T x N x A a token), whose outputs it does not keep."""
    if run.remat == "full":
        return 4 / 3
    if run.remat == "dots":
        m = run.shape
        attention = 4 * m.num_layers * run.seq_len * m.num_heads * m.head_width
        return 1 + attention / flops_per_token(m, run.seq_len)
    return 1.0


# NCCL's own latency model for a ring with its Simple protocol (the one large messages
# use), in seconds: a launch costs BASE, and each step of the ring a hop inside a node
# (NVLink) or across nodes (the network). From NCCL's src/graph/tuning.cc, baseLat and
# hwLat, Ring / Simple: 8.4, 3.4 (NVLink) and 14.0 (NET) microseconds
# (https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc).
NCCL_LATENCY = {"base": 8.4e-6, "inside": 3.4e-6, "across": 14.0e-6}
# A hop over a TPU's ICI link: "Each hop over an ICI link has some intrinsic overhead
# regardless of the data volume. This is typically around 1us" (the scaling book,
# https://jax-ml.github.io/scaling-book/sharding/, "A note on ICI latency"). No figure
# per DCN hop is published; a hop between slices is priced as one over ICI, a floor.
ICI_HOP_SECONDS = 1e-6


def torus_hops(chip: hardware.Chip, group: int) -> int:
    """Hops for a gather around ``group`` chips of a TPU's torus, both ways at once:
    half of each torus axis it spans (the scaling book's bidirectional AllGather,
    ceil(|X| / 2) hops an axis), over as few axes as hold it (``ici_links`` / 2 axes,
    each the group's d-th root long); never more than a ring of them all, ceil(G / 2)."""
    axes = max(1, (chip.ici_links or 2) // 2)
    side = math.ceil(round(group ** (1 / axes), 9))
    return max(1, min(math.ceil(group / 2), axes * math.ceil(side / 2)))


def latency_seconds(run: Run, c: Layout, move: Transfer) -> float:
    """The latency of ``move``'s collectives, however few bytes they carry. On a GPU,
    per call, NCCL's launch and one hop per step of its ring, the ring's share across
    nodes (``crossing_share``) at the network's latency. On a TPU, per call,
    ``ICI_HOP_SECONDS`` a hop of ``torus_hops`` (twice for an all-reduce: a
    reduce-scatter, then a gather; one for a permute)."""
    if run.chip.name.startswith("TPU"):
        if move.kind == "collective-permute" or move.group_size is None:
            hops = 1
        else:
            hops = torus_hops(run.chip, move.group_size)
            hops *= 2 if move.kind == "all-reduce" else 1
        return move.calls * hops * ICI_HOP_SECONDS
    steps = ring_steps(move)
    across = crossing_share(run, c, move.axes) * steps
    hops = (steps - across) * NCCL_LATENCY["inside"] + across * NCCL_LATENCY["across"]
    return move.calls * (NCCL_LATENCY["base"] + hops)


def collective_seconds(run: Run, c: Layout, moves: Sequence[Transfer]) -> float:
    """Seconds to send ``moves`` one after another, each a ring whose sends inside the node
    and across it run at once, on NVLink and the network adapters (the slower sets the
    pace), plus each call's latency (``latency_seconds``)."""
    chip, total = run.chip, 0.0
    for move in moves:
        sent, share = sent_bytes(move), crossing_share(run, c, move.axes)
        across = share * sent / chip.network_bytes_per_s if share else 0.0
        total += max((1 - share) * sent / chip.link_bytes_per_s, across)
        total += latency_seconds(run, c, move)
    return total


def ends(moves: Sequence[Transfer]) -> list[Transfer]:
    """The calls of ``moves`` that no compute can hide: a step's first gather of the
    weights (the first layer's, before any layer has run) and its last reduction of
    the gradients (the first layer's, after the backward has ended), one call of each
    collective that gathers weights or reduces gradients a layer at a time."""
    return [
        dataclasses.replace(m, bytes=m.bytes / m.calls, calls=1)
        for m in moves
        if m.what.startswith(("weights", "gradients")) and m.calls > 1
    ]


def step_seconds(
    run: Run, c: Layout, moves: tuple[list, list] | None = None
) -> dict[str, float]:
    """Predicted seconds: the compute at ``compute_efficiency`` of the chip's peak, with
    remat's extra flops and a pipeline's bubble; the collectives that overlap with it
    (and the host copies) hidden behind it up to its length, but for the first gather
    and the last reduction (``ends``), which wait; the exposed ones added."""
    chip = run.chip
    overlapped, exposed = moves or priced_transfers(run, c)
    flops = flops_per_token(run.shape, run.seq_len) * run.global_batch * run.seq_len
    peak = chip.peak_bf16_flops if run.dtype == "bfloat16" else chip.peak_fp32_flops
    efficiency = run.efficiency or compute_efficiency(chip)
    compute = flops * remat_flops(run) / run.devices / (peak * efficiency)
    if c.stages > 1:
        micro = run.global_batch // c.batch_ways
        compute /= 1 - bubble_fraction(c.stages, micro, c.virtual)
    hidden = collective_seconds(run, c, overlapped)
    if c.offload:
        hidden += host_bytes(run, c) / chip.host_bytes_per_s
    edges = collective_seconds(run, c, ends(overlapped))
    hidden -= edges
    waited = collective_seconds(run, c, exposed) + edges
    step = max(compute, hidden) + waited
    return {
        "compute": compute,
        "overlapped": hidden,
        "exposed": waited,
        "comm": hidden + waited,
        "step": step,
        "mfu": flops / step / (run.devices * peak),
    }
