"""How much of a chip's peak published runs reach, and whether one number per chip predicts
the runs it was not fitted to.

Each run of ``book/data/published_runs.json`` (``published.load_runs``) gives its
throughput in its source's unit. ``utilisation`` turns that into the run's hardware flops
utilisation (HFU): the model's training flops a second (``model_config.flops_per_token``'s
count), times what its remat policy runs again (``remat_factor``), over the chip's dense
bfloat16 peak (``hardware.CHIPS``). That is the planner's ``timing.compute_efficiency`` as
one run measured it, with whatever communication the run left exposed inside it.

``fit`` fits three models on the runs whose split is "fit" and predicts every run:

- ``one constant``: one utilisation for every chip (the planner's approach before
  ``against_published`` fitted one per chip);
- ``per chip``: one utilisation per chip;
- ``per chip and width``: per chip, times a power of the model's width, the same power
  for every chip (wider matrices keep the units busier).

A prediction's error is predicted / measured throughput, which for a fixed model and
layout is the predicted over the measured utilisation. Standard library only, like the
rest of ``planning``.
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import published
from jaxdist_lm import model_config

# Within this of the measured throughput, a prediction is counted good (issue 59's goal).
GOOD = (0.75, 1.33)
MODELS = ("one constant", "per chip", "per chip and width")
# A GeLU MLP (GPT, MPT) has two matrices of D x F, a SwiGLU MLP three.
MLP_MATRICES = {"gelu": 2, "swiglu": 3}
# A width the power law is centred on, so a chip's constant reads as its utilisation there.
REFERENCE_WIDTH = 8192


@dataclasses.dataclass(frozen=True)
class Utilisation:
    """One run's measured hardware flops utilisation, or why it has none."""

    run: published.PublishedRun
    value: float | None
    how: str  # which published figure it came from, or why none


def shape_of(run: published.PublishedRun) -> model_config.ModelConfig | None:
    """The run's model as the planner's ``ModelConfig`` (its MLP counted as SwiGLU's
    three matrices); ``None`` where the source gives no full shape."""
    m = run.model
    shape = (m.layers, m.width, m.heads, m.kv_heads, m.ffn, m.vocab, m.mlp)
    if None in shape or m.mlp not in MLP_MATRICES:
        return None
    return model_config.ModelConfig(
        vocab_size=m.vocab,
        num_layers=m.layers,
        width=m.width,
        num_heads=m.heads,
        num_kv_heads=m.kv_heads,
        mlp_width=m.ffn,
        tie_embeddings=bool(m.tied_embeddings),
        head_dim=m.head_dim or 0,
    )


def model_flops_per_token(
    run: published.PublishedRun, seq_len: int | None = None
) -> float | None:
    """Training flops per token of the run's model at ``seq_len`` (the run's by default;
    ``model_config.flops_per_token``, with a GeLU MLP's two matrices where the model has
    one); ``None`` without a shape."""
    config = shape_of(run)
    if config is None:
        return None
    flops = model_config.flops_per_token(
        config, run.seq_len if seq_len is None else seq_len
    )
    unused = 3 - MLP_MATRICES[run.model.mlp]
    return flops - 6 * unused * config.num_layers * config.width * config.mlp_width


def attention_flops_per_token(run: published.PublishedRun) -> float:
    """The attention scores' part of ``model_flops_per_token``: what a token's flops
    gain from its sequence (``model_config.flops_per_token``'s 12 x layers x T x N x A)."""
    return model_flops_per_token(run) - model_flops_per_token(run, seq_len=0)


def remat_factor(run: published.PublishedRun) -> float:
    """The flops a step runs over the model's, by the run's remat policy. Full remat runs
    each layer's forward again (4/3). MaxText's qkv_proj_offloaded keeps only the query,
    key and value projections (offloaded to the host) and recomputes the rest of the
    forward; torchtitan's selective op-level checkpointing saves the outputs of every
    matmul but every second one, so about half of the weights' forward runs again. The
    other policies (MaxText's minimal ones, none) recompute no matmul: 1."""
    if run.remat == "full":
        return 4 / 3
    flops = model_flops_per_token(run)
    if flops is None or run.remat not in ("qkv_proj_offloaded", "selective (op)"):
        return 1.0
    if run.remat == "selective (op)":
        # 6 flops per weight a token, 2 of them the forward's: half of those again
        weights = flops - attention_flops_per_token(run)
        return 1 + weights / 6 / flops
    c = shape_of(run)
    # the query, key and value projections' forward flops, a token
    heads = c.num_heads + 2 * c.num_kv_heads
    qkv = 2 * c.num_layers * c.width * heads * c.head_width
    return 1 + (flops / 3 - qkv) / flops


