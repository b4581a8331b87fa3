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
