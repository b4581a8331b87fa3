"""One short run on a GPU machine: the GPU page's checks and the LM recipe, measured against the planner.

From the repository root, with the devices JAX finds, each part a child process, all of
them within ``--budget`` (480 s by default: what one H200 session allows; no GPU run has
been timed yet):

1. ``examples/preflight.py``: driver, CUDA, NCCL, GPUs, links and traps;
2. ``examples/bandwidth.py``: collectives over every device, to 1 GiB (with one GPU,
   copies between pinned host memory and the GPU instead);
3. ``python -m jaxdist_lessons.planning``: the planner's best layout for the recipe at
   ``1b`` (bfloat16, sequences of 2,048, 8 a device, 2 micro-batches a step) and its
   predicted step time, MFU and memory;
4. ``python -m jaxdist_lm.train`` with that layout's flags and cuDNN's attention:
   ``--compile-only`` (the memory the GPU compiler assigns a device), then 30 steps with
   ``--profile`` (median tokens/s, step time and MFU after the first five; peak memory);
5. the trace of steps 6 to 8, its time per mesh axis (``profiling.recipe_time_by_axis``).

It writes ``report.json`` (what the book reads: copy it to ``book/data/gpu_report.json``)
and ``report.md`` into ``--out``, with each part's full output. A failed part is a line of
the report, not the end of the run. On a machine without an accelerator it prints what it
would run and exits, as ``--dry-run`` does anywhere; ``--small`` runs the same parts on 8 simulated CPU devices with the
tiny model (a dry run of the machinery, not a measurement). ``--chapters`` also runs
chapters under nbmake (``all``: every one; minutes each, outside the budget).

    python benchmarks/gpu_report.py --out gpu-report        # on the GPU machine
    python benchmarks/gpu_report.py --out /tmp/r --small    # a dry run on a CPU
    python benchmarks/gpu_report.py --show book/data/gpu_report.json   # its tables
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUDGET = 480  # seconds: the whole run, on one H200
STEPS = 30  # recipe steps on the accelerator; the first five are left out
SMALL_DEVICES = 8


def chapters(names: Sequence[str] | None = None) -> list[pathlib.Path]:
    """The book's notebooks (``book/*.ipynb``), or those named (``02_device_mesh``)."""
    found = sorted((ROOT / "book").glob("*.ipynb"))
    if not names or names == ["all"]:
        return found
    by_name = {p.stem: p for p in found}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SystemExit(f"no chapter {missing}; the chapters are {sorted(by_name)}")
    return [by_name[n] for n in names]


