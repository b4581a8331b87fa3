"""One way a multi-process job hangs, run once per process: ``mpirun -np 2 python tests/hang_cases/case.py CASE``.

Four steps of an all-reduce over every process's devices, with JAX's timeouts set short (so a
case ends in seconds, not minutes) and, with ``--watchdog S``, a step deadline of S seconds
(``jaxdist_lessons.watchdog``). Process 1 goes wrong before step 2, as CASE says:

- ``sleep``: it sleeps (alive: its heartbeat goes on);
- ``stop``: it stops itself with SIGSTOP (every thread stops, the heartbeat too);
- ``order``: it calls the step's two all-reduces in the other order;
- ``shape``: its all-reduce has another shape;
- ``unreachable``: every process points at a coordinator address that nothing serves;
- ``partial``: the job says 3 processes, but the launcher started 2.
"""

import argparse
import os
import signal
import time

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import multihost, watchdog

CASES = ("sleep", "stop", "order", "shape", "unreachable", "partial")


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
    a = multihost.global_array(np.full((1, width), k, np.float32), mesh, P("data"))
    b = multihost.global_array(np.full((1, 5), k, np.float32), mesh, P("data"))
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
    parser.add_argument("--port", type=int, default=0, help="for unreachable and partial")
    parser.add_argument("--timeouts", type=int, nargs=3, default=(10, 5, 5),
                        metavar=("INIT", "HEARTBEAT", "SHUTDOWN"))  # fmt: skip
    args = parser.parse_args()
    multihost.native_stdout_to_stderr()
    join(args.case, args.port, multihost.Timeouts(*args.timeouts))
    mesh = multihost.global_mesh((jax.device_count(),), ("data",), AxisType.Explicit)
    dog = watchdog.StepWatchdog(args.watchdog).start() if args.watchdog else None
    for k in range(4):
        if (
            k == 2 and jax.process_index() == 1
        ):  # between steps: say, reading the next batch
            print(f"process 1 goes wrong before step 2 ({args.case})", flush=True)
            if args.case == "sleep":
                time.sleep(3600)
            elif args.case == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        if dog:
            dog.step(k)
        print(
            f"process {jax.process_index()} step {k}: {step(args.case, k, mesh)}",
            flush=True,
        )
    if dog:
        dog.stop()


if __name__ == "__main__":
    main()
