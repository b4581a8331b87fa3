"""Two copies of the LM recipe on one chip, run in turns: what a change to the recipe costs
in step time and memory, each copy measured beside the other.

Each run is ``python -m {prefix}train`` of one copy in its own process (a TPU is held by
one program at a time), with ``tpu_report.py``'s flags for one of its ``RUNS`` and random
token ids. The copies take turns, ``--rounds`` times, so that a drift of the machine
falls on both. Each run's row is ``tpu_report.step_summary``'s: the median step time,
tokens/s and MFU after the first steps, and the peak memory the recipe prints.

It writes ``recipe_versions.json`` into ``--out``, with the date, the chip's
``device_kind``, the JAX and Flax versions and each copy's commit as given; the book
reads ``book/data/recipe_versions_tpu.json``.

    git worktree add /tmp/before REV     # the recipe before the change
    python benchmarks/recipe_versions.py --before /tmp/before/jaxdist_lm \\
        --after jaxdist_lm --before-name linen --after-name nnx --out $OUT
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
sys.path.insert(0, str(ROOT))

from benchmarks import recipe_copy, tpu_report  # noqa: E402

# Two of tpu_report.RUNS' rows as book/data/tpu_report.json ran them: 125m with splash
# attention and remat dots at a batch of 16, and 1b with full remat and bfloat16 moments
# at a batch of 2 (the largest that fits 16 GB is 3).
CASES = {
    "125m": ("125m", 2048, "splash", 16, 1, "dots", "none", "float32"),
    "1b": ("1b", 2048, "splash", 2, 1, "full", "none", "bfloat16"),
}


def run_copy(recipe: str, case: dict, data: str, cache: str, timeout: float) -> dict:
    """One run of the copy at ``recipe``: tpu_report.step_summary of its output."""
    folder, prefix = recipe_copy.locate(recipe)
    argv = tpu_report.recipe_argv(case, data, cache)
    command = [sys.executable, "-m", f"{prefix}train", *argv]
    # the copy's own modules first, whatever is installed
    env = {
        **os.environ,
        "PYTHONPATH": f"{folder}{os.pathsep}" + os.environ.get("PYTHONPATH", ""),
    }
    print(f"== {folder}: {' '.join(command[1:])}", flush=True)
    try:
        done = subprocess.run(
            command,
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        text, status = done.stdout + done.stderr, f"exit {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        text, status = str(expired.stdout or ""), "timed out"
    print(text[-1500:], flush=True)
    return {"status": status, **tpu_report.step_summary(text)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the first copy's folder")
    parser.add_argument("--after", required=True, help="the second copy's folder")
    parser.add_argument("--before-name", default="before")
    parser.add_argument("--after-name", default="after")
    parser.add_argument("--cases", default="125m,1b", help=f"of {sorted(CASES)}")
    parser.add_argument("--rounds", type=int, default=2, help="turns of each copy")
    parser.add_argument("--timeout", type=float, default=120, help="seconds a run")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    import flax
    import jax

    from jaxdist_lm import model_config

    args = parse_args(argv)
    copies = {args.before_name: args.before, args.after_name: args.after}
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.cases.split(","):
            case = dict(zip(tpu_report.KEYS, CASES[name], strict=True))
            vocab = model_config.PRESETS[case["model"]].vocab_size
            rows_needed = case["global_batch"] * (tpu_report.STEPS + 2)
            data = tpu_report.random_tokens(
                pathlib.Path(work) / f"{name}.npy", vocab, rows_needed, case["seq_len"]
            )
            for turn in range(args.rounds):
                for copy, recipe in copies.items():
                    cache = str(pathlib.Path(work) / f"cache_{copy}")
                    result = run_copy(recipe, case, data, cache, args.timeout)
                    rows.append({"case": name, "copy": copy, "turn": turn, **result})
    device = jax.devices()[0]
    report = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "platform": device.platform,
            "device_kind": device.device_kind,
            "jax_version": jax.__version__,
            "flax_version": flax.__version__,
            "copies": copies,
            "cases": {
                name: dict(zip(tpu_report.KEYS, CASES[name], strict=True))
                for name in args.cases.split(",")
            },
            "skip": tpu_report.SKIP,
            "steps": tpu_report.STEPS,
            "command": " ".join(
                ["python", "benchmarks/recipe_versions.py", *sys.argv[1:]]
            ),
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recipe_versions.json").write_text(json.dumps(report, indent=1) + "\n")
    for row in rows:
        print(
            f"{row['case']:>5} {row['copy']:>8} turn {row['turn']}: "
            f"{row.get('step_seconds')} s, {row.get('peak_memory_gb')} GB, {row['status']}"
        )
    return report


if __name__ == "__main__":
    main()
