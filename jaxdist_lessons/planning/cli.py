"""The command line (``python -m jaxdist_lessons.planning``) and the "Plan your run" page's
glue (``page_json``, which the page runs in Pyodide): the request checked into a ``Run``,
with one-line errors (``PlanError``), the table or JSON, ``--check``, ``--write-config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from jaxdist_lessons import hardware
from jaxdist_lessons.planning.checking import check_table, compare, compile_flags
from jaxdist_lessons.planning.footprint import USABLE
from jaxdist_lessons.planning.layouts import PlanError, Run, candidates, problems
from jaxdist_lessons.planning.ranking import CONFIG_FILE, plan, table
from jaxdist_lessons.planning.timing import compute_efficiency
from jaxdist_lm.model_config import PRESETS, ModelConfig, config_to_hf

MAX_DEVICES = 65_536  # the page runs the planner in a browser tab: keep it to seconds


CHIP_NAMES = {
    "a100": "A100 80GB",
    "a100-40gb": "A100 40GB",
    "h100": "H100 80GB",
    "h200": "H200 141GB",
    "v5p": "TPU v5p",
}


def make_run(args: argparse.Namespace) -> Run:
    """The reader's request, checked; ``PlanError`` says what is wrong."""
    if args.slices is not None:
        if args.slices < 1:
            raise PlanError(f"--slices must be positive, got {args.slices}")
        if args.nodes != 1:
            raise PlanError("--slices and --nodes say the same thing: give one")
        args = argparse.Namespace(**{**vars(args), "nodes": args.slices})
    for name in ("devices", "nodes", "seq_len", "global_batch", "top_k", "group_size"):
        if getattr(args, name) < 1:
            raise PlanError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    if args.devices > MAX_DEVICES:  # crossing_share walks every device of every mesh
        raise PlanError(
            f"--devices {args.devices}: the planner plans up to {MAX_DEVICES:,}"
        )
    if args.experts < 0 or args.capacity_factor <= 0:
        raise PlanError("--experts must be 0 or more and --capacity-factor positive")
    if args.devices % args.nodes:
        raise PlanError(
            f"--devices {args.devices} do not divide into --nodes {args.nodes}"
        )
    name = CHIP_NAMES.get(args.chip.lower(), args.chip)
    if name not in hardware.CHIPS:
        raise PlanError(
            f"unknown chip {args.chip!r}; known: {', '.join(CHIP_NAMES)}, "
            f"{', '.join(hardware.CHIPS)}"
        )
    chip = hardware.CHIPS[name]
    if args.slices is not None and not chip.name.startswith("TPU"):
        raise PlanError(
            f"--slices {args.slices}: slices are a TPU's; a GPU cluster has --nodes"
        )
    if chip.link_bytes_per_s is None or (
        args.nodes > 1 and chip.network_bytes_per_s is None
    ):
        raise PlanError(
            f"{chip.name} has no {'network' if chip.link_bytes_per_s else 'chip-to-chip'}"
            " bandwidth in hardware.CHIPS; pick another --chip"
        )
    peak = chip.peak_bf16_flops if args.dtype == "bfloat16" else chip.peak_fp32_flops
    if peak is None:
        raise PlanError(
            f"{chip.name} has no {args.dtype} peak in hardware.CHIPS; pick another "
            "--dtype or --chip"
        )
    shape = model_shape(args)
    if not 1 <= args.top_k <= max(shape.num_experts, 1):
        raise PlanError(
            f"--top-k {args.top_k} must be between 1 and --experts {shape.num_experts}"
        )
    accum = args.grad_accum
    if accum != "auto" and not (accum.isdigit() and int(accum) > 0):
        raise PlanError(f"--grad-accum must be a positive integer or auto, got {accum}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise PlanError(
            f"--efficiency {args.efficiency}: a fraction of the peak, in (0, 1]"
        )
    return Run(
        args.model or "custom",
        shape,
        args.devices,
        args.nodes,
        chip,
        args.seq_len,
        args.global_batch,
        args.dtype,
        args.remat,
        1 if accum == "auto" else int(accum),
        fit_accum=accum == "auto",
        bytes=args.bytes,
        efficiency=args.efficiency,
    )


SHAPE_FLAGS = {
    "layers": "num_layers",
    "width": "width",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "mlp_width": "mlp_width",
    "vocab": "vocab_size",
}


