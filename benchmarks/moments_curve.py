"""The recipe's loss curve with Adam's moments in float32 and in bfloat16, side by side.

``jaxdist_lm/train.py --moments bfloat16`` keeps Adam's two moments in bfloat16 between
steps (4 bytes a weight instead of 8; each update is still computed in float32): what lets
the 1b model train on one 16 GB TPU v5e (book/data/tpu_report.json). This runs the tiny
model on the default corpus both ways, the same seed and batches, and writes each step's
loss to ``--out`` (the book reads ``book/data/moments_curve.json``), with where it ran.

    python benchmarks/moments_curve.py --out book/data/moments_curve.json   # ~2 min on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = [
    *("--model", "tiny", "--mesh", "data=2,fsdp=2,tensor=2", "--num-devices", "8"),
    *("--seq-len", "128", "--global-batch", "16", "--learning-rate", "3e-3"),
]


def losses(moments: str, steps: int, log_dir: pathlib.Path) -> list[float]:
    """Each step's training loss, from the run's metrics.jsonl."""
    command = [
        sys.executable,
        "-m",
        "jaxdist_lm.train",
        *FLAGS,
        *("--steps", str(steps), "--moments", moments, "--log-dir", str(log_dir)),
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").open()]
    return [row["loss"] for row in rows]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        curves = {
            moments: losses(moments, args.steps, pathlib.Path(tmp, moments))
            for moments in ("float32", "bfloat16")
        }
    report = {
        "date": datetime.date.today().isoformat(),
        "where": "8 simulated CPU devices (XLA:CPU)",
        "jax_version": jax.__version__,
        "flags": " ".join(FLAGS),
        "losses": curves,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    gap = max(abs(a - b) for a, b in zip(*curves.values(), strict=True))
    print(f"{args.steps} steps; the largest gap between the two curves: {gap:.4f}")
    return report


if __name__ == "__main__":
    main()
