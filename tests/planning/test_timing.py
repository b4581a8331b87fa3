"""planning.timing: overlapped and exposed collectives in the step time."""

import dataclasses

import pytest
from planning_helpers import (
    GPU_8B,
    fsdp_run,
)

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import (
    gpu,
    layouts,
    timing,
)


def test_overlap_hides_fsdps_collectives_and_waits_for_tensor_parallelisms():
    run, fsdp = fsdp_run(GPU_8B)
    t = timing.step_seconds(run, fsdp)
    # all but the first gather and the last reduction (timing.ends), which wait
    overlapped, _ = gpu.priced_transfers(run, fsdp)
    edges = timing.collective_seconds(run, fsdp, timing.ends(overlapped))
    assert t["exposed"] == pytest.approx(edges) and 0 < edges < t["overlapped"] / 30
    assert t["step"] == pytest.approx(max(t["compute"], t["overlapped"]) + edges)
    tp = layouts.Layout.from_flag("fsdp=4,tensor=2", strategy="FSDP+TP")
    t = timing.step_seconds(run, tp)
    assert t["exposed"] > 0
    assert t["step"] == pytest.approx(max(t["compute"], t["overlapped"]) + t["exposed"])
    # Megatron's sequence parallelism: 6 all-gathers and 6 reduce-scatters a layer under
    # remat (forward, its recomputation, backward), 4 and 4 without; bf16 activations
    [gather, scatter] = gpu.gpu_activation_transfers(run, tp)
    whole = 2 * 4 * 4096 * 4096  # bf16 bytes of (B, T, D): 4 rows a device, 16 over 4
    assert gather.bytes == (6 * 32 + 2) * whole and scatter.bytes == gather.bytes / 2
    none = dataclasses.replace(run, remat="none")
    assert gpu.gpu_activation_transfers(none, tp)[0].bytes == (4 * 32 + 2) * whole


def test_each_collective_pays_nccls_latency_per_call_and_per_ring_step():
    """8B under FSDP on 16 GPUs over 2 nodes: a ring of 16 steps 15 times, 2 of its 16
    edges across nodes; 2 x 33 gathers a step (each layer's, then the output projection,
    in both passes) and the table's lookup once, untied."""
    flags = ["--model", "8b", "--devices", "16", "--nodes", "2"]
    run, fsdp = fsdp_run([*flags, "--seq-len", "4096", "--global-batch", "32"])
    gather = gpu.gpu_weight_transfers(run, fsdp)[0]
    assert (gather.kind, gather.calls, gather.group_size) == ("all-gather", 67, 16)
    nccl = timing.NCCL_LATENCY
    across = 15 * 2 / 16
    each = nccl["base"] + (15 - across) * nccl["inside"] + across * nccl["across"]
    assert timing.latency_seconds(run, fsdp, gather) == pytest.approx(67 * each)
    # the bandwidth's time and the latency, one after the other
    alone = timing.collective_seconds(run, fsdp, [gather])
    no_latency = dataclasses.replace(gather, calls=0)
    assert alone == pytest.approx(
        timing.collective_seconds(run, fsdp, [no_latency]) + 67 * each
    )


def test_a_tpu_collective_pays_a_microsecond_a_hop_of_its_torus():
    """8 v5p chips: a 2x2x2 corner of the 3D torus, one hop along each of its three
    axes (the scaling book's ceil(|X| / 2) an axis, both ways at once), 1 us each, for
    each of 67 gathers; on a v5e's 2D torus, 16 chips as 4 x 4, 2 + 2 hops, and 8
    no more than half a ring of them, 4; an all-reduce twice a gather's."""
    run, fsdp = fsdp_run([*GPU_8B[:4], "--chip", "TPU v5p", "--global-batch", "8"])
    gather = gpu.gpu_weight_transfers(run, fsdp)[0]
    assert (gather.calls, gather.group_size) == (67, 8)
    assert timing.torus_hops(run.chip, 8) == 3
    assert timing.latency_seconds(run, fsdp, gather) == pytest.approx(67 * 3e-6)
    v5e = hardware.CHIPS["TPU v5e"]
    assert [timing.torus_hops(v5e, g) for g in (2, 4, 8, 16, 256)] == [1, 2, 4, 4, 16]
    reduce = dataclasses.replace(gather, kind="all-reduce", calls=1)
    assert timing.latency_seconds(run, fsdp, reduce) == pytest.approx(6e-6)
    # 1,024 v5p chips, 8x8x16: 4 + 4 + 8 hops, against a ring's 512
    assert timing.torus_hops(run.chip, 1024) == 18 < 512


