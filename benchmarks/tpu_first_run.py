"""What a first session on a TPU VM meets, recorded on the chip, and one profiled step.

Each part runs as its own program, one after another (a TPU is held by one program at a time):

1. ``import jax; jax.devices()``: the devices, and the warnings JAX prints as it starts
   (on a v5e or newer without transparent hugepages, a warning about them);
2. the same while another program holds the chip: what the second program is told, and
   whether ``/tmp/libtpu_lockfile`` exists meanwhile and after the holder ends;
3. ``jax.distributed.initialize()`` with no arguments and no launcher: how it ends;
4. ``python -m jaxdist_lm.train --profile DIR`` at 125m (splash attention, 16 sequences of
   2,048 tokens) on the chip: its step lines, and its trace read with
   ``profiling.read_trace`` (the traced steps' span on the chip, the time the chip ran an
   operation of the step within it, the operations that took the most time). On the
   v5e on 2026-12-06 the trace's ``trace.json.gz`` held no XLA operations for it to read
   (``events``: 0); XProf reads the ``xplane.pb`` beside it.

Writes ``--out/tpu_first_run.json`` (the TPU page reads ``book/data/tpu_first_run.json``)
with the date, the chip's ``device_kind`` and the JAX version; refuses where there is no TPU.

    source .whl-tpu/install.sh && python benchmarks/tpu_first_run.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LOCK = pathlib.Path("/tmp/libtpu_lockfile")
HOLD = "import jax, time; jax.devices(); print('holding', flush=True); time.sleep(120)"
SHOW = "import jax; d = jax.devices(); print(jax.default_backend(), d[0].device_kind)"
RECIPE = "--model 125m --mesh data=1 --dtype bfloat16 --seq-len 2048 --attention splash"


def python(code: str, timeout: float = 240) -> dict:
    """``python -c code``: its exit status, output, warnings, last line of errors, seconds."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        status, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as late:
        status, out, err = "timeout", str(late.stdout or ""), str(late.stderr or "")
    lines = err.strip().splitlines()
    return {
        "returncode": status,
        "stdout": out.strip()[-2000:],
        # a warning's source from jax/ on (the installation's own path left out)
        "warnings": [
            re.sub(r"^\S*?(jax/)", r"\1", w) for w in lines if "Warning: " in w
        ],
        "error": lines[-1] if status and lines else "",
        "seconds": round(time.perf_counter() - start, 1),
    }


def while_held() -> dict:
    """A second program that opens the chip while a first one holds it."""
    before = LOCK.exists()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True
    )
    try:
        ready = holder.stdout.readline().strip() == "holding"
        locked = LOCK.exists()
        second = python(SHOW)
    finally:
        holder.terminate()
        holder.wait(timeout=60)
    return {
        "lockfile_before": before,
        "holder_ready": ready,
        "lockfile_while_held": locked,
        "second": second,
        "lockfile_after": LOCK.exists(),
    }


def profiled_step(workdir: pathlib.Path) -> dict:
    """The recipe's 125m run traced, and its trace read back."""
    from jaxdist_lessons import profiling
    from jaxdist_lm import model_config

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tpu_report

    vocab = model_config.PRESETS["125m"].vocab_size
    scratch = pathlib.Path(tempfile.mkdtemp())  # the tokens stay on the machine
    tokens = tpu_report.random_tokens(scratch / "tokens.npy", vocab, 16 * 12, 2048)
    trace_dir = workdir / "profile"
    flags = f"{RECIPE} --global-batch 16 --steps 10 --remat dots".split()
    ran = subprocess.run(
        [sys.executable, "-m", "jaxdist_lm.train", *flags]
        + ["--data", tokens, "--profile", str(trace_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    steps = [line for line in ran.stdout.splitlines() if line.startswith("step ")]
    found = {"flags": " ".join(flags), "returncode": ran.returncode, "steps": steps}
    if ran.returncode:
        return {**found, "error": ran.stderr.strip().splitlines()[-1:]}
    events = profiling.read_trace(trace_dir / "process_0")
    step = [e for e in events if e.module == "jit_train_step"]
    spans = sorted((e.start_us, e.start_us + e.duration_us) for e in step)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:  # the union of the operations' intervals
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    table = profiling.op_table(step)
    return {
        **found,
        "events": len(events),
        "step_events": len(step),
        "devices": sorted({e.device for e in step}),
        "span_ms": (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0,
        "busy_ms": busy / 1e3,
        "by_kind_ms": {k: v / 1e3 for k, v in profiling.time_by_kind(step).items()},
        "top_ops": [row[1:] for row in table[:8]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = python(SHOW)
    if not start["stdout"].startswith("tpu"):
        raise SystemExit(f"no TPU here: {start}")
    report = {
        "date": datetime.date.today().isoformat(),
        "device_kind": start["stdout"].split(" ", 1)[1],
        "jax_version": python("import jax; print(jax.__version__)")["stdout"],
        "start": start,
        "lock": while_held(),
        "distributed": python("import jax; jax.distributed.initialize()"),
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
    }
    (out / "tpu_first_run.json").write_text(json.dumps(report, indent=1) + "\n")
    report["profile"] = profiled_step(out)
    (out / "tpu_first_run.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
