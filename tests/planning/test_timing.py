"""planning.timing: overlapped and exposed collectives in the step time."""

import dataclasses

import pytest
from planning_helpers import (
    GPU_8B,
    fsdp_run,
)

from jaxdist_lessons.planning import (
    gpu,
    layouts,
    timing,
)


def test_overlap_hides_fsdps_collectives_and_waits_for_tensor_parallelisms():
    run, fsdp = fsdp_run(GPU_8B)
    t = timing.step_seconds(run, fsdp)
    assert t["exposed"] == 0 and t["step"] == max(t["compute"], t["overlapped"])
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


def test_a_tpu_collective_is_priced_on_bandwidth_alone():
    run, fsdp = fsdp_run([*GPU_8B[:4], "--chip", "TPU v5p", "--global-batch", "8"])
    gather = gpu.gpu_weight_transfers(run, fsdp)[0]
    assert gather.calls > 1 and timing.latency_seconds(run, fsdp, gather) == 0


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
