"""The whole book on an accelerator machine, in one run: a report of what passed and what it measured.

Runs, from the repository root, with the devices JAX finds (no JAXDIST_NUM_DEVICES):

1. ``python -m jaxdist_lessons.doctor``: the versions, whether JAX is an accelerator build, and what
   each chapter's ``devices.setup`` chooses here;
2. every chapter under pytest's nbmake, one at a time: pass or fail and the seconds it took;
3. ``benchmarks/resnet50.py`` (images per second and flops utilisation) and
   ``benchmarks/strategies.py``;
4. the LM recipe, ``examples/lm/train.py``: the ``1b`` preset in bfloat16 on every device of
   the node (FSDP), with cuDNN's attention and 2 micro-batches a step (``--attention cudnn
   --grad-accum 2``), its tokens per second, step time and MFU (the median of the steps after
   the first five), and its ``--compile-only`` memory per device as the GPU compiler assigns it;

and writes ``report.md`` (and each step's full output) into ``--out``. It stops nothing on a
failure: a failed chapter is a row in the report.

    python benchmarks/gpu_report.py --out gpu-report            # on the GPU or TPU machine
    python benchmarks/gpu_report.py --out /tmp/r --small --chapters 00_preface   # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from tqdm import tqdm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def chapters(names: Sequence[str] | None = None) -> list[pathlib.Path]:
    """The book's notebooks (``book/*.ipynb``), or those named (``02_device_mesh``)."""
    found = sorted((ROOT / "book").glob("*.ipynb"))
    if not names:
        return found
    by_name = {p.stem: p for p in found}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SystemExit(f"no chapter {missing}; the chapters are {sorted(by_name)}")
    return [by_name[n] for n in names]


def run(
    command: Sequence[str], log: pathlib.Path, timeout: float
) -> tuple[bool, float]:
    """Run ``command`` from the repository root, its output into ``log``; (passed, seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "JAXDIST_NUM_DEVICES"}
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        log.write_text(done.stdout + done.stderr)
        passed = done.returncode == 0
    except subprocess.TimeoutExpired as err:
        log.write_text(
            f"timed out after {timeout} s\n{err.stdout or ''}{err.stderr or ''}"
        )
        passed = False
    return passed, time.monotonic() - start


def table_lines(text: str) -> str:
    """The lines of a benchmark's output that belong to its tables and environment line."""
    return "\n".join(line for line in text.splitlines() if line.strip())


def lm_commands(python: str, devices: int, small: bool) -> dict[str, list[str]]:
    """The LM recipe's training run and compile-only run for this machine's ``devices``."""
    if small:
        model = ["--model", "tiny", "--seq-len", "128"]
        batch = ["--global-batch", str(4 * devices)]
    else:  # cuDNN's fused attention, and 2 micro-batches of 4 sequences a device
        model = ["--model", "1b", "--attention", "cudnn"]
        batch = ["--global-batch", str(8 * devices), "--grad-accum", "2"]
    sizes = [*model, "--mesh", f"fsdp={devices}", *batch]
    train = [python, "examples/lm/train.py", *sizes, "--dtype", "bfloat16"]
    steps = ["--steps", "8" if small else "40"]
    return {"train": [*train, *steps], "compile-only": [*train, "--compile-only"]}


def lm_summary(text: str, skip: int = 5) -> str:
    """The median tokens/s, step time and MFU of the steps after the first ``skip``."""
    rows = re.findall(
        r"^step (\d+) loss \S+ .*?tokens/s ([\d,]+) step_time (\d+) ms(?: mfu ([\d.]+)%)?",
        text,
        re.M,
    )
    rows = [row for row in rows if int(row[0]) > skip]
    if not rows:
        return f"no step after the first {skip} finished"
    tokens = statistics.median(float(r[1].replace(",", "")) for r in rows)
    step_ms = statistics.median(float(r[2]) for r in rows)
    mfus = [float(r[3]) for r in rows if r[3]]
    mfu = (
        f", MFU {statistics.median(mfus):.1f}%" if mfus else ", MFU n/a (no known peak)"
    )
    return f"median of steps {rows[0][0]}-{rows[-1][0]}: {tokens:,.0f} tokens/s, {step_ms:.0f} ms/step{mfu}"


def device_count(python: str) -> int:
    """How many devices JAX finds here (in a child process: this one never starts JAX)."""
    done = subprocess.run(
        [python, "-c", "import jax; print(jax.device_count())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split()[-1])


def main(argv: Sequence[str] | None = None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=pathlib.Path, required=True, help="folder for the report"
    )
    parser.add_argument("--chapters", nargs="*", help="chapter names; default: all")
    parser.add_argument(
        "--small", action="store_true", help="CPU-sized benchmarks (a dry run)"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per step")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable

    doctor_ok, _ = run(
        [python, "-m", "jaxdist_lessons.doctor"], out / "doctor.txt", 300
    )
    rows = []
    for notebook in tqdm(chapters(args.chapters), desc="chapters", unit="chapter"):
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake"]
        passed, seconds = run(
            [*command, str(notebook.relative_to(ROOT))],
            out / f"{notebook.stem}.txt",
            args.timeout,
        )
        rows.append(
            f"| {notebook.stem} | {'pass' if passed else 'FAIL'} | {seconds:.0f} |"
        )
    # strategies.py is CPU-sized already; only resnet50.py has a --small size
    small = {"resnet50.py": ["--small"] if args.small else [], "strategies.py": []}
    benchmarks = {}
    for script in ("resnet50.py", "strategies.py"):
        log = out / script.replace(".py", ".txt")
        passed, _ = run(
            [python, f"benchmarks/{script}", *small[script]], log, args.timeout
        )
        benchmarks[script] = (passed, log.read_text())
    devices = 8 if args.small else device_count(python)
    lm = {}
    for name, command in lm_commands(python, devices, args.small).items():
        if args.small:
            command = [*command, "--num-devices", "8"]
        log = out / f"lm-{name}.txt"
        passed, _ = run(command, log, args.timeout)
        text = log.read_text()
        summary = (
            lm_summary(text) if name == "train" else text.strip().splitlines()[-1:]
        )
        lm[name] = (passed, " ".join(command[1:]), summary)

    report = [
        f"# jaxdist on {os.uname().nodename}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "## Environment (`python -m jaxdist_lessons.doctor`)",
        "",
        "```",
        (out / "doctor.txt").read_text().rstrip()
        + ("" if doctor_ok else "\n(doctor failed)"),
        "```",
        "",
        "## Chapters (pytest --nbmake, one at a time)",
        "",
        "| chapter | result | seconds |",
        "|---|---|---|",
        *rows,
    ]
    for script, (passed, text) in benchmarks.items():
        status = "" if passed else " (FAILED: see its log)"
        report += [
            "",
            f"## benchmarks/{script}{status}",
            "",
            "```",
            table_lines(text),
            "```",
        ]
    report += ["", "## The LM recipe (examples/lm/train.py)", ""]
    for passed, command, summary in lm.values():
        status = "" if passed else " (FAILED: see its log)"
        text = summary if isinstance(summary, str) else "\n".join(summary)
        report += [f"`{command}`{status}", "", "```", text, "```", ""]
    path = out / "report.md"
    path.write_text("\n".join(report) + "\n")
    print(path.read_text())
    return path


if __name__ == "__main__":
    main()
