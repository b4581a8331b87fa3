"""What the XLA TPU flags of the "Running on TPUs" page change in the recipe's compiled step.

libtpu reads its compiler's flags from ``LIBTPU_INIT_ARGS`` when JAX starts it, so each flag
set gets a process of its own. Each compiles ``jaxdist_lm/train.py``'s step for a TPU slice
that is not here (``--compile-only --topology``; libtpu in a folder of its own, no TPU):
the 125m model, 2,048 tokens a sequence, one sequence a chip, under ``fsdp=16`` on a v5e 4x4,
and under ``data=2,fsdp=16`` on two of them for the flags of a data axis across slices. For
each it records whether libtpu took the flags, the memory a chip holds, the bytes of each
collective kind, how many collectives are asynchronous and how many run inside
"continuation fusions" (the TPU compiler's ``async_collective_fusion`` computations), and a
hash of the compiled program's text, to tell a flag that changes nothing (compare hashes
within one run: the text names the recipe's source lines, which an edit moves). (The compiler's
``cost_analysis()["optimal_seconds"]`` came out negative for these programs: not kept.)
Writes ``book/data/tpu_flags.json``.

    pip install --target .libtpu -r requirements-libtpu.txt
    python benchmarks/tpu_flags.py --libtpu .libtpu      # 6 compiles, about 2 minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxdist_lessons.planning import checking  # noqa: E402  (the checkout's package)

OUT = ROOT / "book" / "data" / "tpu_flags.json"

ONE_SLICE = "--mesh fsdp=16 --topology v5e:4x4"
TWO_SLICES = "--mesh data=2,fsdp=16 --topology v5e:4x4 --slices 2"
RUN = "--model 125m --seq-len 2048 --dtype bfloat16"
OVERLAP = [
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
]
DCN = [
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
]
# (name, the slices, LIBTPU_INIT_ARGS)
CASES = [
    ("default", ONE_SLICE, []),
    (
        "continuation fusion off",
        ONE_SLICE,
        ["--xla_tpu_enable_async_collective_fusion=false"],
    ),
    ("MaxText's overlap flags", ONE_SLICE, OVERLAP),
    ("scoped VMEM 96 MiB", ONE_SLICE, ["--xla_tpu_scoped_vmem_limit_kib=98304"]),
    ("default, two slices", TWO_SLICES, []),
    ("MaxText's DCN flags, two slices", TWO_SLICES, DCN),
    # libtpu must refuse a flag it does not know, or "it took every flag" means nothing
    ("a misspelled flag", ONE_SLICE, ["--xla_tpu_enable_async_colective_fusion=true"]),
]


def worker(argv: list[str]) -> None:
    """Compile train.py's step for ``argv`` in this process (LIBTPU_INIT_ARGS already
    set) and print one JSON line."""
    import hashlib
    import re

    from jaxdist_lm import compiled as compiled_lib
    from jaxdist_lm import train

    chips = 16 * (2 if "--slices" in argv else 1)
    run = train.parse_args([*argv, "--global-batch", str(chips), "--compile-only"])
    mesh, _, _, step, shapes, _ = train.setup(run, train.target_devices(run))
    program = compiled_lib.lower_step(step, shapes, run, mesh).compile()
    text, memory = program.as_text(), program.memory_analysis()
    row = {
        "total": compiled_lib.program_total(memory),
        "temporaries": memory.temp_size_in_bytes,
        "collectives": compiled_lib.collective_bytes(text),
        "async_starts": len(
            re.findall(r'custom_call_target="AsyncCollectiveStart"', text)
        )
        + len(re.findall(r" [a-z-]+-start\(", text)),
        "continuation_fusions": len(
            re.findall(r"^%async_collective_fusion", text, re.MULTILINE)
        ),
        "program_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    print(json.dumps(row), flush=True)


def run_case(libtpu: str, slices: str, flags: list[str]) -> dict:
    """One flag set in a process of its own: its JSON line, or what libtpu said."""
    env = checking.compile_environment(libtpu)
    env["LIBTPU_INIT_ARGS"] = " ".join(flags)
    argv = [*RUN.split(), *slices.split()]
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1][:400]}
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libtpu", metavar="DIR", help="a folder holding libtpu")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if not args.libtpu:
        parser.error(
            "--libtpu DIR: pip install --target DIR -r requirements-libtpu.txt"
        )

    libtpu = str(pathlib.Path(args.libtpu).resolve())
    rows = []
    for name, slices, flags in CASES:
        row = {"name": name, "slices": slices, "flags": flags}
        row.update(run_case(libtpu, slices, flags))
        rows.append(row)
        print(f"{name:34} {row.get('total', row.get('error'))}", flush=True)
    meta = libtpu_meta(libtpu, RUN, "python benchmarks/tpu_flags.py --libtpu DIR")
    pathlib.Path(args.out).write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    )


def libtpu_meta(libtpu: str, run: str, command: str) -> dict[str, str]:
    """The line a libtpu compile's JSON keeps: the date, JAX's and libtpu's versions
    (the copy in the folder ``libtpu``), the recipe's flags and the command."""
    import importlib.metadata

    import jax

    [found] = importlib.metadata.distributions(name="libtpu", path=[libtpu])
    return {
        "date": datetime.date.today().isoformat(),
        "jax_version": jax.__version__,
        "libtpu_version": found.version,
        "run": run,
        "machine": platform.machine(),
        "command": command,
    }


if __name__ == "__main__":
    main()
