"""How long a multi-process job takes to end after one of its processes dies (chapter 08_multi_host).

Starts ``jaxdist_lessons.multihost_demo train`` with ``mpirun`` (and with ``srun
--kill-on-bad-exit=1`` where SLURM runs), makes process 1 fail as the first epoch begins (it
raises, or it is killed with SIGKILL), and prints the seconds from the line it prints as it
fails to the launcher's exit, and whether any process was left behind. ``--no-exit-on-error``
shows what an exception costs when the process exits through JAX's shutdown barrier instead.

    python benchmarks/failure_time.py [--processes 2] [--devices 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import jax

from jaxdist_lessons import multihost_demo

BIN = os.path.dirname(sys.executable)
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def launchers(processes: int) -> dict[str, list[str]]:
    """The launch commands to time: mpirun always, srun where SLURM runs a job now."""
    found = {"mpirun": ["mpirun", "--map-by", ":OVERSUBSCRIBE", "-np", str(processes)]}
    reason = multihost_demo.slurm_unavailable()
    # installed with its controller down, sinfo fails: say so, skip it
    if reason is not None:
        print(f"srun skipped: {reason}")
    else:
        found["srun --kill-on-bad-exit=1"] = [
            "srun",
            "--overcommit",
            "--kill-on-bad-exit=1",
            "-u",
            "-n",
            str(processes),
        ]
    return found


def left_behind() -> int:
    """How many multihost_demo processes are running."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                count += b"jaxdist_lessons.multihost_demo" in f.read()
        except OSError:
            pass
    return count


def time_one(
    launch: list[str], devices: int, how: str, extra: list[str]
) -> tuple[float, int]:
    """Seconds from process 1's "fails" line to the launcher's exit, and its exit status."""
    command = [
        *launch,
        sys.executable,
        "-m",
        "jaxdist_lessons.multihost_demo",
        "--devices",
        str(devices),
        *extra,
        "train",
        "--epochs",
        "2",
        "--steps-per-epoch",
        "2",
        "--fail-rank",
        "1",
        "--fail-at-epoch",
        "1",
        "--fail-how",
        how,
    ]
    env = {**os.environ, **ROOT_OK, "PATH": f"{BIN}:{os.environ['PATH']}"}
    job = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    died = None
    for line in job.stdout:
        if died is None and "process 1 fails" in line:
            died = time.monotonic()
    status = job.wait()
    if died is None:
        raise RuntimeError(f"process 1 never said it failed: {' '.join(command)}")
    return time.monotonic() - died, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-exit-on-error", action="store_true")
    args = parser.parse_args()
    extra = ["--no-exit-on-error"] if args.no_exit_on_error else []
    print(
        f"{args.processes} processes x {args.devices} CPU devices, jax {jax.__version__}, "
        f"{os.cpu_count()} cores, {datetime.date.today()}"
        + (", without exit_on_error" if extra else "")
    )
    print(
        f"{'launcher':<28}{'failure':<9}{'seconds to end (each run)':<34}{'status':<8}left"
    )
    for name, launch in launchers(args.processes).items():
        for how in ("raise", "kill"):
            runs = [
                time_one(launch, args.devices, how, extra) for _ in range(args.repeat)
            ]
            times = ", ".join(f"{t:.1f}" for t, _ in runs)
            median = statistics.median(t for t, _ in runs)
            statuses = sorted({s for _, s in runs})
            print(
                f"{name:<28}{how:<9}{f'median {median:.1f} ({times})':<34}{str(statuses):<8}{left_behind()}"
            )


if __name__ == "__main__":
    main()
