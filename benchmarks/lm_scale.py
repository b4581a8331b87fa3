"""Memory per device and collective bytes per step of the LM recipe at 1B, 8B and 70B.

Compiles one training step of ``python -m jaxdist_lm.train --compile-only`` (no arrays are
allocated) for each model (1b, 8b, 70b), device count (8, 64, 256 simulated CPU devices) and
strategy:

- DP: ``data=N``, every device holds the whole state;
- FSDP: ``fsdp=N``, the state split N ways, weights gathered per layer;
- FSDP+TP: ``tensor=8`` inside a node of 8 GPUs, ``fsdp=N/8`` across nodes. On 8 devices this
  is ``tensor=8`` alone: one node, so the rule "tensor fills the node" leaves no FSDP axis.

Each device holds one sequence of 2048 tokens: the global batch is N sequences, the same for
the three strategies. Compute in bfloat16 (weights and optimizer state in float32). The numbers
are XLA:CPU's buffer assignment and collectives on simulated devices; a GPU compile differs
(it turns the gradients' all-reduce into reduce-scatters, for one).

    python benchmarks/lm_scale.py                       # 27 compiles, 2 at a time (~10 min on 2 cores)
    python benchmarks/lm_scale.py --models 1b --devices 8 --out /tmp/lm.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's jaxdist_lm, where it is not installed

TRAIN = "jaxdist_lm.train"  # run as a module from ROOT: python -m jaxdist_lm.train
SEQ_LEN = 2048
NODE = 8  # GPUs per node: the tensor axis stays inside one


def mesh_for(strategy: str, devices: int) -> str:
    """The --mesh flag for a strategy on ``devices`` devices."""
    if strategy == "DP":
        return f"data={devices}"
    if strategy == "FSDP":
        return f"fsdp={devices}"
    return f"fsdp={devices // NODE},tensor={NODE}"


def parse_line(output: str) -> dict:
    """The numbers train.py --compile-only prints (GB, and bytes per collective kind)."""
    from jaxdist_lm import compiled as compiled_lib

    return compiled_lib.read_summary(output)


def compile_row(model: str, devices: int, strategy: str) -> dict:
    """Compile one configuration in a fresh process and return its row."""
    mesh = mesh_for(strategy, devices)
    command = [
        sys.executable,
        "-m",
        TRAIN,
        "--model",
        model,
        "--mesh",
        mesh,
        "--seq-len",
        str(SEQ_LEN),
        "--global-batch",
        str(devices),
        "--dtype",
        "bfloat16",
        "--num-devices",
        str(devices),
        "--compile-only",
        # the table was compiled with XLA's reference attention (train.py's
        # default before --attention; on a CPU it is now chunked)
        "--attention",
        "xla",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, cwd=ROOT
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{done.stderr[-2000:]}")
    row = {"model": model, "devices": devices, "strategy": strategy, "mesh": mesh}
    return {**row, **parse_line(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["1b", "8b", "70b"])
    parser.add_argument("--devices", nargs="+", type=int, default=[8, 64, 256])
    parser.add_argument("--strategies", nargs="+", default=["DP", "FSDP", "FSDP+TP"])
    parser.add_argument("--jobs", type=int, default=2, help="compiles at once")
    parser.add_argument("--out", default=str(ROOT / "book" / "data" / "lm_scale.json"))
    args = parser.parse_args()
    configs = [
        (m, n, s) for m in args.models for n in args.devices for s in args.strategies
    ]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda config: compile_row(*config), configs))
    print(
        f"{'model':>5} {'devices':>7} {'strategy':>8} {'args GB':>8} {'temps GB':>8} "
        f"{'total GB':>8} {'gathered GB':>11} {'reduced GB':>10}"
    )
    for row in rows:
        gathered = row["collectives"].get("all-gather", 0) / 1e9
        reduced = (
            row["collectives"].get("all-reduce", 0)
            + row["collectives"].get("reduce-scatter", 0)
        ) / 1e9
        print(
            f"{row['model']:>5} {row['devices']:>7} {row['strategy']:>8} "
            f"{row['arguments']:>8.3f} {row['temporaries']:>8.3f} {row['total']:>8.3f} "
            f"{gathered:>11.2f} {reduced:>10.2f}"
        )
    meta = {
        "seq_len": SEQ_LEN,
        "sequences_per_device": 1,
        "dtype": "bfloat16",
        "compiler": "XLA:CPU, simulated devices",
        "command": "python benchmarks/lm_scale.py",
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
