"""The planner's whole step time against published runs: each run of
``book/data/published_runs.json`` as the planner's ``Run`` and ``Layout``, its step
predicted by ``timing.step_seconds`` (compute, and the collectives ``gpu.priced_transfers``
prices), and predicted over measured throughput, by split.

``efficiency`` asks how far one number per chip gets when every run is taken as compute
alone. This module adds what the layout sends: a run whose collectives the planner prices
longer than its compute is predicted slower, whatever its chip's number. The compute
efficiency is ``efficiency.fit``'s per chip, fitted on the "fit" runs only; the
held-out runs check it. Standard library only, like the rest of ``planning``.

    from jaxdist_lessons.planning import against_published
    for p in against_published.predict_all():
        print(p.run.name, p.ratio or p.why_not)
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import efficiency, published, ranking, timing
from jaxdist_lessons.planning.layouts import Layout, Run
from jaxdist_lessons.strategies import NAMES
from jaxdist_lm.model_config import ModelConfig

# The ZeRO stage of a run without FSDP or model parallelism, as the planner names it.
ZERO = {1: NAMES["zero1"], 2: NAMES["zero2"]}
# The compute efficiencies the fit tries.
GRID = [k / 100 for k in range(20, 101)]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One published run as the planner predicts it, or why it cannot."""

    run: published.PublishedRun
    layout: Layout | None
    seconds: dict[str, float]  # timing.step_seconds's parts; empty when not predicted
    ratio: float | None  # predicted / measured throughput
    why_not: str = ""


def planner_shape(run: published.PublishedRun) -> ModelConfig | None:
    """The run's model as the planner's ``ModelConfig``, or ``None`` without a full shape.

    The planner's MLP is SwiGLU (three matrices of D x F). A GeLU MLP of width F has two,
    the same weights and flops as a SwiGLU of width 2F/3, rounded to a whole unit (at
    most half a unit per layer off)."""
    shape = efficiency.shape_of(run)
    if shape is None or run.model.mlp == "swiglu":
        return shape
    return dataclasses.replace(shape, mlp_width=round(2 * shape.mlp_width / 3))


def planner_layout(run: published.PublishedRun) -> Layout | str:
    """The published layout as a planner ``Layout``, or why it has none.

    Data parallelism is ``data`` (ZeRO-1 or 2 on it when nothing else splits the model),
    ZeRO-3 and FSDP are ``fsdp``, tensor parallelism ``tensor``, context parallelism
    ``sequence``, pipeline parallelism ``stages`` under 1F1B with one sequence a
    micro-batch (ZeRO-1 inside a stage is priced as the data-parallel all-reduce it
    replaces: a ring sends the same bytes)."""
    p = run.layout
    sizes = {a: getattr(p, a) for a in published.DEGREES}
    if missing := [a for a, n in sizes.items() if n is None]:
        return f"the source gives no {', '.join(missing)} size"
    if sizes["ep"] > 1:
        return "expert parallelism: no published run uses it yet"
    zero = p.zero or 0
    data, fsdp = sizes["dp"], sizes["fsdp"]
    if zero == 3 and fsdp == 1:
        data, fsdp = 1, data
    model_split = sizes["tp"] * sizes["pp"] * sizes["cp"] * fsdp > 1
    strategy = ZERO[zero] if zero in ZERO and not model_split else ""
    return Layout(
        data=data,
        fsdp=fsdp,
        tensor=sizes["tp"],
        sequence=sizes["cp"],
        stages=sizes["pp"],
        schedule="1F1B" if sizes["pp"] > 1 else "",
        strategy=strategy or "published",
    )


def planner_run(
    run: published.PublishedRun, shape: ModelConfig, layout: Layout, fitted: float
) -> Run:
    """The run as the planner's request. Its remat is the planner's nearest (full, or
    none for MaxText's minimal policies and torchtitan's selective one, whose recomputed
    matmuls the planner's "dots" does not count); the efficiency is the chip's fitted
    one, rescaled so that the compute runs the published policy's flops
    (``efficiency.remat_factor``) rather than the nearest policy's."""
    remat = "full" if run.remat == "full" else "none"
    chip = hardware.CHIPS[run.chip]
    nodes = run.slices if chip.name.startswith("TPU") else run.nodes
    request = Run(
        run.model.name,
        shape,
        run.devices,
        nodes or 1,
        chip,
        run.seq_len,
        run.layout.global_batch,
        remat=remat,
        grad_accum=1,
    )
    scale = timing.remat_flops(request) / efficiency.remat_factor(run)
    return dataclasses.replace(request, efficiency=fitted * scale)


