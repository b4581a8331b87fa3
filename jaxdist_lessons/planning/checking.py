"""Checked against the compiler: the recipe's step compiled with ``--compile-only`` on
simulated CPU devices (one subprocess, JAX started once), and the predicted argument bytes,
collective bytes per kind and temporaries beside the compiled ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from jaxdist_lessons.tables import Table

ROOT = pathlib.Path(__file__).resolve().parents[2]


# a collective kind under 1% of a program's bytes is shown, not held to 10%
MINOR = 0.01


def compile_worker(devices: int, runs: Sequence[Sequence[str]]) -> None:
    """In a fresh process: compile train.py's step for each argv on ``devices`` simulated CPU
    devices and print one JSON line each (exact argument and temporary bytes, collective bytes
    as ``compiled.collective_bytes`` counts them). ``compiled.compile_only`` prints GB to 3 decimals."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    from jaxdist_lm import compiled as recipe_compiled
    from jaxdist_lm import train

    for argv in runs:
        run = train.parse_args([*argv, "--compile-only"])
        try:  # what setup says (once-only notes) goes to stderr: stdout is the JSON
            with contextlib.redirect_stdout(sys.stderr):
                mesh, _, _, step, shapes, _ = train.setup(run)
            compiled = recipe_compiled.lower_step(step, shapes, run, mesh).compile()
        except (Exception, SystemExit) as error:  # the next layout may still compile
            print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
            continue
        memory_use = compiled.memory_analysis()
        print(
            json.dumps(
                {
                    "arguments": memory_use.argument_size_in_bytes,
                    "temporaries": memory_use.temp_size_in_bytes,
                    "collectives": recipe_compiled.collective_bytes(compiled.as_text()),
                }
            ),
            flush=True,
        )


def compile_environment(*paths: str) -> dict[str, str]:
    """This environment for a process that compiles the recipe's step: without JAX's and
    XLA's settings (a device count or flags of this process's own), with ``paths`` (a
    folder holding libtpu, say) and the checkout first on PYTHONPATH."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))
    }
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT), env.get("PYTHONPATH", "")])
    return env


def compile_flags(
    devices: int, flag_lines: Sequence[str], progress: bool = True, strict: bool = True
) -> list[dict]:
    """Compile each line of recipe flags in one subprocess (JAX starts once), with a tqdm bar;
    a layout that does not compile raises, or with ``strict=False`` gives ``{"error": ...}``."""
    from tqdm import tqdm

    runs = [line.split() for line in flag_lines]
    program = (
        "from jaxdist_lessons.planning import checking\n"
        f"checking.compile_worker({devices}, {runs!r})"
    )
    env = compile_environment()
    worker = subprocess.Popen(
        [sys.executable, "-c", program],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    results = []
    with tqdm(
        total=len(runs),
        desc=f"compiling on {devices} CPU devices",
        unit="layout",
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        for line in worker.stdout:
            results.append(json.loads(line))
            bar.update()
    if worker.wait() or len(results) != len(runs):
        raise RuntimeError(
            f"compiling {flag_lines[len(results)]} failed:\n"
            f"{worker.stderr.read()[-3000:]}"
        )
    for line, result in zip(flag_lines, results):
        if "error" in result and strict:
            raise RuntimeError(f"train.py {line} --compile-only: {result['error']}")
    return results


def ratio(predicted: float, compiled: float) -> float | None:
    """predicted / compiled; ``None`` where the compiled program has none of it."""
    return predicted / compiled if compiled else None


def compare(plan_row: dict[str, Any], compiled: dict[str, Any]) -> dict[str, Any]:
    """Predicted against compiled: argument bytes, bytes per collective kind (kinds under
    ``MINOR`` of the program's bytes marked minor), and ``temporaries_estimate`` against
    XLA:CPU's temporaries."""
    total = sum(compiled["collectives"].values())
    kinds = sorted(set(plan_row["collective_bytes"]) | set(compiled["collectives"]))
    collectives = {}
    for kind in kinds:
        got = compiled["collectives"].get(kind, 0)
        want = plan_row["collective_bytes"].get(kind, 0)
        collectives[kind] = {
            "predicted": want,
            "compiled": got,
            "ratio": ratio(want, got),
            "minor": got < MINOR * total and want < MINOR * total,
        }
    estimate = plan_row["temporaries_estimate_bytes"]
    return {
        "arguments": {
            "predicted": plan_row["arguments_bytes"],
            "compiled": compiled["arguments"],
            "ratio": ratio(plan_row["arguments_bytes"], compiled["arguments"]),
        },
        "collectives": collectives,
        "temporaries": {
            "estimate": estimate,
            "compiled": compiled["temporaries"],
            "ratio": ratio(estimate, compiled["temporaries"]),
        },
    }


def agrees(check: dict[str, Any], tolerance: float = 0.1) -> bool:
    """Arguments and every collective kind that is not minor within ``tolerance``."""
    ratios = [check["arguments"]["ratio"]]
    ratios += [c["ratio"] for c in check["collectives"].values() if not c["minor"]]
    return all(r is not None and abs(r - 1) <= tolerance for r in ratios)


def check_table(
    rows: Sequence[dict[str, Any]], checks: Sequence[dict[str, Any]]
) -> Table:
    """Predicted and compiled side by side: arguments, each collective kind, temporaries."""
    cells = []
    fmt = lambda r: "-" if r is None else f"{r:.3f}"
    for r, c in zip(rows, checks):
        parts = [("arguments", c["arguments"])]
        parts += [
            (k + (" (minor)" if v["minor"] else ""), v)
            for k, v in c["collectives"].items()
        ]
        for name, v in parts:
            cells.append(
                [
                    r["mesh"],
                    name,
                    v["predicted"] / 1e9,
                    v["compiled"] / 1e9,
                    fmt(v["ratio"]),
                ]
            )
        t = c["temporaries"]
        cells.append(
            [
                r["mesh"],
                "temporaries vs activation estimate",
                t["estimate"] / 1e9,
                t["compiled"] / 1e9,
                fmt(t["ratio"]),
            ]
        )
    return Table(
        ["mesh", "per device", "predicted GB", "compiled GB", "ratio"],
        cells,
        title="predicted against XLA:CPU's compiled step (simulated devices)",
    )