def model_shape(args: argparse.Namespace) -> ModelConfig:
    """A preset, or the shape the flags give; experts from --experts and --top-k either way."""
    given = {
        field: getattr(args, flag)
        for flag, field in SHAPE_FLAGS.items()
        if getattr(args, flag) is not None
    }
    if args.model and args.model not in PRESETS:
        raise PlanError(
            f"unknown model {args.model!r}; presets: {', '.join(PRESETS)}, or give "
            "--layers --width --heads --kv-heads --mlp-width --vocab"
        )
    if min(given.values(), default=1) < 1:
        raise PlanError("the model's sizes must be positive")
    if args.model:
        shape = dataclasses.replace(PRESETS[args.model], **given)
    elif len(given) < len(SHAPE_FLAGS):
        missing = [
            f"--{f.replace('_', '-')}" for f in SHAPE_FLAGS if getattr(args, f) is None
        ]
        raise PlanError(
            f"give --model, or the model's shape: missing {' '.join(missing)}"
        )
    else:
        shape = ModelConfig(**given)
    if args.head_dim is not None:
        if args.head_dim < 1:
            raise PlanError("--head-dim must be positive")
        shape = dataclasses.replace(shape, head_dim=args.head_dim)
    if args.tie_embeddings:
        shape = dataclasses.replace(shape, tie_embeddings=True)
    uneven = not shape.head_dim and shape.width % shape.num_heads
    if uneven or shape.num_heads % shape.num_kv_heads:
        raise PlanError(
            f"width {shape.width}, {shape.num_heads} heads and {shape.num_kv_heads} "
            "KV heads: heads must divide the width (or give --head-dim), KV heads "
            "the heads"
        )
    return dataclasses.replace(
        shape,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        group_size=args.group_size,
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2
        raise PlanError(message)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m jaxdist_lessons.planning",
        description="Plan a run of python -m jaxdist_lm.train before renting the cluster: which "
        "layouts fit, what they send, how fast (predicted).",
    )
    add = parser.add_argument
    add("--model", help=f"a preset of jaxdist_lm/model.py: {', '.join(PRESETS)}")
    for flag in SHAPE_FLAGS:
        add(
            f"--{flag.replace('_', '-')}",
            type=int,
            help="the model's shape, without --model",
        )
    add(
        "--head-dim",
        type=int,
        help="a head's width, when the heads do not split the width evenly "
        "(default: width / heads)",
    )
    add(
        "--tie-embeddings",
        action="store_true",
        help="the output projection reuses the embedding table (a custom shape; "
        "the presets say it themselves)",
    )
    add("--experts", type=int, default=0, help="experts per MLP (0: dense)")
    add("--top-k", type=int, default=1)
    add("--capacity-factor", type=float, default=1.25)
    add("--group-size", type=int, default=512)
    add("--devices", type=int, required=True)
    add(
        "--nodes",
        type=int,
        default=1,
        help="servers of GPUs; for a TPU, slices joined over the data-center network",
    )
    add(
        "--slices",
        type=int,
        help="a TPU's slices (multislice), each one node to the planner: --nodes's "
        "name for a TPU",
    )
    add(
        "--chip",
        default="h100",
        help=f"{', '.join(CHIP_NAMES)} or a name in hardware.CHIPS",
    )
    add("--seq-len", type=int, default=2048)
    add("--global-batch", type=int, required=True, help="sequences per step")
    add(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="compute type",
    )
    add(
        "--remat",
        default="full",
        choices=["none", "dots", "full"],
        help="train.py's --remat: what each layer keeps for the backward",
    )
    add(
        "--grad-accum",
        default="auto",
        help="micro-batches a step (train.py's); auto: each layout's fewest that fit",
    )
    add(
        "--bytes",
        default="gpu",
        choices=["gpu", "xla-cpu"],
        help="the collectives to price: a GPU's (predicted) or XLA:CPU's compiled ones",
    )
    add(
        "--efficiency",
        type=float,
        help="of the chip's peak the matmuls reach (default: the chip's, fitted to "
        "published runs)",
    )
    add("--json", action="store_true", help="print the rows as JSON")
    add(
        "--check",
        action="store_true",
        help="compile the best rows on simulated devices",
    )
    add("--check-rows", type=int, default=3, help="how many rows --check compiles")
    add(
        "--write-config",
        metavar="PATH",
        help="write the model's shape as the config.json that train.py's "
        "--model-config reads (for a shape that is not a preset)",
    )
    return parser.parse_args(argv)