def predict(
    run: published.PublishedRun,
    measured: efficiency.Utilisation,
    chip_efficiency: float,
) -> Prediction:
    """The planner's step for ``run`` at ``chip_efficiency`` of its chip's peak against
    its measured utilisation: predicted over measured throughput is the measured step
    over the predicted one."""
    if measured.value is None:
        return Prediction(run, None, {}, None, measured.how)
    shape = planner_shape(run)
    if shape is None:
        return Prediction(run, None, {}, None, "the source gives no model shape")
    layout = planner_layout(run)
    if isinstance(layout, str):
        return Prediction(run, None, {}, None, layout)
    if layout.devices != run.devices:
        why = f"its axes make {layout.devices} devices, not {run.devices}"
        return Prediction(run, None, {}, None, why)
    request = planner_run(run, shape, layout, chip_efficiency)
    seconds = timing.step_seconds(request, layout)
    flops = efficiency.model_flops_per_token(run) * efficiency.remat_factor(run)
    tokens = run.layout.global_batch * run.seq_len / run.devices
    peak = request.chip.peak_bf16_flops
    measured_step = tokens * flops / (measured.value * peak)
    return Prediction(run, layout, seconds, measured_step / seconds["step"])


def _fitted(
    rows: list[tuple[published.PublishedRun, efficiency.Utilisation]],
) -> float:
    """The efficiency on ``GRID`` whose predictions of ``rows`` have the least sum of
    absolute log errors (the median run predicted exactly, whatever the outliers)."""

    def error(e: float) -> float:
        ratios = [predict(r, u, e).ratio for r, u in rows]
        return sum(abs(math.log(x)) for x in ratios if x)

    return min(GRID, key=error)


@dataclasses.dataclass(frozen=True)
class Fit:
    """The compute efficiency per chip, and one for every chip, fitted end to end."""

    per_chip: dict[str, float]
    constant: float

    def efficiency(self, chip: str) -> float:
        """The chip's fitted efficiency; the constant for a chip no fitted run used."""
        return self.per_chip.get(chip, self.constant)


def fit(runs: list[published.PublishedRun] | None = None) -> Fit:
    """The compute efficiency fitted on the runs split "fit" that the planner predicts:
    per chip, and one constant for all."""
    runs = published.load_runs() if runs is None else runs
    rows = [
        (r, u)
        for r in runs
        if r.split == "fit"
        for u in [efficiency.utilisation(r)]
        if predict(r, u, GRID[0]).ratio
    ]
    chips = sorted({r.chip for r, _ in rows})
    per_chip = {c: _fitted([(r, u) for r, u in rows if r.chip == c]) for c in chips}
    return Fit(per_chip, _fitted(rows))


def predict_all(
    runs: list[published.PublishedRun] | None = None, fitted: Fit | None = None
) -> list[Prediction]:
    """Every published run as the planner predicts it, at its chip's efficiency
    (``fit``'s unless ``fitted`` is given)."""
    runs = published.load_runs() if runs is None else runs
    fitted = fit(runs) if fitted is None else fitted
    return [
        predict(r, efficiency.utilisation(r), fitted.efficiency(r.chip)) for r in runs
    ]


def published_rank(p: Prediction) -> tuple[int | None, list[dict]]:
    """Where the planner ranks ``p``'s published layout among the rows it offers for
    the same request (the chip's own efficiency, ``--grad-accum auto``): its position
    from 1, or ``None`` where it does not offer it; and the rows."""
    request = dataclasses.replace(
        planner_run(p.run, planner_shape(p.run), p.layout, 1.0),
        efficiency=None,
        fit_accum=True,
    )
    rows = ranking.plan(request)
    meshes = [row["mesh"].split(" (")[0] for row in rows]
    mesh = p.layout.mesh_flag
    return (meshes.index(mesh) + 1 if mesh in meshes else None), rows