def run(
    command: Sequence[str],
    log: pathlib.Path,
    timeout: float,
    env: dict[str, str] | None = None,
) -> tuple[bool, float]:
    """Run ``command`` from the repository root, its output into ``log``; (passed, seconds)."""
    environ = {k: v for k, v in os.environ.items() if k != "JAXDIST_NUM_DEVICES"}
    if timeout <= 0:
        log.write_text("not run: the budget was spent\n")
        return False, 0.0
    start = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env={**environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        log.write_text(done.stdout + done.stderr)
        passed = done.returncode == 0
    except subprocess.TimeoutExpired as err:
        out = [
            x.decode() if isinstance(x, bytes) else x or ""
            for x in (err.stdout, err.stderr)
        ]
        log.write_text(f"timed out after {timeout:g} s\n{''.join(out)}")
        passed = False
    return passed, time.monotonic() - start


def machine(python: str) -> dict:
    """What JAX finds here (in a child process: this one never starts JAX)."""
    program = (
        "import json, jax; d = jax.devices()[0]; print(json.dumps({'devices': "
        "jax.device_count(), 'platform': d.platform, 'device_kind': d.device_kind, "
        "'jax': jax.__version__}))"
    )
    done = subprocess.run(
        [python, "-c", program], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def chip_name(device_kind: str) -> str:
    """The planner's ``--chip`` for a ``device_kind`` (exactly as JAX reports it); an
    H100's on a machine the hardware table does not know (the prediction says which)."""
    sys.path.insert(0, str(ROOT))
    from jaxdist_lessons import hardware

    found = hardware.chip_for_kind(device_kind)
    return next(k for k, c in hardware.CHIPS.items() if c is found) if found else "h100"


def plan_command(python: str, devices: int, chip: str, small: bool) -> list[str]:
    """The planner, for the recipe's run at this machine's size, as JSON."""
    model = (
        ["--model", "tiny", "--seq-len", "128"]
        if small
        else ["--model", "1b", "--seq-len", "2048"]
    )
    per_device = 2 if small else 8
    return [
        python,
        "-m",
        "jaxdist_lessons.planning",
        *model,
        "--devices",
        str(devices),
        "--chip",
        chip,
        "--global-batch",
        str(per_device * devices),
        "--dtype",
        "bfloat16",
        "--grad-accum",
        "2",
        "--json",
    ]


def chosen_row(plan: dict) -> dict:
    """The planner's first row that fits and that the recipe runs: its pick."""
    rows = [r for r in plan["rows"] if r["fits"] and r["runnable"]]
    if not rows:
        raise ValueError(
            "the planner found no layout that fits and that the recipe runs"
        )
    return rows[0]


def recipe_commands(
    python: str, flags: str, small: bool, trace_dir: pathlib.Path
) -> dict[str, list[str]]:
    """The recipe's compile-only run and its training run (profiled), with ``flags``
    from the planner's row."""
    train = [python, "-m", "jaxdist_lm.train", *flags.split()]
    if small:
        train += ["--num-devices", str(SMALL_DEVICES)]
    else:
        train += ["--attention", "cudnn"]
    steps = ["--steps", str(10 if small else STEPS), "--profile", str(trace_dir)]
    return {"compile-only": [*train, "--compile-only"], "train": [*train, *steps]}


def step_summary(text: str, skip: int = 5) -> dict | None:
    """The median tokens/s, step time (ms) and MFU (or None: no known peak) of the steps
    after the first ``skip``, and the peak memory a device held (GB, or None)."""
    rows = re.findall(
        r"^step (\d+) loss \S+ .*?tokens/s ([\d,]+) step_time (\d+) ms(?: mfu ([\d.]+)%)?",
        text,
        re.M,
    )
    rows = [row for row in rows if int(row[0]) > skip]
    if not rows:
        return None
    mfus = [float(r[3]) / 100 for r in rows if r[3]]
    peak = re.search(r"^peak memory per device ([\d.]+) GB", text, re.M)
    return {
        "steps": [int(rows[0][0]), int(rows[-1][0])],
        "tokens_per_second": statistics.median(
            float(r[1].replace(",", "")) for r in rows
        ),
        "step_ms": statistics.median(float(r[2]) for r in rows),
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_memory_gb": float(peak[1]) if peak else None,
    }


def compiled_memory(text: str) -> dict | None:
    """``--compile-only``'s memory per device, in GB (the recipe's ``read_summary``)."""
    sys.path.insert(0, str(ROOT))
    from jaxdist_lm import compiled as compiled_lib

    try:
        found = compiled_lib.read_summary(text)
    except ValueError:  # no summary printed
        return None
    return {f"{key}_gb": found[key] for key in ("arguments", "temporaries", "total")}


def first_json(text: str) -> dict:
    """The JSON object a part printed first (its log holds stdout, then stderr)."""
    return json.JSONDecoder().raw_decode(text, text.index("{"))[0]


def largest_messages(rows: list[dict]) -> dict[str, dict]:
    """Each collective's (or copy's) row at its largest size."""
    return {r["collective"]: r for r in rows}


def comparisons(report: dict) -> dict[str, float]:
    """Measured over predicted: step time against the planner, peak memory against the
    compile-only memory, the compile-only memory against the planner's."""
    plan, train, memory = (
        report.get(k) or {} for k in ("plan", "train", "compile_only")
    )
    pairs = {
        "step time, measured / planner": (train.get("step_ms"), plan.get("step_ms")),
        "peak memory / compile-only total": (
            train.get("peak_memory_gb"),
            memory.get("total_gb"),
        ),
        "compile-only total / planner": (memory.get("total_gb"), plan.get("memory_gb")),
    }
    return {name: a / b for name, (a, b) in pairs.items() if a is not None and b}


def shown(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or "n/a" for a number the run did not give."""
    return "n/a" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    """The report's tables, as the book shows them."""
    where = report["machine"]
    lines = [
        f"# {where['devices']} x {where['device_kind']} ({where['platform']}), "
        f"jax {where['jax']}, {report['date']}",
        "",
        "| part | passed | seconds | command |",
        "|---|---|---|---|",
    ]
    for name, part in report["parts"].items():
        ok = "yes" if part["passed"] else "NO"
        lines.append(f"| {name} | {ok} | {part['seconds']:.0f} | `{part['command']}` |")
    if report.get("bandwidth"):
        lines += ["", "| collective | size (B) | busbw (GB/s) |", "|---|---|---|"]
        for name, r in report["bandwidth"].items():
            lines.append(f"| {name} | {r['size']:,} | {r['busbw_gbps']:.1f} |")
    plan, train = report.get("plan") or {}, report.get("train") or {}
    memory = report.get("compile_only") or {}
    if plan or train:
        layout = f"`{plan.get('mesh', 'n/a')}` ({plan.get('strategy', '')})"
        lines += [
            "",
            "| | planner (predicted) | measured |",
            "|---|---|---|",
            f"| layout | {layout} | the same flags |",
        ]
        for name, key, spec in (
            ("step time (ms)", "step_ms", ".0f"),
            ("tokens/s (all devices)", "tokens_per_second", ",.0f"),
            ("MFU", "mfu", ".1%"),
        ):
            lines.append(
                f"| {name} | {shown(plan.get(key), spec)} "
                f"| {shown(train.get(key), spec)} |"
            )
        lines.append(
            f"| memory per device (GB) | {shown(plan.get('memory_gb'), '.2f')} "
            f"| {shown(train.get('peak_memory_gb'), '.2f')} peak, "
            f"{shown(memory.get('total_gb'), '.2f')} compile-only |"
        )
    if report.get("ratios"):
        lines.append("")
        lines += [f"- {name}: {ratio:.2f}" for name, ratio in report["ratios"].items()]
    if report.get("attribution"):
        lines += [
            "",
            "| axis | ms (all devices) | exposed ms | collectives |",
            "|---|---|---|---|",
        ]
        for axis, r in report["attribution"].items():
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(r["collectives"].items()))
            lines.append(
                f"| {axis} | {r['ms']:.1f} | {r['exposed_ms']:.1f} | {kinds} |"
            )
    if report.get("chapters"):
        lines += ["", "| chapter | passed | seconds |", "|---|---|---|"]
        for name, r in report["chapters"].items():
            lines.append(
                f"| {name} | {'yes' if r['passed'] else 'NO'} | {r['seconds']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def would_run(budget: float) -> str:
    """What a run does on a GPU machine, command by command."""
    plan = plan_command("python", 8, "h200", False)[1:]
    plan = " ".join(plan[:6]) + " \\\n      " + " ".join(plan[6:])
    return (
        f"On a GPU machine this runs, within {budget:.0f} s:\n"
        "  python examples/preflight.py\n"
        "  python examples/bandwidth.py --json BANDWIDTH.json\n"
        f"  python {plan}\n"
        "    (with the machine's --devices, --chip and 8 sequences a device)\n"
        "  python -m jaxdist_lm.train FLAGS --attention cudnn --compile-only\n"
        f"  python -m jaxdist_lm.train FLAGS --attention cudnn --steps {STEPS} "
        "--profile TRACE\n"
        "  profiling.recipe_time_by_axis(FLAGS, TRACE/process_0)\n"
        "where FLAGS are those of the planner's first layout that fits and that the\n"
        "recipe runs."
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", type=pathlib.Path, default=pathlib.Path("gpu-report"), help="folder")
    add("--small", action="store_true", help="a dry run on 8 simulated CPU devices")
    add("--budget", type=float, default=BUDGET, help="seconds for the whole run")
    add("--chapters", nargs="*", help="also run these chapters (all: every one)")
    add("--show", type=pathlib.Path, metavar="JSON", help="print a report's tables")
    add("--dry-run", action="store_true", help="print what a run does, run nothing")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.show:
        print(markdown(json.loads(args.show.read_text())), end="")
        return None
    python = sys.executable
    if args.dry_run:
        print(would_run(args.budget))
        return None
    found = machine(python)
    if found["platform"] == "cpu" and not args.small:
        print(
            f"No accelerator here ({found['devices']} CPU device(s)): nothing measured."
        )
        print(would_run(args.budget))
        return None
    if args.small:
        found = {**found, "devices": SMALL_DEVICES}
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    small_env = (
        {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(SMALL_DEVICES)}
        if args.small
        else {}
    )
    report: dict = {
        "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "host": os.uname().nodename,
        "machine": found,
        "small": args.small,
        "parts": {},
    }

    def part(
        name: str, command: list[str], env: dict | None = None, said: str = ""
    ) -> str | None:
        """Run one part within what is left of the budget; its output, or None."""
        log = out / f"{name}.txt"
        passed, seconds = run(command, log, deadline - time.monotonic(), env)
        said = said or " ".join(str(c) for c in command[1:])
        report["parts"][name] = {"command": said, "passed": passed, "seconds": seconds}
        return log.read_text() if passed else None

    text = part("preflight", [python, "examples/preflight.py"])
    report["preflight"] = text
    bandwidth = [python, "examples/bandwidth.py", "--json", str(out / "bandwidth.json")]
    if args.small:
        bandwidth += f"--num-devices {SMALL_DEVICES} --max-bytes 4096 --iters 3".split()
    if part("bandwidth", bandwidth) is not None:
        rows = json.loads((out / "bandwidth.json").read_text())["rows"]
        report["bandwidth"] = largest_messages(rows)
    chip = chip_name(found["device_kind"])
    text = part("plan", plan_command(python, found["devices"], chip, args.small))
    try:
        row = chosen_row(first_json(text)) if text else None
    except ValueError as error:  # no layout fits: the report says so
        row, report["plan"] = None, {"error": str(error)}
    if row:
        devices = found["devices"]
        report["plan"] = {
            "chip": chip,
            "strategy": row["strategy"],
            "mesh": row["mesh"],
            "flags": row["flags"],
            "step_ms": row["step_seconds"] * 1e3,
            "tokens_per_second": row["tokens_per_second_per_device"] * devices,
            "mfu": row["mfu"],
            "memory_gb": row["memory_gb"]["total"],
        }
        trace = out / "trace"
        commands = recipe_commands(python, row["flags"], args.small, trace)
        text = part("compile-only", commands["compile-only"])
        report["compile_only"] = compiled_memory(text) if text else None
        text = part("train", commands["train"])
        report["train"] = step_summary(text) if text else None
        flags = [*row["flags"].split()] + (
            [] if args.small else ["--attention", "cudnn"]
        )
        program = (
            "import json, sys; from jaxdist_lessons import profiling; "
            "print(json.dumps(profiling.recipe_time_by_axis(sys.argv[2:], sys.argv[1])))"
        )
        said = f"profiling.recipe_time_by_axis(FLAGS, {trace / 'process_0'})"
        command = [python, "-c", program, str(trace / "process_0"), *flags]
        text = part("attribution", command, small_env, said)
        report["attribution"] = first_json(text) if text else None
    report["ratios"] = comparisons(report)
    for notebook in chapters(args.chapters) if args.chapters else []:
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake"]
        passed, seconds = run(
            [*command, str(notebook.relative_to(ROOT))],
            out / f"{notebook.stem}.txt",
            1800,
        )
        report.setdefault("chapters", {})[notebook.stem] = {
            "passed": passed,
            "seconds": seconds,
        }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    print(markdown(report), end="")
    return report


if __name__ == "__main__":
    main()
