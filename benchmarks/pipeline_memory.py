"""The LM recipe's pipeline schedules at 8B on 32 devices, compile-only: memory and bytes.

``jaxdist_lm/train.py --model 8b --mesh pipeline=4,fsdp=8`` at 4096 tokens a sequence, one
sequence per device per micro-batch (so the global batch is 8 M), compiled for GPipe, 1F1B
and interleaved 1F1B (2 stages per device) at M = 8, 16 and 32 micro-batches on 32
simulated CPU devices (XLA:CPU, nothing allocated). Writes ``book/data/pipeline_memory.json``
for chapter 11_pipelines_mesh_shape, which ``tests/test_lm_recipe.py`` checks by compiling one row again.

    python benchmarks/pipeline_memory.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

import jax

from jaxdist_lessons.planning import checking

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "book" / "data" / "pipeline_memory.json"
DEVICES = 32
MICROBATCHES = (8, 16, 32)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # schedule: stages per device


def flags(schedule: str, micro: int) -> str:
    """train.py's flags for one schedule at ``micro`` micro-batches of one sequence."""
    return (
        f"--model 8b --mesh pipeline=4,fsdp=8 --seq-len 4096 --global-batch {8 * micro} "
        f"--dtype bfloat16 --grad-accum {micro} --schedule {schedule} "
        f"--virtual-stages {SCHEDULES[schedule]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    runs = [(s, m) for m in MICROBATCHES for s in SCHEDULES]
    compiled = checking.compile_flags(DEVICES, [flags(s, m) for s, m in runs])
    rows = [
        {"schedule": s, "microbatches": m, "flags": flags(s, m), **result}
        for (s, m), result in zip(runs, compiled)
    ]
    for r in rows:
        print(
            f"{r['schedule']:<12} M={r['microbatches']:<3} temporaries "
            f"{r['temporaries'] / 1e9:7.2f} GB, arguments {r['arguments'] / 1e9:.2f} GB, "
            f"all-gather {r['collectives'].get('all-gather', 0) / 1e9:7.1f} GB"
        )
    meta = {
        "compiler": f"XLA:CPU, {DEVICES} simulated devices, JAX {jax.__version__}",
        "machine": platform.machine(),
        "command": "python benchmarks/pipeline_memory.py",
    }
    pathlib.Path(args.out).write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
