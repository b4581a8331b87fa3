"""planning.against_published: each published run as the planner's request and layout, its
step predicted, and the per-chip compute efficiency the planner uses, refitted here."""

from __future__ import annotations

import dataclasses

import pytest

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import against_published, efficiency, published, timing
from jaxdist_lessons.strategies import NAMES
from jaxdist_lm.model_config import flops_per_token

RUNS = {run.name: run for run in published.load_runs()}


def test_the_planners_efficiencies_are_the_ones_fitted_on_the_fit_split():
    fitted = against_published.fit()
    assert fitted.per_chip == timing.COMPUTE_EFFICIENCY
    assert fitted.constant == timing.EFFICIENCY_ELSEWHERE


def test_a_chip_without_fitted_runs_takes_its_familys_lowest_or_the_constant():
    chip = hardware.chip
    assert timing.compute_efficiency(chip("H200 141GB")) == 0.53  # H100 80GB's peak
    assert timing.compute_efficiency(chip("H100 PCIe")) == 0.53  # its family
    assert timing.compute_efficiency(chip("A100 80GB PCIe")) == 0.56  # of 0.56, 0.68
    assert timing.compute_efficiency(chip("B200")) == timing.EFFICIENCY_ELSEWHERE
    assert timing.compute_efficiency(chip("TPU v6e")) == timing.EFFICIENCY_ELSEWHERE


def test_a_gelu_mlp_becomes_a_swiglu_of_two_thirds_its_width():
    run = RUNS["Megatron-LM GPT-3 175B, 1536 A100, ZeRO-3"]
    shape = against_published.planner_shape(run)
    assert (shape.mlp_width, run.model.ffn) == (32_768, 49_152)
    assert flops_per_token(shape, run.seq_len) == efficiency.model_flops_per_token(run)
    # 16,384 * 2 / 3 is not whole: rounded, less than a ten-thousandth off
    odd = RUNS["Megatron-LM GPT 7.5B, 128 A100, TP 4 x PP 1 x DP 32"]
    ratio = flops_per_token(
        against_published.planner_shape(odd), odd.seq_len
    ) / efficiency.model_flops_per_token(odd)
    assert ratio != 1 and ratio == pytest.approx(1, abs=1e-4)


@pytest.mark.parametrize(
    "name, sizes, strategy",
    [
        (
            "Megatron-LM GPT 1008.0B, 3072 A100, TP 8 x PP 64 x DP 6",
            {"data": 6, "tensor": 8, "stages": 64},
            "published",
        ),
        ("Megatron-LM GPT-3 175B, 768 A100, ZeRO-3", {"fsdp": 768}, "published"),
        ("llm-foundry MPT-3b, 128 H100 80GB, SHARD_GRAD_OP", {"data": 128}, "ZeRO-2"),
        (
            "MaxText 128B, 8x v5e-256 (2048 chips), FSDP 16 x TP 16 x DCN data 8",
            {"data": 8, "fsdp": 16, "tensor": 16},
            "published",
        ),
    ],
)
def test_the_published_layouts_as_planner_layouts(name, sizes, strategy):
    layout = against_published.planner_layout(RUNS[name])
    assert {k: getattr(layout, k) for k in sizes} == sizes
    assert layout.devices == RUNS[name].devices and layout.strategy == strategy
    assert strategy == "published" or strategy == NAMES["zero2"]


def test_a_run_whose_collectives_hide_is_predicted_at_efficiency_over_its_hfu():
    """Compute and the waited-for collectives set the step (the rest hidden):
    predicted over measured is the chip's efficiency over the run's HFU, whatever its
    remat policy, scaled by the compute's share of the step."""
    run = RUNS["MaxText 16B, 1x v5e-256 (256 chips), FSDP 256"]
    measured = efficiency.utilisation(run)
    p = against_published.predict(run, measured, 0.8)
    t = p.seconds
    assert 0 < t["exposed"] < t["overlapped"] < t["compute"]
    assert t["step"] == pytest.approx(t["compute"] + t["exposed"])
    share = t["compute"] / t["step"]
    assert p.ratio == pytest.approx(0.8 / measured.value * share, rel=1e-12)


