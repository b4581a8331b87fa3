"""planning.gpu: the collectives a GPU's program would send."""

import dataclasses

import pytest
from planning_helpers import (
    GPU_8B,
    fsdp_run,
)

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import gpu, layouts, xla_cpu
from jaxdist_lessons.traffic import sent_bytes
from jaxdist_lm import model_config


def test_fsdp_on_a_gpu_sends_three_bf16_copies_of_the_weights_less_one_table():
    """Gathers in the forward and the backward, a reduce-scatter of the gradient, in
    bfloat16; the embedding table is gathered once (the lookup), never in the backward:
    (n-1)/n x 2 bytes x (3 P - V D) a device, a micro-batch; XLA:CPU's are float32."""
    run, fsdp = fsdp_run(GPU_8B)
    P, V, D = (
        model_config.count_params(run.shape),
        run.shape.vocab_size,
        run.shape.width,
    )
    overlapped, exposed = gpu.gpu_transfers(run, fsdp)
    assert exposed == [] and {m.kind for m in overlapped} == {
        "all-gather",
        "reduce-scatter",
    }
    sent = sum(sent_bytes(m) for m in overlapped)
    assert sent == pytest.approx(7 / 8 * 2 * (3 * P - V * D), rel=1e-12)
    twice = dataclasses.replace(run, grad_accum=2)
    again = sum(sent_bytes(m) for m in gpu.gpu_transfers(twice, fsdp)[0])
    assert again == pytest.approx(2 * sent, rel=1e-12)  # gathered each micro-batch
    cpu = dataclasses.replace(run, bytes="xla-cpu")
    assert gpu.priced_transfers(cpu, fsdp)[0] == (
        xla_cpu.weight_transfers(run, fsdp) + xla_cpu.embedding_transfers(run, fsdp)
    )
    assert {m.bytes for m in xla_cpu.weight_transfers(run, fsdp)} != {
        m.bytes for m in overlapped
    }


def test_a_tpu_hides_its_compiled_share_of_the_tensor_axis_activation_collectives():
    """On a TPU, ``TPU_TENSOR_OVERLAP``'s share of each tensor-axis activation
    collective moves from the waited-for list to the hidden one
    (tests/test_tpu_overlap.py ties the shares to the compiled programs); a GPU waits
    for all of them."""
    gpu_run, _ = fsdp_run(GPU_8B)
    layout = layouts.Layout.from_flag("fsdp=2,tensor=4", strategy="published")
    assert gpu.tensor_overlap(gpu_run) == 0.0
    hidden, waited = gpu.gpu_transfers(gpu_run, layout)
    assert {m.axes for m in waited} == {("tensor",)}
    for name, share in gpu.TPU_TENSOR_OVERLAP.items():
        tpu_run = dataclasses.replace(gpu_run, chip=hardware.CHIPS[name])
        assert gpu.tensor_overlap(tpu_run) == share
        tpu_hidden, tpu_waited = gpu.gpu_transfers(tpu_run, layout)
        assert [m.bytes for m in tpu_waited] == [(1 - share) * m.bytes for m in waited]
        assert tpu_hidden[: len(hidden)] == hidden
        moved = tpu_hidden[len(hidden) :]
        assert [m.bytes for m in moved] == [share * m.bytes for m in waited if share]
        assert [m.what for m in moved] == [m.what for m in waited if share]
    # a TPU compiled for no such step: the lowest share
    v6e = dataclasses.replace(gpu_run, chip=hardware.CHIPS["TPU v6e"])
    assert gpu.tensor_overlap(v6e) == min(gpu.TPU_TENSOR_OVERLAP.values())