def test_the_first_gather_and_the_last_reduction_wait_behind_no_compute():
    """Of the weights' gathers and the gradients' reductions, one call each (the
    first layer's gather before any compute, its reduction after the backward) is
    exposed; a pipeline's sends are not weights and stay hidden."""
    run, fsdp = fsdp_run(GPU_8B)
    overlapped, _ = gpu.priced_transfers(run, fsdp)
    edges = timing.ends(overlapped)
    assert {m.what for m in edges} == {"weights (FSDP)", "gradients (FSDP)"}
    for edge in edges:
        [move] = [m for m in overlapped if m.what == edge.what]
        assert edge.calls == 1 and edge.bytes == pytest.approx(move.bytes / move.calls)
    sends = dataclasses.replace(overlapped[0], what="activations", calls=8)
    assert timing.ends([sends]) == []


def test_a_gather_over_the_network_is_exposed_when_compute_is_too_short_to_hide_it():
    """FSDP of 8b over 4 nodes: with 64 sequences of 4,096 a step its gathers hide
    behind the compute; with 4, the compute is 16 times shorter, the network's time
    the same, and what the compute cannot cover is waited for."""
    flags = ["--model", "8b", "--devices", "32", "--nodes", "4", "--seq-len", "4096"]
    big, fsdp = fsdp_run([*flags, "--global-batch", "64"])
    small, _ = fsdp_run([*flags, "--global-batch", "4"])
    hidden = timing.step_seconds(big, fsdp)
    short = timing.step_seconds(small, fsdp)
    assert hidden["compute"] > hidden["overlapped"]
    assert hidden["step"] == pytest.approx(hidden["compute"] + hidden["exposed"])
    assert short["overlapped"] > short["compute"]
    assert short["step"] == pytest.approx(short["overlapped"] + short["exposed"])
    assert short["step"] - short["compute"] > short["overlapped"] - short["compute"] > 0


def test_data_x_tensor_all_reduces_the_gradients_a_device_holds():
    """Without FSDP, each device reduces its own tensor-split share of the gradients
    over the data axis, not the whole model's."""
    run, _ = fsdp_run(GPU_8B)
    both = layouts.Layout(data=2, tensor=4, strategy="published")
    [reduce] = gpu.gpu_weight_transfers(run, both)
    [whole] = gpu.gpu_weight_transfers(run, layouts.Layout(data=8, strategy="DP"))
    m = run.shape
    held = (
        m.num_layers
        * (
            (m.width * m.head_width * (2 * m.num_heads + 2 * m.num_kv_heads))
            + 3 * m.width * m.mlp_width
        )
        / 4
        + m.num_layers * 2 * m.width
        + m.width
        + 2 * m.vocab_size * m.width / 4
    )
    assert reduce.bytes == run.itemsize * held < whole.bytes
    assert reduce.calls == whole.calls == m.num_layers + 2


def test_hsdp_with_tensor_reduces_over_data_the_share_a_device_holds():
    """FSDP beside tensor parallelism, replicas across: the all-reduce over data moves
    a device's tensor-split share, split again over fsdp."""
    run, _ = fsdp_run(GPU_8B)
    hsdp = layouts.Layout(data=2, fsdp=2, tensor=2, strategy="HSDP+TP")
    [over_data] = [
        move
        for move in gpu.gpu_weight_transfers(run, hsdp)
        if move.what == "gradients over data"
    ]
    both = layouts.Layout(data=4, tensor=2, strategy="DP+TP")
    [whole] = gpu.gpu_weight_transfers(run, both)
    assert over_data.bytes == whole.bytes / 2
