"""How long a fresh Python process takes to import what the book's processes import.

Every chapter's kernel, every test worker and every process of an ``mpirun`` or ``srun`` job
pays this before it does anything: ``pytest`` starts a few hundred of them. Each module is
imported in a fresh process (the median of ``--repeat`` runs), after numpy, so that a row is
that module's own cost with numpy already loaded.

    python benchmarks/import_time.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import statistics
import subprocess
import sys

MODULES = [
    "ml_dtypes",
    "jax",
    "flax.linen",
    "optax",
    "orbax.checkpoint",
    "jaxdist_lessons.train",
]
TIMER = (
    "import time, numpy; start = time.perf_counter(); import {module}; "
    "print(time.perf_counter() - start)"
)


def seconds_to_import(module: str) -> float:
    """Seconds a fresh interpreter takes to import ``module`` once numpy is loaded."""
    code = TIMER.format(module=module)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"importing {module} failed:\n{out.stderr}")
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    installed = {
        name: importlib.metadata.version(name) for name in ("numpy", "ml_dtypes", "jax")
    }
    print(
        ", ".join(f"{name} {version}" for name, version in installed.items())
        + f"; {os.cpu_count()} cores, {datetime.date.today()}"
    )
    print(f"| module | seconds to import (median of {args.repeat}) |")
    print("|---|---|")
    for module in MODULES:
        times = [seconds_to_import(module) for _ in range(args.repeat)]
        print(f"| {module} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
