"""The planner's step time against published GPU runs: predicted / measured tokens per second.

Each run is modelled as closely as ``jaxdist_lessons.planning`` can: the model's shape, the GPU
count and nodes, the sequence length and batch, the mesh. Its settings are read from the
run's source (quoted in ``RUNS``); what the planner cannot express (Float8 matmuls, selective
activation checkpointing, ``torch.compile``, a 500 W H100 variant) is said in the row's note,
and no constant is fitted to these runs: the planner's H100 number comes from
``planning.against_published``. Writes ``book/data/plan_published.json``, which the "Plan
your run" page shows and ``tests/test_plan_published.py`` recomputes.

    python benchmarks/plan_published.py        # a second: no compiling
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import layouts, ranking, timing
from jaxdist_lm import model_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "book" / "data" / "plan_published.json"

_TITAN = (
    "https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
    "llama3_h100_202412_torchtitan.md"
)
_TITAN_8B_TOML = (
    "https://github.com/pytorch/torchtitan/blob/main/torchtitan/models/llama3/"
    "train_configs/llama3_8b.toml"
)
_TITAN_HARDWARE = (
    "Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth; "
    "we used the default 500W power limit"
)
_MAXTEXT = (
    "https://github.com/NVIDIA/JAX-Toolbox/blob/main/docs/frameworks/maxtext/README.md"
)
# Llama 2 7B (meta-llama/Llama-2-7b-hf, config.json): no GQA, a 32,000-token vocabulary.
LLAMA2_7B = model_config.ModelConfig(32_000, 32, 4096, 32, 32, 11_008)

# name, source, its words, shape, chip, devices, nodes, mesh, seq_len, global batch,
# measured tokens/s per GPU, what the planner does not model
RUNS = [
    {
        "name": "torchtitan Llama 3.1 8B, 8 H100, FSDP",
        "source": _TITAN,
        "words": "Table 1 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch "
        "size 2, global batch size 16. Selective activation checkpointing. FSDP: 5,762 "
        f"TPS/GPU. {_TITAN_HARDWARE}. seq_len = 8192 ({_TITAN_8B_TOML})",
        "model": "8b",
        "devices": 8,
        "nodes": 1,
        "mesh": "fsdp=8",
        "seq_len": 8192,
        "global_batch": 16,
        "measured": 5762,
        "remat": "dots",
        "unmodelled": "selective activation checkpointing, which saves the outputs of "
        "all but every second matmul (torchtitan's activation_checkpoint.py; the planner's "
        "nearest, --remat dots, saves them all); a 500 W H100 with HBM2e, below the SXM's "
        "peak, which the planner uses",
    },
    {
        "name": "torchtitan Llama 3.1 8B, 128 H100, FSDP",
        "source": _TITAN,
        "words": "Table 3 1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch "
        "size 2, global batch size 256. Selective activation checkpointing. FSDP: 5,605 "
        f"TPS/GPU. {_TITAN_HARDWARE}; hosts inter-connected with backend RDMA network "
        "with 400 Gb/s per GPU",
        "model": "8b",
        "devices": 128,
        "nodes": 16,
        "mesh": "fsdp=128",
        "seq_len": 8192,
        "global_batch": 256,
        "measured": 5605,
        "remat": "dots",
        "unmodelled": "selective activation checkpointing (all but every second matmul's "
        "output saved; modelled as --remat dots); the 500 W H100 variant",
    },
    {
        "name": "torchtitan Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, Float8",
        "source": _TITAN,
        "words": "Table 4 2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 "
        "70B model. 256 GPUs (FSDP 32, TP 8). Local batch size 16, global batch size 512. "
        f"Full activation checkpointing. 2D: 829 TPS/GPU. {_TITAN_HARDWARE}",
        "model": "70b",
        "devices": 256,
        "nodes": 32,
        "mesh": "fsdp=32,tensor=8",
        "seq_len": 8192,
        "global_batch": 512,
        "measured": 829,
        "remat": "full",
        "unmodelled": "Float8 matmuls (the planner prices bfloat16: not like for like); "
        "torch.compile; the 500 W H100 variant",
    },
    {
        "name": "JAX-Toolbox MaxText Llama 2 7B, 8 H100, FSDP",
        "source": _MAXTEXT,
        "words": "7B | H100 80G SXM | BF16 | 4096 | 8 | 2 | DP 1 | FSDP 8 | TP 1 | GBS 16 "
        "| Flash | minimal_flash | Scan Off | Step Time (s) 0.721 | Sequences/Sec 22.19",
        "shape": "llama2-7b",
        "devices": 8,
        "nodes": 1,
        "mesh": "fsdp=8",
        "seq_len": 4096,
        "global_batch": 16,
        "measured": 22.19 * 4096 / 8,
        "remat": "dots",
        "unmodelled": "the 'minimal_flash' remat policy, which saves the attention's "
        "output too (modelled as --remat dots, which recomputes it); layers unrolled "
        "('Scan Off'), the planner's recipe scans them",
    },
]


def predicted(entry: dict, efficiency: float | None = None) -> dict:
    """The planner's row for one published run, and its tokens per second per GPU."""
    shape = (
        LLAMA2_7B
        if entry.get("shape") == "llama2-7b"
        else model_config.PRESETS[entry["model"]]
    )
    run = layouts.Run(
        entry.get("model", entry.get("shape")),
        shape,
        entry["devices"],
        entry["nodes"],
        hardware.chip("H100 80GB"),
        entry["seq_len"],
        entry["global_batch"],
        remat=entry["remat"],
        efficiency=efficiency,
    )
    candidate = layouts.Layout.from_flag(entry["mesh"], strategy="published")
    row = ranking.row(run, candidate)
    return {
        "tokens_per_second_per_gpu": row["tokens_per_second_per_device"],
        "step_seconds": row["step_seconds"],
        "seconds": row["seconds"],
        "mfu": row["mfu"],
        "fits": row["fits"],
    }


