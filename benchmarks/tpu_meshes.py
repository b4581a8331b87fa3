"""The LM recipe's step compiled for two TPU shapes: memory per chip and bytes per mesh axis.

A v5e-256 (one slice of 256 chips, 16 GB each) training the 8b model, and two v5p-128
slices (2 x 64 chips, 95 GiB each, joined by the data-center network) training the 70b one,
each under two meshes: the planner's first choice (``python -m jaxdist_lessons.planning
--chip "TPU v5e"``, with ``--nodes 2`` for the two slices) and one to set beside it. Each row
is ``jaxdist_lm/train.py``'s step for the flags the planner prints, compiled as
``--compile-only --num-devices N`` compiles it (one process per device count, JAX started
once): the memory XLA assigns each device, the bytes of each collective kind per device and
step (``compiled.collective_bytes``: loops times their trip counts), and the same bytes split
by the mesh axes each collective's groups span (``profiling.collective_bytes_by_axis``).

Each shape is compiled twice. First by XLA:CPU on simulated devices (``compiled``): XLA:CPU
moves float32 in its collectives and all-reduces whole gradients where a TPU compile
reduce-scatters them, and on a CPU the recipe's attention is the chunked blocks. Then, with
``--libtpu DIR`` (a folder holding libtpu: ``pip install --target DIR -r
requirements-libtpu.txt``), by the TPU compiler itself for the slices' topology, with no
TPU (``tpu_compiled``: train.py's ``--topology v5e:16x16`` and ``--slices``): the memory a
chip would hold, splash attention as the Mosaic kernels a TPU runs, and the gradients'
reduction across slices as the sends over the data-center network that the program makes
(``dcn-all-reduce``). Writes ``book/data/tpu_meshes.json``, which the "Running on TPUs"
page reads and ``tests/test_tpu_meshes.py`` checks.

    python benchmarks/tpu_meshes.py                  # XLA:CPU: 4 compiles, about a minute
    python benchmarks/tpu_meshes.py --libtpu .libtpu # and the TPU compiler: about 15 minutes
    python benchmarks/tpu_meshes.py --out /tmp/tpu_meshes.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxdist_lessons import hardware  # noqa: E402  (the checkout's package)
from jaxdist_lessons.planning import checking, layouts, ranking  # noqa: E402
from jaxdist_lm import model_config  # noqa: E402  (the recipe's)

OUT = ROOT / "book" / "data" / "tpu_meshes.json"
COMPILER = "XLA:CPU's compile of simulated devices"
TPU_COMPILER = "libtpu's compile for the slices' topology, no TPU"

# What a team rents -> libtpu's name for one slice's topology, and how many slices: a
# v5e-256 is 16 x 16 chips; a v5p-128 counts TensorCores, 64 chips of two, 4 x 4 x 4
# (MaxText's accelerator_to_spec_map.py has the same names).
TOPOLOGIES = {"v5e-256": ("v5e:16x16", 1), "2 x v5p-128": ("v5p:4x4x4", 2)}

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
    for each argv and print one JSON line each. An argv with --topology compiles for
    that TPU slice instead (libtpu on PYTHONPATH). One that the recipe refuses, or that
    does not fit its chips' memory, prints the recipe's or the TPU compiler's words."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    from jaxdist_lessons import profiling
    from jaxdist_lm import compiled as compiled_lib
    from jaxdist_lm import train

    for argv in runs:
        start = time.perf_counter()
        run = train.parse_args([*argv, "--compile-only"])
        try:
            with contextlib.redirect_stdout(sys.stderr):  # setup's notes; stdout: JSON
                mesh, model, _, step, shapes, _ = train.setup(
                    run, train.target_devices(run)
                )
        except SystemExit as refused:  # the recipe's one line (a mesh it refuses)
            print(json.dumps({"error": str(refused.code)}), flush=True)
            continue
        try:
            program = compiled_lib.lower_step(step, shapes, run, mesh).compile()
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            print(json.dumps({"error": str(error).splitlines()[0][:400]}), flush=True)
            continue
        memory, text = program.memory_analysis(), program.as_text()
        row = {
            "arguments": memory.argument_size_in_bytes,
            "temporaries": memory.temp_size_in_bytes,
            "total": compiled_lib.program_total(memory),
            "collectives": compiled_lib.collective_bytes(text),
            "by_axis": profiling.collective_bytes_by_axis(text, mesh),
            "attention": model.attention,
            "compile_seconds": round(time.perf_counter() - start, 1),
        }
        print(json.dumps(row), flush=True)


def run_worker(devices: int, runs: list[list[str]], env: dict) -> list[dict]:
    """``worker`` in a subprocess: its JSON lines."""
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps([devices, runs])],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if done.returncode:
        raise RuntimeError(f"compiling {runs}:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines()]


def compile_all(shapes: list[tuple]) -> list[dict]:
    """Each shape compiled by XLA:CPU, one worker process per device count."""
    found: dict[int, dict] = {}
    for devices in sorted({s[2] for s in shapes}):
        indices = [i for i, s in enumerate(shapes) if s[2] == devices]
        runs = [planned(shapes[i])[1]["flags"].split() for i in indices]
        for i, row in zip(
            indices,
            run_worker(devices, runs, checking.compile_environment()),
            strict=True,
        ):
            found[i] = row
    return [found[i] for i in range(len(shapes))]


def compile_for_tpus(shapes: list[tuple], libtpu: str) -> list[dict]:
    """Each shape compiled by the TPU compiler for its slices (TOPOLOGIES), one worker
    process per shape: the flags the planner prints, the attention left to the recipe
    (splash, on TPUs)."""
    rows = []
    for shape in shapes:
        topology, slices = TOPOLOGIES[shape[0]]
        flags = planned(shape)[1]["flags"].split()
        flags += ["--topology", topology, "--slices", str(slices)]
        [row] = run_worker(
            1,
            [flags],
            checking.compile_environment(str(pathlib.Path(libtpu).resolve())),
        )
        rows.append({"topology": topology, **row})
        print(f"  {shape[0]} {shape[7]}: {row.get('total', row.get('error'))}")
    return rows


def libtpu_version(libtpu: str) -> str:
    """The version of the libtpu in the folder ``libtpu``."""
    import importlib.metadata

    [found] = importlib.metadata.distributions(name="libtpu", path=[libtpu])
    return found.version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--libtpu", metavar="DIR", help="also compile with the libtpu in DIR"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*json.loads(args.worker))
        return
    import jax

    rows = []
    tpu_rows = compile_for_tpus(SHAPES, args.libtpu) if args.libtpu else None
    for i, (shape, compiled) in enumerate(
        zip(SHAPES, compile_all(SHAPES), strict=True)
    ):
        name, chip, chips, slices, model, seq_len, strategy, mesh = shape
        flags = planned(shape)[1]["flags"]
        rows.append(
            {
                **dict(name=name, chip=chip, chips=chips, slices=slices, model=model),
                **dict(seq_len=seq_len, strategy=strategy, mesh=mesh, flags=flags),
                "compiled": compiled,
                **({"tpu_compiled": tpu_rows[i]} if tpu_rows else {}),
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
        "command": "python benchmarks/tpu_meshes.py"
        + (" --libtpu DIR" if args.libtpu else ""),
    }
    if args.libtpu:
        meta["tpu_compiler"] = TPU_COMPILER
        meta["libtpu_version"] = libtpu_version(args.libtpu)
    pathlib.Path(args.out).write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
