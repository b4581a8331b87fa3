"""One row per layout: memory, bytes, time, the recipe's flags (or what a layout needs that
the recipe lacks), ``--grad-accum auto`` settled per layout, the ranking, and the table the
command line prints and the "Plan your run" page shows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxdist_lessons.planning.footprint import (
    USABLE,
    argument_bytes,
    memory,
    temporaries_estimate,
)
from jaxdist_lessons.planning.gpu import priced_transfers
from jaxdist_lessons.planning.layouts import (
    NEEDS,
    Layout,
    Run,
    candidates,
    checked,
    problems,
    runnable,
)
from jaxdist_lessons.planning.timing import link_bytes, step_seconds
from jaxdist_lessons.planning.xla_cpu import transfer_bytes_by_kind, transfers
from jaxdist_lessons.strategies import NAMES
from jaxdist_lessons.tables import Table
from jaxdist_lm.model_config import PRESETS


def recipe_flags(run: Run, c: Layout) -> str:
    """The flags of ``jaxdist_lm/train.py`` that run this layout: ``--model`` for a
    preset's shape, otherwise ``--model-config config.json`` (``config_to_hf`` writes it);
    for a layout the recipe does not run, what it needs."""
    if not runnable(c):
        return NEEDS[c.strategy]
    m = run.shape
    dense = dataclasses.replace(
        m, num_experts=0, top_k=1, capacity_factor=1.25, group_size=512
    )
    model = (
        f"--model {run.model}"
        if dense == PRESETS.get(run.model)
        else f"--model-config {CONFIG_FILE}"
    )
    flags = [
        model,
        f"--mesh {c.mesh_flag}",
        f"--seq-len {run.seq_len}",
        f"--global-batch {run.global_batch}",
        f"--dtype {run.dtype}",
    ]
    if m.num_experts:
        flags += [f"--experts {m.num_experts}", f"--top-k {m.top_k}"]
        if c.dispatch == "dropless":
            flags.append("--dispatch dropless")
        else:
            flags += [
                f"--capacity-factor {m.capacity_factor:g}",
                f"--group-size {m.group_size}",
            ]
    if c.strategy == NAMES["zero1"]:
        flags.append("--zero1")
    if run.remat != "full":
        flags.append(f"--remat {run.remat}")
    if run.grad_accum > 1 and c.stages == 1:
        flags.append(f"--grad-accum {run.grad_accum}")
    if c.offload:
        flags.append("--offload optimizer,activations")
    if c.stages > 1:  # one sequence per device per microbatch, as step_seconds counts
        flags += [
            f"--grad-accum {run.global_batch // c.batch_ways}",
            f"--schedule {c.schedule.lower()}",
        ]
        if c.virtual > 1:
            flags.append(f"--virtual-stages {c.virtual}")
    return " ".join(flags)


CONFIG_FILE = "config.json"  # a custom shape's, from --write-config


def row(run: Run, c: Layout) -> dict[str, Any]:
    """Everything the table and the JSON say about one layout; its collectives worked out
    once for the bytes and the time (and XLA:CPU's, for ``--check``)."""
    priced = priced_transfers(run, c)
    mem, time = memory(run, c), step_seconds(run, c, priced)
    label = c.mesh_flag
    if c.schedule == "interleaved":
        label += f" (v={c.virtual})"
    parts = {**dataclasses.asdict(mem), "total": mem.total}
    return {
        "strategy": c.strategy,
        "mesh": label,
        "fits": mem.total <= USABLE * run.chip.memory_bytes,
        "memory_bytes": parts,
        "memory_gb": {k: v / 1e9 for k, v in parts.items()},
        "arguments_bytes": argument_bytes(run, c),
        "temporaries_estimate_bytes": temporaries_estimate(run, c),
        "collective_bytes": transfer_bytes_by_kind(transfers(run, c)),
        "sent_bytes": link_bytes(run, c, priced[0] + priced[1]),
        "step_seconds": time["step"],
        "seconds": {k: time[k] for k in ("compute", "overlapped", "exposed")},
        "mfu": time["mfu"],
        "tokens_per_second_per_device": run.global_batch
        * run.seq_len
        / time["step"]
        / run.devices,
        "grad_accum": run.grad_accum if c.stages == 1 else 0,  # 0: a pipeline's own
        "flags": recipe_flags(run, c),
        "runnable": runnable(c),
        "checked": checked(run, c),
    }


def accumulated(run: Run, c: Layout) -> Run:
    """``run`` with ``--grad-accum auto`` settled for this layout: the fewest micro-batches
    (a divisor of its rows a device) whose memory fits, or one a row if none does. A
    pipeline's micro-batches are its own (one sequence each)."""
    if not run.fit_accum or c.stages > 1:
        return run
    rows = run.global_batch // c.batch_ways
    for k in (k for k in range(1, rows + 1) if rows % k == 0):
        tried = dataclasses.replace(run, grad_accum=k)
        if memory(tried, c).total <= USABLE * run.chip.memory_bytes:
            return tried
    return dataclasses.replace(run, grad_accum=rows)


def plan(run: Run) -> list[dict[str, Any]]:
    """One row per layout that divides the model: fitting ones first, then those the
    recipe runs, fastest first (``rank``, against the fastest of those that fit and
    run)."""
    rows = [
        row(accumulated(run, c), c) for c in candidates(run) if not problems(run, c)
    ]
    steps = [r["step_seconds"] for r in rows if r["fits"] and r["runnable"]]
    fastest = min(steps or [r["step_seconds"] for r in rows] or [1.0])
    return sorted(rows, key=lambda r: rank(r, fastest))


# Steps within this share of each other are a tie: the planner's step times are not
# that precise (a published run counts as well predicted within 0.75 to 1.33 of its
# measurement, efficiency.GOOD).
TIE = 0.01


def rank(r: dict[str, Any], fastest: float) -> tuple:
    """Fitting rows first, then those the recipe runs, then the fastest, in bands of
    ``TIE`` over the ``fastest`` row's step (steps within 1% of each other tie); of
    layouts in one band, the simplest first: the fewest mesh axes (pipeline stages
    among them), so the fewest kinds of collective to go wrong; then the fewest bytes
    across nodes, then to the host, then the least memory."""
    band = math.floor((r["step_seconds"] / fastest - 1) / TIE + 1e-9)
    sent = r["sent_bytes"]
    return (
        not r["fits"],
        not r["runnable"],
        band,
        r["mesh"].count("="),
        sent["across"],
        sent["host"],
        r["memory_bytes"]["total"],
    )


HEADERS = [
    "strategy",
    "mesh",
    "fits",
    "micro-batches",
    "weights GB",
    "optimizer GB",
    "grads GB",
    "activations GB",
    "total GB",
    "in-node GB",
    "across GB",
    "host GB",
    "step s (predicted)",
    "MFU (predicted)",
]


def table(run: Run, rows: Sequence[dict[str, Any]]) -> Table:
    """The rows as a ``tables.Table``."""
    gb = lambda x: x / 1e9
    cells = [
        [
            r["strategy"],
            r["mesh"],
            "yes" if r["fits"] else "no",
            r["grad_accum"] or "pipeline",
            *(
                gb(r["memory_bytes"][k])
                for k in ("weights", "optimizer", "gradients", "activations", "total")
            ),
            gb(r["sent_bytes"]["inside"]),
            gb(r["sent_bytes"]["across"]),
            gb(r["sent_bytes"]["host"]),
            r["step_seconds"],
            f"{r['mfu']:.1%}",
        ]
        for r in rows
    ]
    # The predicted collectives are a GPU's; a TPU row says it prices those, not its own.
    on_tpu = run.chip.name.startswith("TPU")
    sent = {
        "gpu": "the recipe's program (predicted as on a GPU)"
        if on_tpu
        else "a GPU's program (predicted)",
        "xla-cpu": "XLA:CPU's program (float32 collectives)",
    }[run.bytes]
    unit = "slice" if on_tpu else "node"
    title = (
        f"{run.model} on {run.devices} x {run.chip.name} ({run.nodes} {unit}"
        f"{'s' if run.nodes > 1 else ''}), {run.global_batch} x {run.seq_len} tokens a "
        f"step, {run.dtype}, remat {run.remat}; GB sent "
        f"per device per step by {sent}"
    )
    return Table(HEADERS, cells, title=title)