_SCALING_BOOK = "https://jax-ml.github.io/scaling-book/gpus/"
THRESHOLD = {
    "source": _SCALING_BOOK,
    "words": "Within a node, we just need the per-GPU token batch size > 990e12 / 450e9 = "
    "2200. Within an SU or at the spine level, BS > 990e12 / 400e9 = 2475.",
    "inside": 2200,
    "across": 2475,
}


def fsdp_threshold(devices: int, nodes: int, seq_len: int = 4096) -> float:
    """Tokens per GPU above which the planner predicts Llama 3 8B under FSDP on H100s to
    be compute-bound (its compute time above its communication time), on the scaling
    book's terms (the datasheet's peak, no remat): where the two
    lines through global batches of one and two sequences a GPU cross (compute is
    linear in the tokens, the weights' bytes are constant, the lookup's grow with them)."""
    times = []
    for rows in (1, 2):
        run = layouts.Run(
            "8b",
            model_config.PRESETS["8b"],
            devices,
            nodes,
            hardware.chip("H100 80GB"),
            seq_len,
            rows * devices,
        )
        run = dataclasses.replace(run, remat="none", efficiency=1.0)
        t = timing.step_seconds(
            run, layouts.Layout.from_flag(f"fsdp={devices}", strategy="FSDP")
        )
        times.append((t["compute"], t["comm"]))
    (compute1, comm1), (compute2, comm2) = times
    per_sequence = (compute2 - compute1) - (comm2 - comm1)
    return (seq_len * (comm1 - compute1) / per_sequence) + seq_len


def thresholds() -> dict:
    """The planner's FSDP threshold inside one node (8 GPUs) and across two (16), beside
    the scaling book's."""
    ours = {"inside": fsdp_threshold(8, 1), "across": fsdp_threshold(16, 2)}
    return {
        **THRESHOLD,
        "planner": ours,
        "ratio": {k: ours[k] / THRESHOLD[k] for k in ours},
    }


GRID = [k / 100 for k in range(20, 101)]  # efficiencies tried: 0.20 to 1.00


def log_error(entries: list[dict], efficiency: float) -> float:
    """Sum over ``entries`` of log(predicted / measured) squared, at ``efficiency``."""
    return sum(
        math.log(predicted(e, efficiency)["tokens_per_second_per_gpu"] / e["measured"])
        ** 2
        for e in entries
    )


def implied_efficiency(entry: dict) -> float:
    """The efficiency at which the planner would predict this run's measured throughput
    (to 0.01): what the run reached, in the planner's terms."""
    return min(GRID, key=lambda efficiency: log_error([entry], efficiency))


def table() -> list[dict]:
    """Every run with the planner's prediction and predicted / measured."""
    rows = []
    for entry in RUNS:
        guess = predicted(entry)
        ratio = guess["tokens_per_second_per_gpu"] / entry["measured"]
        rows.append(
            {
                **entry,
                "predicted": guess,
                "ratio": ratio,
                "implied_efficiency": implied_efficiency(entry),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    rows = table()
    for r in rows:
        print(
            f"{r['name']:<58} measured {r['measured']:>8,.0f}  predicted "
            f"{r['predicted']['tokens_per_second_per_gpu']:>8,.0f}  ratio {r['ratio']:.2f}  "
            f"implied efficiency {r['implied_efficiency']:.2f}"
        )
    meta = {
        "chip": "H100 80GB (hardware.CHIPS)",
        "command": "python benchmarks/plan_published.py",
        "ratio": "predicted / measured tokens per second per GPU",
        # the planner's (timing.compute_efficiency), fitted per chip on published_runs.json
        "efficiency": timing.compute_efficiency(hardware.chip("H100 80GB")),
    }
    limits = thresholds()
    print(
        f"FSDP compute-bound from (tokens per GPU): planner {limits['planner']}, "
        f"scaling book {limits['inside']} inside a node, {limits['across']} across"
    )
    out = {"meta": meta, "rows": rows, "fsdp_threshold": limits}
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
