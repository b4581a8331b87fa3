"""The hang lab: six ways a multi-process job hangs, each ended in seconds, with the message that names it.

:func:`run_cases` starts every case at once under ``mpirun`` (they are independent) and returns how
each ended. One case, run once per process: ``mpirun -np 2 python -m jaxdist_lessons.hang_lab CASE``:
four steps of an all-reduce over every process's devices, with JAX's timeouts set short (so a
case ends in seconds, not minutes) and, with ``--watchdog S``, a step deadline of S seconds
(the recipe's ``StepDeadline``, ``jaxdist_lm/resilience.py``). Process 1 goes wrong before step 2, as CASE says:

- ``sleep``: it sleeps (alive: its heartbeat goes on);
- ``stop``: it stops itself with SIGSTOP (every thread stops, the heartbeat too);
- ``order``: it calls the step's two all-reduces in the other order;
- ``shape``: its all-reduce has another shape;
- ``unreachable``: every process points at a coordinator address that nothing serves;
- ``partial``: the job says 3 processes, but the launcher started 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import multihost

CASES = ("sleep", "stop", "order", "shape", "unreachable", "partial")
# The lab's arguments per case: the live stuck process needs the watchdog; JAX's own timeouts end the rest.
LAB = {
    "sleep": ["--watchdog", "3"],
    "stop": [],
    "order": [],
    "shape": [],
    "unreachable": ["--port", "{port}"],
    "partial": ["--port", "{port}"],
}
# The line of each case's output that names its cause.
MESSAGES = {
    "sleep": r"^step timeout: .*",
    "stop": r"The following tasks are unhealthy \(stopped sending heartbeats\):\n\d+",
    "order": r"Received data size doesn't match expected size\. Is there a distributed collective mismatch in your code\?",
    "shape": r"Received data size doesn't match expected size\. Is there a distributed collective mismatch in your code\?",
    "unreachable": r"(?s)absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded.*?RPC: \S+RegisterTask",
    "partial": r"(?s)absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded.*?RPC: \S+RegisterTask",
}
# the lab's initialization, heartbeat and shutdown timeouts, in seconds
TIMEOUTS = (
    10,
    5,
    5,
)
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@dataclasses.dataclass
class Outcome:
    """How one case ended: ``mpirun``'s exit status, seconds from the lab's start, and the output."""

    case: str
    returncode: int
    seconds: float
    output: str

    @property
    def message(self) -> str | None:
        """The line that names the cause (``MESSAGES``), or ``None``."""
        found = re.search(MESSAGES[self.case], self.output, re.M)
        if found is None:
            return None
        lines = found[0].splitlines()  # another process's lines may come between
        return lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def module_pids(module: str, inherited: str = "PYTEST_XDIST_WORKER") -> set[int]:
    """Process ids of running ``python -m module`` processes (to check that none is left behind).

    Where this process's environment sets ``inherited`` (pytest-xdist names each worker so),
    only the processes with the same value count: those started from here, not a neighbour's.
    """
    mine = os.environ.get(inherited)
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if module.encode() not in f.read():
                    continue
            if mine is not None:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"{inherited}={mine}".encode() not in f.read().split(b"\0"):
                        continue
            found.add(int(pid))
        except OSError:
            pass
    return found


def case_pids() -> set[int]:
    """Process ids of running hang-lab cases."""
    return module_pids(__name__)


def job_environment() -> dict[str, str]:
    """The environment of a job this process starts with ``mpirun``: its own, without
    the JAXDIST_ and SLURM_ variables that would steer the job's processes, with Open
    MPI allowed to run as root and this Python's ``mpirun`` first on ``PATH``."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "SLURM_"))
    }
    return {**multihost.launcher_environment(env), **ROOT_OK}


def run_cases(
    cases: dict[str, list[str]] = LAB, limit_s: float = 60
) -> dict[str, Outcome]:
    """Start every case at once with ``mpirun -np 2``; kill any still running after ``limit_s`` seconds."""
    env = job_environment()
    mpirun = shutil.which("mpirun", path=env["PATH"])
    start, jobs = time.monotonic(), {}
    for case, extra in cases.items():
        command = [
            mpirun,
            "--map-by",
            ":OVERSUBSCRIBE",
            "-np",
            "2",
            sys.executable,
            "-m",
            "jaxdist_lessons.hang_lab",
            case,
            *(a.format(port=free_port()) for a in extra),
        ]
        jobs[case] = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    outcomes = {}
    for case, job in jobs.items():
        try:
            output, _ = job.communicate(
                timeout=max(1.0, limit_s - (time.monotonic() - start))
            )
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            output, _ = job.communicate()
        outcomes[case] = Outcome(case, job.returncode, time.monotonic() - start, output)
    return outcomes


def join(case: str, port: int, timeouts: multihost.Timeouts) -> None:
    """Join through mpi4py, or with explicit arguments that cannot all join."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if case == "unreachable":  # process 0 of 3 (which would serve it) is missing
        explicit = {"num_processes": 3, "process_id": rank + 1}
    elif case == "partial":
        explicit = {"num_processes": 3, "process_id": rank}
    else:
        explicit = {}
    address = f"127.0.0.1:{port}" if explicit else None
    multihost.initialize(1, coordinator_address=address, timeouts=timeouts, **explicit)


def step(case: str, k: int, mesh: jax.sharding.Mesh) -> float:
    """Step ``k``: two all-reduces, which process 1 gets wrong from step 2 on."""
    wrong = jax.process_index() == 1 and k >= 2
    width = 3 if (case == "shape" and wrong) else 2
    rows = NamedSharding(mesh, P("data"))  # one row per process, process order
    count = jax.process_count()
    a = jax.make_array_from_process_local_data(
        rows, np.full((1, width), k, np.float32), (count, width)
    )
    b = jax.make_array_from_process_local_data(
        rows, np.full((1, 5), k, np.float32), (count, 5)
    )
    total = jax.jit(
        jax.shard_map(
            lambda x: lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
    )
    first, second = (b, a) if (case == "order" and wrong) else (a, b)
    return float(total(first).sum() + total(second).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=CASES)
    parser.add_argument("--watchdog", type=float, help="step deadline in seconds")
    parser.add_argument(
        "--port", type=int, default=0, help="for unreachable and partial"
    )
    parser.add_argument(
        "--timeouts",
        type=int,
        nargs=3,
        default=TIMEOUTS,
        metavar=("INIT", "HEARTBEAT", "SHUTDOWN"),
    )
    args = parser.parse_args()
    multihost.native_stdout_to_stderr()
    join(args.case, args.port, multihost.Timeouts(*args.timeouts))
    mesh = jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,)
    )
    from jaxdist_lm.resilience import StepDeadline as deadline

    dog = deadline(args.watchdog).start() if args.watchdog else None
    for k in range(4):
        # between steps: say, reading the next batch
        if k == 2 and jax.process_index() == 1:
            print(f"process 1 goes wrong before step 2 ({args.case})", flush=True)
            if args.case == "sleep":
                time.sleep(3600)
            elif args.case == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        if dog:
            dog.reached(k)
        print(
            f"process {jax.process_index()} step {k}: {step(args.case, k, mesh)}",
            flush=True,
        )
    if dog:
        dog.stop()


if __name__ == "__main__":
    main()