def fitting_plan(run: Run) -> list[dict[str, Any]]:
    """``plan(run)`` when some layout fits; otherwise ``PlanError`` says why none does."""
    rows = plan(run)
    if not rows:  # every layout's split fails; the first family's reasons say why
        reasons = next(p for c in candidates(run) if (p := problems(run, c)))
        raise PlanError(
            f"no layout splits {run.model} on {run.devices} devices: "
            f"{'; '.join(reasons)}"
        )
    if not any(r["fits"] for r in rows):
        smallest = min(r["memory_bytes"]["total"] for r in rows)
        raise PlanError(
            f"{run.model} fits no layout on {run.devices} x {run.chip.name}: the "
            f"smallest needs {smallest / 1e9:,.1f} GB a device, above "
            f"{USABLE:.0%} of {run.chip.memory_label} ("
            f"{'' if run.fit_accum else 'more --grad-accum, '}--remat full, a "
            "shorter --seq-len or more --devices)"
        )
    return rows


def page_json(argv: Sequence[str]) -> str:
    """What the "Plan your run" page shows for its form's flags, as JSON: the table (title,
    headers, cells as printed) and the rows, or ``{"error": ...}``, the line ``main`` prints."""
    try:
        run = make_run(parse_args(argv))
        rows = fitting_plan(run)
    except PlanError as error:
        return json.dumps({"error": f"plan: {error}"})
    shown = table(run, rows)
    return json.dumps(
        {
            "run": run_summary(run),
            "rows": rows,
            "title": shown.title,
            "headers": shown.headers,
            "cells": shown.rows,
            "usable_bytes": USABLE * run.chip.memory_bytes,
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: the table (or JSON), and with --check the compiled comparison."""
    try:
        args = parse_args(argv)
        run = make_run(args)
        rows = fitting_plan(run)
    except PlanError as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    custom = any(f"--model-config {CONFIG_FILE}" in r["flags"] for r in rows)
    if args.write_config:
        pathlib.Path(args.write_config).write_text(json.dumps(config_to_hf(run.shape)))
        for r in rows:
            r["flags"] = r["flags"].replace(
                f"--model-config {CONFIG_FILE}", f"--model-config {args.write_config}"
            )
    checks = []
    if args.check:
        chosen = [r for r in rows if r["checked"]][: args.check_rows]  # fitting first
        with tempfile.TemporaryDirectory() as folder:
            config = pathlib.Path(folder, CONFIG_FILE)
            config.write_text(json.dumps(config_to_hf(run.shape)))
            lines = [
                r["flags"].replace(
                    f"--model-config {CONFIG_FILE}", f"--model-config {config}"
                )
                for r in chosen
            ]
            compiled = compile_flags(run.devices, lines)
        checks = [compare(r, c) for r, c in zip(chosen, compiled)]
    if args.json:
        out: dict[str, Any] = {"run": run_summary(run), "rows": rows}
        if args.check:
            out["checks"] = [{"mesh": r["mesh"], **c} for r, c in zip(chosen, checks)]
        print(json.dumps(out, indent=1))
        return 0
    print(table(run, rows))
    print(
        "\nflags for python -m jaxdist_lm.train (add --num-devices N --compile-only to check one "
        "on this machine):"
    )
    for number, r in enumerate(rows, 1):
        print(f"{number:>3}. {r['strategy']:<22} {r['flags']}")
    if custom and not args.write_config:
        print(
            f"\n{CONFIG_FILE}: this shape for --model-config; add --write-config "
            f"{CONFIG_FILE} to write it"
        )
    if args.check:
        print()
        print(check_table(chosen, checks))
    return 0


def run_summary(run: Run) -> dict[str, Any]:
    """The request, as JSON."""
    return {
        "model": run.model,
        "shape": dataclasses.asdict(run.shape),
        "devices": run.devices,
        "nodes": run.nodes,
        "chip": run.chip.name,
        "seq_len": run.seq_len,
        "global_batch": run.global_batch,
        "dtype": run.dtype,
        "remat": run.remat,
        "grad_accum": "auto" if run.fit_accum else run.grad_accum,
        "bytes": run.bytes,
        "efficiency": run.efficiency or compute_efficiency(run.chip),
    }
