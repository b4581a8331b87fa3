"""One run on a TPU machine: the chip's roofline, host<->device copies and the LM recipe.

The TPU counterpart of ``gpu_report.py``, in one process (a TPU is held by one program
at a time, and opening it costs about 15 s), within ``--budget`` seconds (540 by
default: one call of the borrowed machine is 600):

1. the chip's bfloat16 matrix product at 2,048 to 8,192 (TFLOP/s, and the share of the
   chip's peak in ``jaxdist_lm/metrics.py``);
2. copies between host and device memory, 1 GiB each way: plain host memory and pinned
   host memory (what ``--offload optimizer`` uses);
3. ``jaxdist_lm/train.py`` on ``--mesh data=1`` at 125m and 1b, sequences of 2,048 and
   8,192, with each attention (``RUNS``): the median tokens/s, step time and MFU after
   the first ``SKIP`` steps, and the peak memory the recipe prints (a compiled step's
   count where ``memory_stats()`` leaves the program out), beside the planner's
   prediction for the chip (``python -m jaxdist_lessons.planning --chip "TPU v5e"``). A
   run that does not fit is a row with the recipe's one line, not the end of the report.

It writes ``tpu_report.json`` (one row a run; the book reads ``book/data/tpu_report.json``)
into ``--out``, with the date, the chip's ``device_kind`` and the JAX version, and prints
each run's output as it goes. The recipe trains on random token ids (``--data``): its
speed does not depend on what the ids say.

    source .whl-tpu/install.sh && python benchmarks/tpu_report.py --out $OUT   # the chip
    python benchmarks/tpu_report.py --show book/data/tpu_report.json           # its table
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's jaxdist_lm, where it is not installed
BUDGET = 540  # seconds, the whole report
SKIP = 3  # steps left out of the medians: compilation, then warm-up
STEPS = 12
CHIP = "TPU v5e"  # the planner's name for the chip
PROBE = 4  # the global batch --compile-only tries first for a run whose batch is 0

# (model, sequence length, attention, global batch, --grad-accum, --remat, --offload)
# The rows: model, sequence, attention, global batch (0: the largest that fits, from
# --compile-only), --grad-accum, --remat, --offload, --moments. 125m's best measured
# settings on the chip; 1b fits only with bfloat16 moments (float32 weights, gradients
# and moments take 19.8 GB; offloaded, the moments come back to the chip whole).
RUNS = [
    ("125m", 2048, "splash", 16, 1, "dots", "none", "float32"),
    ("1b", 2048, "splash", 0, 1, "full", "none", "bfloat16"),
    ("125m", 8192, "splash", 4, 1, "dots", "none", "float32"),
    ("125m", 2048, "chunked", 16, 1, "dots", "none", "float32"),
    ("125m", 2048, "xla", 16, 1, "dots", "none", "float32"),
    ("1b", 8192, "splash", 0, 1, "full", "none", "bfloat16"),
    ("125m", 8192, "chunked", 4, 1, "dots", "none", "float32"),
    ("125m", 8192, "xla", 4, 1, "dots", "none", "float32"),
    ("1b", 2048, "chunked", 0, 1, "full", "none", "bfloat16"),
    ("1b", 2048, "xla", 0, 1, "full", "none", "bfloat16"),
]
# one row of RUNS, named
KEYS = (
    "model",
    "seq_len",
    "attention",
    "global_batch",
    "grad_accum",
    "remat",
    "offload",
    "moments",
)


def roofline(sizes=(2048, 4096, 8192), repeats: int = 10) -> list[dict]:
    """The chip's bfloat16 n x n x n matrix product: TFLOP/s, the median of
    ``repeats`` after one warm-up."""
    import jax
    import jax.numpy as jnp

    rows = []
    for n in sizes:
        a = jnp.ones((n, n), jnp.bfloat16)
        product = jax.jit(lambda x, y: x @ y)
        product(a, a).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            product(a, a).block_until_ready()
            times.append(time.perf_counter() - start)
        rows.append({"n": n, "tflops": 2 * n**3 / statistics.median(times) / 1e12})
    return rows


def copies(size: int = 2**30, repeats: int = 5) -> dict[str, float]:
    """GB/s of ``size`` bytes copied host -> device and back, from plain host memory
    (a NumPy array) and between device and pinned host memory (JAX's memory kinds)."""
    import jax
    import numpy as np

    device = jax.devices()[0]
    host = np.ones(size // 4, np.float32)
    on_device = jax.device_put(host, device).block_until_ready()
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    here = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    moves = {
        "host_to_device": lambda: jax.device_put(host, device).block_until_ready(),
        "device_to_host": lambda: np.asarray(on_device + 0),
        "device_to_pinned_host": lambda: jax.device_put(
            on_device, pinned
        ).block_until_ready(),
    }
    in_pinned = jax.device_put(on_device, pinned).block_until_ready()
    moves["pinned_host_to_device"] = lambda: jax.device_put(
        in_pinned, here
    ).block_until_ready()
    rates = {}
    for name, move in moves.items():
        move()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            move()
            times.append(time.perf_counter() - start)
        rates[name] = size / statistics.median(times) / 1e9
    return rates


def random_tokens(path: pathlib.Path, vocab: int, rows: int, seq_len: int) -> str:
    """A .npy of random token ids, enough for ``rows`` sequences; its path."""
    import numpy as np

    ids = np.random.default_rng(0).integers(0, vocab, rows * (seq_len + 1) + 1)
    np.save(path, ids.astype(np.int32))
    return str(path)


def recipe_argv(run: dict, data: str, cache: str) -> list[str]:
    """train.py's flags for one run of RUNS on the one chip."""
    return [
        *("--model", run["model"], "--mesh", "data=1", "--dtype", "bfloat16"),
        *("--seq-len", str(run["seq_len"]), "--attention", run["attention"]),
        *(
            "--global-batch",
            str(run["global_batch"]),
            "--grad-accum",
            str(run["grad_accum"]),
        ),
        *("--remat", run["remat"], "--offload", run["offload"], "--steps", str(STEPS)),
        *("--moments", run["moments"]),
        *("--data", data, "--compilation-cache", cache),
    ]


def step_summary(text: str, skip: int = SKIP) -> dict:
    """The median tokens/s, step time (s) and MFU (a fraction) of the steps after the
    first ``skip``, and the peak memory a device held (GB, or None)."""
    rows = re.findall(
        r"^step (\d+) .*tokens/s ([\d,]+) step_time (\d+) ms(?: mfu ([\d.]+)%)?",
        text,
        re.M,
    )
    kept = [r for r in rows if int(r[0]) > skip]
    peak = re.search(r"^peak memory per device ([\d.]+) GB", text, re.M)
    if not kept:
        return {"peak_memory_gb": float(peak[1]) if peak else None}
    median = lambda values: statistics.median(values)
    mfus = [float(r[3]) / 100 for r in kept if r[3]]
    return {
        "tokens_per_second": median([float(r[1].replace(",", "")) for r in kept]),
        "step_seconds": median([int(r[2]) / 1e3 for r in kept]),
        "mfu": median(mfus) if mfus else None,
        "peak_memory_gb": float(peak[1]) if peak else None,
    }


def planned(run: dict) -> dict:
    """The planner's prediction for the run on one chip: its step time and MFU, or the
    sentence with which it refuses."""
    command = [
        sys.executable,
        "-m",
        "jaxdist_lessons.planning",
        "--model",
        run["model"],
        "--devices",
        "1",
        "--chip",
        CHIP,
        "--seq-len",
        str(run["seq_len"]),
        "--global-batch",
        str(run["global_batch"]),
        "--grad-accum",
        str(run["grad_accum"]),
        "--dtype",
        "bfloat16",
        "--remat",
        run["remat"],
        "--json",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, check=False
    )
    if done.returncode:
        return {"predicted": (done.stderr or done.stdout).strip().splitlines()[-1]}
    rows = [r for r in json.loads(done.stdout)["rows"] if r["fits"]]
    if not rows:
        return {"predicted": "no layout fits"}
    return {
        "predicted_mfu": rows[0]["mfu"],
        "predicted_step_seconds": rows[0]["step_seconds"],
        "predicted_memory_gb": rows[0]["memory_gb"]["total"],
    }


class Tee(io.StringIO):
    """What is written, kept and passed on to the terminal."""

    def write(self, text: str) -> int:
        sys.__stdout__.write(text)
        return super().write(text)


def captured(argv: list[str]) -> tuple[str, str]:
    """train.main(argv) in this process: (its output, how it ended: "ran", "stopped:
    <the recipe's one line>" or "failed: <the error>")."""
    import gc

    import jax

    from jaxdist_lm import train

    out = Tee()
    try:
        with contextlib.redirect_stdout(out):
            train.main(argv)
        status = "ran"
    except SystemExit as stop:  # the recipe's one line (out of memory, a refusal)
        status = f"stopped: {stop.code}"
        print(status, flush=True)
    # a failed run is a row of the report, not its end
    except Exception as error:
        status = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        print(status, flush=True)
    finally:
        jax.clear_caches()
        gc.collect()  # the run's state off the chip before the next run
    return out.getvalue(), status


def largest_batch(run: dict, cache: str) -> int | None:
    """The largest --global-batch that --compile-only finds fits the chip at ``run``'s
    other flags (its two compilations, at PROBE and half of it)."""
    argv = [
        *recipe_argv({**run, "global_batch": PROBE}, "unused", cache),
        "--compile-only",
    ]
    print(f"== train.py {' '.join(argv)}", flush=True)
    text, status = captured(argv)
    found = re.search(
        r"largest batch that fits \([\d.]+ GB\): --global-batch (\d+)", text + status
    )
    return int(found[1]) if found else None


def run_recipe(run: dict, workdir: pathlib.Path, found: dict) -> dict:
    """One run of train.py in this process; its numbers, or the line that stopped it.
    A global batch of 0: the largest that fits (largest_batch, asked once a model and
    sequence length and kept in ``found``), less a tenth."""
    from jaxdist_lm import model_config

    cache, fits, shape = str(workdir / "jax_cache"), {}, (run["model"], run["seq_len"])
    if not run["global_batch"]:
        if shape not in found:
            found[shape] = largest_batch(run, cache)
        if not (most := found[shape]):
            return {**run, "status": "stopped: --compile-only found no batch that fits"}
        run, fits = {**run, "global_batch": max(1, most * 9 // 10)}, {"fits": most}
    vocab = model_config.PRESETS[run["model"]].vocab_size
    rows = run["global_batch"] * (STEPS + 2)
    path = workdir / f"tokens-{vocab}-{run['seq_len']}.npy"
    argv = recipe_argv(run, random_tokens(path, vocab, rows, run["seq_len"]), cache)
    print(f"== train.py {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    text, status = captured(argv)
    seconds = round(time.perf_counter() - start, 1)
    return {**run, **fits, "status": status, "seconds": seconds, **step_summary(text)}


def markdown(report: dict) -> str:
    """The report's runs as a Markdown table."""
    lines = [
        f"{report['device_kind']}, jax {report['jax_version']}, {report['date']}",
        "",
        "| model | seq | attention | batch | accum | tokens/s | MFU | step (s) | peak GB | predicted MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        cell = lambda key, spec, r=r: "" if r.get(key) is None else format(r[key], spec)
        status = "" if r["status"] == "ran" else f" ({r['status'][:40]})"
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['attention']}{status} | {r['global_batch']} "
            f"| {r['grad_accum']} | {cell('tokens_per_second', ',.0f')} | {cell('mfu', '.1%')} "
            f"| {cell('step_seconds', '.3f')} | {cell('peak_memory_gb', '.2f')} "
            f"| {cell('predicted_mfu', '.1%')} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="where tpu_report.json goes")
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds in all")
    parser.add_argument(
        "--only", help="run only RUNS whose model,seq,attention match: 1b,2048,splash"
    )
    parser.add_argument(
        "--show", type=pathlib.Path, help="print a report's table and stop"
    )
    parser.add_argument(
        "--runs", type=json.loads, help="runs instead of RUNS, as JSON lists"
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.show:
        print(markdown(json.loads(args.show.read_text())))
        return None
    import jax

    start = time.perf_counter()
    device = jax.devices()[0]
    if device.platform != "tpu":
        raise SystemExit(
            f"no TPU here ({device.platform}): this report measures a TPU chip"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "device_kind": device.device_kind,
        "jax_version": jax.__version__,
        "devices": jax.device_count(),
        "roofline": roofline(),
        "copies": copies(),
        "runs": [],
    }
    print(json.dumps({k: report[k] for k in ("roofline", "copies")}), flush=True)
    workdir = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "tpu_report"
    workdir.mkdir(parents=True, exist_ok=True)
    found = {}  # (model, sequence length) -> the largest batch that fits
    for values in args.runs or RUNS:
        run = dict(zip(KEYS, values))
        if args.only and args.only not in ",".join(str(v) for v in values):
            continue
        if time.perf_counter() - start > args.budget:
            report["runs"].append(
                {**run, "status": "skipped: over the report's budget"}
            )
            continue
        result = run_recipe(run, workdir, found)
        report["runs"].append({**result, **planned(result)})
        (args.out / "tpu_report.json").write_text(json.dumps(report, indent=1) + "\n")
    report["seconds"] = round(time.perf_counter() - start, 1)
    (args.out / "tpu_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report), flush=True)
    return report


if __name__ == "__main__":
    main()
