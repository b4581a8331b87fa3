"""planning.gpu: the collectives a GPU's program would send."""

import dataclasses

import pytest
from planning_helpers import (
    GPU_8B,
    fsdp_run,
)

from jaxdist_lessons.planning import gpu, model_config, xla_cpu
from jaxdist_lessons.traffic import sent_bytes


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
