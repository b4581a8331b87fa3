"""The LM recipe's step compiled for two TPU shapes: memory per chip and bytes per mesh axis.

A v5e-256 (one slice of 256 chips, 16 GB each) training the 8b model, and two v5p-128
slices (2 x 64 chips, 95 GiB each, joined by the data-center network) training the 70b one,
each under two meshes: the planner's first choice (``python -m jaxdist_lessons.planning
--chip "TPU v5e"``, with ``--nodes 2`` for the two slices) and one to set beside it. Each row
is ``examples/lm/train.py``'s step for the flags the planner prints, compiled as
``--compile-only --num-devices N`` compiles it (one process per device count, JAX started
once): the memory XLA assigns each device, the bytes of each collective kind per device and
step (``compiled.collective_bytes``: loops times their trip counts), and the same bytes split
by the mesh axes each collective's groups span (``profiling.collective_bytes_by_axis``).

These are XLA:CPU's numbers on simulated devices, not the TPU compiler's: XLA:CPU moves
float32 in its collectives and all-reduces whole gradients where a TPU compile
reduce-scatters them. On a CPU the recipe's attention is the chunked blocks (splash, the
default on a TPU, is a Pallas kernel for TPUs). Writes ``book/data/tpu_meshes.json``, which
the "Running on TPUs" page reads and ``tests/test_tpu_meshes.py`` checks.

    python benchmarks/tpu_meshes.py                  # 4 compiles, under a minute on 2 cores
    python benchmarks/tpu_meshes.py --out /tmp/tpu_meshes.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxdist_lessons import hardware  # noqa: E402  (the checkout's package)
from jaxdist_lessons.planning import layouts, model_config, ranking  # noqa: E402

OUT = ROOT / "book" / "data" / "tpu_meshes.json"
COMPILER = "XLA:CPU's compile of simulated devices"

# (what a team rents, chip in hardware.CHIPS, chips, slices, model, tokens a sequence,
# strategy, mesh); one sequence a chip, so the global batch is the chip count.
SHAPES = [
    ("v5e-256", "TPU v5e", 256, 1, "8b", 2048, "FSDP", "fsdp=256"),
    ("v5e-256", "TPU v5e", 256, 1, "8b", 2048, "FSDP+TP", "fsdp=64,tensor=4"),
    ("2 x v5p-128", "TPU v5p", 128, 2, "70b", 8192, "HSDP", "data=2,fsdp=64"),
    ("2 x v5p-128", "TPU v5p", 128, 2, "70b", 8192, "FSDP", "fsdp=128"),
]


def planned(shape: tuple) -> tuple[layouts.Run, dict]:
    """The planner's run and row for one shape: its flags, its predicted bytes."""
    _, chip, chips, slices, model, seq_len, strategy, mesh = shape
    run = layouts.Run(
        model,
        model_config.PRESETS[model],
        chips,
        slices,
        hardware.chip(chip),
        seq_len,
        chips,
    )
    layout = layouts.Layout.from_flag(mesh, strategy=strategy)
    if problems := layouts.problems(run, layout):
        raise ValueError(f"{shape}: {problems}")
    return run, ranking.row(run, layout)


def worker(devices: int, runs: list[list[str]]) -> None:
    """In a fresh process with ``devices`` simulated CPU devices: compile train.py's step
    for each argv and print one JSON line each."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    from jaxdist_lessons import profiling, recipe

    compiled_lib, train = recipe.module("compiled"), recipe.module("train")
    for argv in runs:
        start = time.perf_counter()
        args = train.parse_args([*argv, "--compile-only"])
        with contextlib.redirect_stdout(sys.stderr):  # setup's notes; stdout is JSON
            mesh, _, _, step, shapes, _ = train.setup(args)
        program = compiled_lib.lower_step(step, shapes, args, mesh).compile()
        memory, text = program.memory_analysis(), program.as_text()
        row = {
            "arguments": memory.argument_size_in_bytes,
            "temporaries": memory.temp_size_in_bytes,
            "total": compiled_lib.program_total(memory),
            "collectives": compiled_lib.collective_bytes(text),
            "by_axis": profiling.collective_bytes_by_axis(text, mesh),
            "compile_seconds": round(time.perf_counter() - start, 1),
        }
        print(json.dumps(row), flush=True)


def compile_all(shapes: list[tuple]) -> list[dict]:
    """Each shape compiled, one worker process per device count."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    found: dict[int, dict] = {}
    for devices in sorted({s[2] for s in shapes}):
        indices = [i for i, s in enumerate(shapes) if s[2] == devices]
        runs = [planned(shapes[i])[1]["flags"].split() for i in indices]
        done = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps([devices, runs])],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
        )
        if done.returncode:
            raise RuntimeError(
                f"compiling on {devices} devices:\n{done.stderr[-3000:]}"
            )
        for i, line in zip(indices, done.stdout.splitlines(), strict=True):
            found[i] = json.loads(line)
    return [found[i] for i in range(len(shapes))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*json.loads(args.worker))
        return
    import jax

    rows = []
    for shape, compiled in zip(SHAPES, compile_all(SHAPES), strict=True):
        name, chip, chips, slices, model, seq_len, strategy, mesh = shape
        flags = planned(shape)[1]["flags"]
        rows.append(
            {
                **dict(name=name, chip=chip, chips=chips, slices=slices, model=model),
                **dict(seq_len=seq_len, strategy=strategy, mesh=mesh, flags=flags),
                "compiled": compiled,
            }
        )
        gb = {k: compiled[k] / 1e9 for k in ("arguments", "temporaries", "total")}
        print(f"{name:12} {model:>4} {mesh:18} {gb['total']:7.2f} GB a chip", end="")
        print(
            "".join(
                f"  {a}: {sum(b.values()) / 1e9:.1f} GB"
                for a, b in compiled["by_axis"].items()
            )
        )
    meta = {
        "date": datetime.date.today().isoformat(),
        "jax_version": jax.__version__,
        "compiler": COMPILER,
        "machine": platform.machine(),
        "sequences_per_chip": 1,
        "command": "python benchmarks/tpu_meshes.py",
    }
    pathlib.Path(args.out).write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