def utilisation(run: published.PublishedRun) -> Utilisation:
    """The run's hardware flops utilisation from its published throughput."""
    if run.chip not in hardware.CHIPS:
        return Utilisation(run, None, f"{run.chip} is not in hardware.CHIPS")
    if run.dtype == "fp8":
        return Utilisation(run, None, "Float8 matmuls: the planner has no float8")
    peak = hardware.CHIPS[run.chip].peak_bf16_flops
    value, unit = run.measured.value, run.measured.unit
    flops = model_flops_per_token(run)
    if unit == "TFLOP/s/GPU" and run.group.startswith("megatron"):
        # Megatron-LM's Eq. 3 counts the recomputed forward pass: already hardware flops
        return Utilisation(run, value * 1e12 / peak, "TFLOP/s with recomputation")
    if unit in ("TFLOP/s/GPU", "TFLOP/s/chip"):
        # model flops: MaxText's calculate_tflops_training_per_device counts the forward
        # and the backward, three passes (src/maxtext/utils/maxtext_utils.py); Llama 3's
        # Table 4 prints a BF16 MFU within a point of these teraFLOP/s over the 989 peak
        model = value * 1e12 / peak
        how = "model TFLOP/s"
    elif unit == "MFU %":
        model, how = value / 100, "MFU"
    elif flops is None:
        mfu = [q.value for q in run.also_published if q.unit == "MFU %"]
        if not mfu:
            return Utilisation(run, None, "no model shape and no MFU published")
        # the source's MFU, whose flop count it does not state
        model, how = mfu[0] / 100, "MFU as published (no model shape)"
    elif unit == "tokens/s/GPU":
        model, how = value * flops / peak, "tokens/s"
    elif unit == "sequences/s":
        model = value * run.seq_len / run.devices * flops / peak
        how = "sequences/s"
    else:
        return Utilisation(run, None, f"unit {unit!r} not read")
    return Utilisation(run, model * remat_factor(run), how)


@dataclasses.dataclass(frozen=True)
class Fit:
    """The three models' parameters, fitted on the 'fit' runs."""

    constant: float
    per_chip: dict[str, float]
    per_chip_at_reference: dict[str, float]  # the width model's, at REFERENCE_WIDTH
    width_power: float

    def predict(self, model: str, run: published.PublishedRun) -> float:
        """The utilisation ``model`` predicts for ``run`` (a chip with no fitted run
        falls back to the constant)."""
        if model == "one constant":
            return self.constant
        if model == "per chip":
            return self.per_chip.get(run.chip, self.constant)
        if model == "per chip and width":
            base = self.per_chip_at_reference.get(run.chip)
            if base is None or run.model.width is None:
                return self.per_chip.get(run.chip, self.constant)
            return base * (run.model.width / REFERENCE_WIDTH) ** self.width_power
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")


def _geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def fit(measured: list[Utilisation]) -> Fit:
    """The models, least squares in log utilisation over the runs split 'fit' that have
    one. The width power is the within-chip slope (each chip its own intercept), from
    the runs whose width is published."""
    rows = [u for u in measured if u.value is not None and u.run.split == "fit"]
    if not rows:
        raise ValueError("no fitted run has a utilisation")
    by_chip: dict[str, list[Utilisation]] = {}
    for u in rows:
        by_chip.setdefault(u.run.chip, []).append(u)
    per_chip = {c: _geometric_mean([u.value for u in us]) for c, us in by_chip.items()}
    # within each chip, log utilisation against log width: one shared slope
    sxy = sxx = 0.0
    centres = {}
    for c, us in by_chip.items():
        pts = [
            (math.log(u.run.model.width / REFERENCE_WIDTH), math.log(u.value))
            for u in us
            if u.run.model.width
        ]
        if not pts:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        centres[c] = (mx, my)
        sxy += sum((x - mx) * (y - my) for x, y in pts)
        sxx += sum((x - mx) ** 2 for x, _ in pts)
    power = sxy / sxx if sxx else 0.0
    at_reference = {c: math.exp(my - power * mx) for c, (mx, my) in centres.items()}
    return Fit(
        constant=_geometric_mean([u.value for u in rows]),
        per_chip=per_chip,
        per_chip_at_reference=at_reference,
        width_power=power,
    )


def ratios(
    result: Fit, measured: list[Utilisation], model: str, split: str
) -> list[float]:
    """Predicted over measured throughput for the runs of ``split`` that have a
    utilisation."""
    return [
        result.predict(model, u.run) / u.value
        for u in measured
        if u.value is not None and u.run.split == split
    ]


def share_good(values: list[float]) -> float:
    """The fraction of ``values`` within ``GOOD``."""
    low, high = GOOD
    return sum(low <= v <= high for v in values) / len(values)