def test_every_run_is_predicted_or_says_why_not():
    predictions = against_published.predict_all()
    assert len(predictions) == len(RUNS)
    why = {p.run.name: p.why_not for p in predictions if p.ratio is None}
    assert all(why.values()) and all(p.why_not == "" for p in predictions if p.ratio)
    assert why["Playbook 8B, 8 H100, DP 2 x TP 1 x PP 4, ZeRO-1"] == (
        "the source gives no model shape"
    )
    assert "not in hardware.CHIPS" in why["torchtitan Llama 3.1 8B, 8 H100, FSDP"]
    assert why[
        "Llama 3 405B, 16,384 H100, TP 8 x CP 16 x PP 16 x DP 4, seq 131,072"
    ] == ("its axes make 8192 devices, not 16384")


def test_a_pipeline_costs_its_bubble_in_the_prediction():
    """Fewer sequences a step leave a larger bubble: a slower predicted step."""
    run = RUNS["Megatron-LM GPT 1008.0B, 3072 A100, TP 8 x PP 64 x DP 6"]
    measured = efficiency.utilisation(run)
    smaller = dataclasses.replace(
        run, layout=dataclasses.replace(run.layout, global_batch=768)
    )
    full = against_published.predict(run, measured, 0.55).seconds["compute"]
    less = against_published.predict(smaller, measured, 0.55).seconds["compute"]
    # 512 micro-batches a replica against 128 over 63 filling steps
    assert less / full == pytest.approx(
        (1 - 63 / (512 + 63)) / (1 - 63 / (128 + 63)) / 4
    )


def test_the_planner_ranks_a_published_layout_among_its_own_rows():
    predictions = {p.run.name: p for p in against_published.predict_all() if p.ratio}
    first, rows = against_published.published_rank(
        predictions["MaxText 16B, 1x v5e-256 (256 chips), FSDP 256"]
    )
    assert first == 1 and rows[0]["mesh"] == "fsdp=256"
    # 16,384 * 2 / 3 rounds to 10,923 MLP units, which 4 tensor shards cannot split
    missing, rows = against_published.published_rank(
        predictions["Megatron-LM GPT 7.5B, 128 A100, TP 4 x PP 1 x DP 32"]
    )
    assert missing is None and "data=32,tensor=4" not in {r["mesh"] for r in rows}


def test_multislice_runs_keep_fsdp_inside_a_slice_and_data_across():
    """MaxText's 32B on 32 v5e slices: every row has `data` across the slices (the
    recipe's rule), and the published layout, FSDP in each slice, is the first."""
    predictions = {p.run.name: p for p in against_published.predict_all() if p.ratio}
    name = "MaxText 32B, 32x v5e-256 (8192 chips), FSDP 256 x DCN data 32"
    first, rows = against_published.published_rank(predictions[name])
    assert first == 1 and rows[0]["mesh"] == "data=32,fsdp=256"
    sizes = [
        dict(axis.split("=") for axis in r["mesh"].split(" (")[0].split(","))
        for r in rows
    ]
    assert all(int(size.get("data", 1)) % 32 == 0 for size in sizes)
    assert "fsdp=8192" not in {r["mesh"] for r in rows}


def test_a_tie_goes_to_the_layout_with_fewer_axes():
    """Megatron's 1.7B on 32 A100s: data parallelism alone and HSDP both hide their
    collectives behind the same compute; the single axis ranks first."""
    predictions = {p.run.name: p for p in against_published.predict_all() if p.ratio}
    name = "Megatron-LM GPT 1.7B, 32 A100, TP 1 x PP 1 x DP 32"
    first, rows = against_published.published_rank(predictions[name])
    assert first == 1 and rows[0]["mesh"] == "data=32"
    hsdp = next(r for r in rows if r["mesh"] == "data=4,fsdp=8")
    assert hsdp["step_seconds"] < 1.01 * rows[0]["step_seconds"]
    assert hsdp["sent_bytes"]["across"] < rows[0]["sent_bytes"]["across"]
