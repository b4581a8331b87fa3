"""planning.efficiency: published runs' share of their chip's peak, and the models fitted to it."""

import dataclasses
import math

import pytest

from jaxdist_lessons.planning import efficiency, published
from jaxdist_lm import model_config

RUNS = {run.name: run for run in published.load_runs()}
GPT_1_7B = RUNS["Megatron-LM GPT 1.7B, 32 A100, TP 1 x PP 1 x DP 32"]


def test_a_gelu_gpt_counts_megatrons_flops_without_the_recomputation():
    """Megatron-LM's Eq. 3 counts 96 l h^2 (1 + s/6h + V/16lh) a token with the forward
    recomputed (four passes); three passes of the same model are 72 l h^2 (1 + s/6h +
    V/12lh): exactly the planner's count for a GeLU MLP of 4h and tied embeddings."""
    m, s = GPT_1_7B.model, GPT_1_7B.seq_len
    layers, h, v = m.layers, m.width, m.vocab
    megatron = 72 * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    assert efficiency.model_flops_per_token(GPT_1_7B) == pytest.approx(megatron)
    # Megatron's teraFLOP/s already hold the recomputation: 137 of the A100's 312
    assert efficiency.utilisation(GPT_1_7B).value == pytest.approx(137 / 312)


def test_a_swiglu_model_counts_as_the_planner_does():
    run = RUNS["torchtitan Llama 2 13B, 64 A100, FSDP, no remat"]
    m = run.model
    config = model_config.ModelConfig(m.vocab, m.layers, m.width, m.heads, 40, m.ffn)
    assert efficiency.model_flops_per_token(run) == model_config.flops_per_token(
        config, run.seq_len
    )
    assert efficiency.utilisation(run).value == pytest.approx(0.611)  # MFU, no remat


def test_each_unit_becomes_a_share_of_the_peak_with_full_remat_counted():
    maxtext = RUNS["MaxText 16B, 1x v5e-256 (256 chips), FSDP 256"]
    assert maxtext.remat == "full" and maxtext.measured.unit == "TFLOP/s/chip"
    expected = maxtext.measured.value / 197 * 4 / 3  # the v5e's 197 TFLOP/s
    assert efficiency.utilisation(maxtext).value == pytest.approx(expected)
    toolbox = RUNS["JAX-Toolbox MaxText Llama 2 7B, 8 H100, FSDP"]
    per_chip = toolbox.measured.value * toolbox.seq_len / toolbox.devices
    flops = efficiency.model_flops_per_token(toolbox)
    assert efficiency.utilisation(toolbox).value == pytest.approx(
        per_chip * flops / 989e12
    )
    playbook = RUNS["Playbook 8B, 8 H100, DP 2 x TP 1 x PP 4, ZeRO-1"]
    assert efficiency.model_flops_per_token(playbook) is None  # no shape published
    assert efficiency.utilisation(playbook).value == pytest.approx(0.452)
    assert efficiency.utilisation(playbook).how == "MFU as published (no model shape)"


def test_runs_the_planner_cannot_price_say_why():
    fp8 = RUNS["torchtitan Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, Float8"]
    assert efficiency.utilisation(fp8).value is None
    reasons = {efficiency.utilisation(run).how for run in RUNS.values()}
    assert "H100 96GB HBM2e (500 W) is not in hardware.CHIPS" in reasons
    fp8_chip = dataclasses.replace(fp8, chip="H100 80GB")
    assert efficiency.utilisation(fp8_chip).how.startswith("Float8 matmuls")


def synthetic(chip: str, width: int, value: float, split: str = "fit"):
    run = dataclasses.replace(
        GPT_1_7B,
        chip=chip,
        split=split,
        model=dataclasses.replace(GPT_1_7B.model, width=width),
    )
    return efficiency.Utilisation(run, value, "synthetic")


def test_the_fit_recovers_a_power_law_shared_by_the_chips():
    law = {"A100 80GB": 0.5, "TPU v5e": 0.8}
    rows = [
        synthetic(chip, width, base * (width / 8192) ** 0.2)
        for chip, base in law.items()
        for width in (2048, 8192, 16384)
    ]
    rows.append(synthetic("TPU v5e", 4096, 0.01, split="held_out"))  # not fitted
    fitted = efficiency.fit(rows)
    assert fitted.width_power == pytest.approx(0.2)
    assert fitted.per_chip_at_reference == pytest.approx(law)
    mean = math.exp(sum(math.log(r.value) for r in rows[:-1]) / 6)
    assert fitted.constant == pytest.approx(mean)
    # the geometric mean of widths 1/4, 1 and 2 of the reference: 1/2 to the power 1/3
    assert fitted.per_chip["TPU v5e"] == pytest.approx(0.8 * 0.5 ** (0.2 / 3))
    wide = synthetic("TPU v5e", 16384, 1.0).run
    assert fitted.predict("per chip and width", wide) == pytest.approx(0.8 * 2**0.2)
    elsewhere = synthetic("H100 80GB", 8192, 1.0).run  # no fitted run: the constant
    assert fitted.predict("per chip", elsewhere) == fitted.constant
    with pytest.raises(ValueError, match="unknown model 'linear'"):
        fitted.predict("linear", wide)
    held = efficiency.ratios(fitted, rows, "per chip and width", "held_out")
    assert held == pytest.approx([0.8 * 0.5**0.2 / 0.01])
    with pytest.raises(ValueError, match="no fitted run"):
        efficiency.fit(rows[-1:])


def test_good_is_within_three_quarters_and_four_thirds():
    assert efficiency.share_good([0.75, 1.33, 0.74, 1.34]) == 0.5


def test_remat_policies_count_the_forward_they_run_again():
    """Full remat: the whole forward again (4/3). MaxText's qkv_proj_offloaded keeps only
    the query, key and value projections: the rest of the forward again. torchtitan's
    selective op-level checkpointing: half of the weights' forward again."""
    full = RUNS["MaxText 16B, 1x v5e-256 (256 chips), FSDP 256"]
    assert efficiency.remat_factor(full) == 4 / 3
    offloaded = RUNS[
        "MaxText 128B, 8x v5e-256 (2048 chips), FSDP 16 x TP 16 x DCN data 8"
    ]
    m = offloaded.model
    qkv = 2 * m.layers * m.width * (m.heads + 2 * m.kv_heads) * m.head_dim
    forward = efficiency.model_flops_per_token(offloaded) / 3
    assert efficiency.remat_factor(offloaded) == pytest.approx(
        1 + (forward - qkv) / (3 * forward)
    )
    assert 1.25 < efficiency.remat_factor(offloaded) < 4 / 3
    selective = RUNS["torchtitan Llama 3 8B, 64 A100, FSDP"]
    flops = efficiency.model_flops_per_token(selective)
    weights = flops - efficiency.attention_flops_per_token(selective)
    assert efficiency.remat_factor(selective) == pytest.approx(
        1 + weights / 2 / (3 * flops)
    )
    minimal = RUNS["MaxText 32B, 1x v5p-128 (64 chips), FSDP 16 x TP 4"]
    assert minimal.remat == "minimal" and efficiency.remat_factor(minimal) == 1.0
