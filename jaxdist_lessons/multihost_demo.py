"""The program chapter 08_multi_host starts once per process (`hello`, `hybrid`; the tests also start `train`): ``python -m jaxdist_lessons.multihost_demo {hello,hybrid,train}``.

Start it with the cluster's own tool, for example 2 processes of 4 simulated CPU devices each::

    mpirun -np 2 python -m jaxdist_lessons.multihost_demo --devices 4 hello
    srun -n 2 python -m jaxdist_lessons.multihost_demo --devices 4 train --epochs 3

``hello`` shows what each process sees and runs an all-reduce across processes. ``hybrid``
builds a hybrid mesh and shows which all-reduces stay inside a process. ``train`` trains
a small CNN data-parallel over every process's devices with chapter 05_resnet50's digits pipeline and
train module, can checkpoint after every epoch and resume from the latest checkpoint, saves at
the next step and exits 0 on a preemption notice (SIGTERM or SIGUSR1), and can make one of its
processes fail on purpose (killed, raising, or hanging). With ``--out DIR`` every
process writes what it found to ``DIR/rank<i>.json``. Run alone it is a single process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, data, devices, hlo, multihost, train
from jaxdist_lessons.models.small import SmallCNN

MODEL = SmallCNN(channels=8)
IMAGE_SHAPE = (32, 32, 1)
PREPROCESS = data.Preprocess(channels=1)
FAILURES = ("kill", "raise", "hang")
# What the cluster tool told each process, as hello reports it.
ENVIRONMENT = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


def hello(info: multihost.ProcessInfo | None = None) -> dict[str, Any]:
    """What this process sees, and an all-reduce over every device of every process."""
    info = multihost.process_info() if info is None else info
    n, m, me = jax.device_count(), jax.local_device_count(), jax.process_index()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    # Device k of the mesh holds the number k + 1: each process supplies only its own
    # devices' numbers, and JAX assembles the global array of n numbers from them.
    mine = np.arange(me * m, (me + 1) * m, dtype=np.float32) + 1
    numbers = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), mine, (n,)
    )
    psum = jax.jit(
        jax.shard_map(
            lambda x: lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
    )
    total = psum(numbers)  # the same sum on every device of every process
    on_my_devices = [float(shard.data[0]) for shard in total.addressable_shards]
    # Every process's index, on every process, as NumPy.
    gathered = multihost_utils.process_allgather(np.int32(me)).tolist()
    hlo_text = psum.lower(numbers).compile().as_text()
    [all_reduce] = [c for c in comms.collectives(hlo_text) if c.kind == "all-reduce"]
    local_ids = [d.id for d in jax.local_devices()]
    global_ids = [d.id for d in jax.devices()]
    print(f"{info}; device ids {local_ids} of {global_ids}")
    print(
        f"contributed {mine.tolist()}; all-reduce over {all_reduce.group_size} devices "
        f"gives {on_my_devices} on my devices; allgather of process indices: {gathered}"
    )
    return {
        "process_index": me,
        "process_count": jax.process_count(),
        "local_device_ids": local_ids,
        "global_device_ids": global_ids,
        "contributed": mine.tolist(),
        "psum_on_my_devices": on_my_devices,
        "all_reduce_group_size": all_reduce.group_size,
        "process_indices_gathered": gathered,
        "joined_by": info.joined_by,
        "jax_version": jax.__version__,
        # What jax.distributed.initialize set from local_device_ids: the GPUs a GPU
        # process would drive.
        "cuda_visible_devices": jax.config.values["jax_cuda_visible_devices"],
        "environment": {k: os.environ.get(k) for k in ENVIRONMENT},
    }


def hybrid() -> dict[str, Any]:
    """A hybrid mesh: ``tensor`` inside each process (ICI), ``data`` across processes
    (DCN); whose collectives go where."""
    mesh = multihost.hybrid_mesh(
        (1, jax.local_device_count()),
        (jax.process_count(), 1),
        ("data", "tensor"),
        axis_types=AxisType.Explicit,
    )
    x = jax.device_put(
        np.ones(mesh.devices.shape, np.float32),
        NamedSharding(mesh, P("data", "tensor")),
    )
    report = {"process_grid": multihost.process_grid(mesh).tolist()}
    for axis in mesh.axis_names:
        fn = jax.jit(
            jax.shard_map(
                lambda block, axis=axis: lax.psum(block, axis),
                mesh=mesh,
                in_specs=P("data", "tensor"),
                out_specs=P("data", "tensor"),
            )
        )
        [op] = [
            c
            for c in comms.collectives(fn.lower(x).compile().as_text())
            if c.kind == "all-reduce"
        ]
        groups = hlo.replica_group_lists(op.replica_groups, num_devices=mesh.size)
        report[f"{axis}_groups"] = groups
        report[f"{axis}_group_processes"] = multihost.processes_per_group(mesh, groups)
    multihost.print0(
        f"hybrid mesh {dict(mesh.shape)}; the process owning each device:\n"
        f"{multihost.process_grid(mesh)}"
    )
    for axis in mesh.axis_names:
        multihost.print0(
            f"all-reduce over {axis!r}: device groups {report[f'{axis}_groups']} "
            f"span processes {report[f'{axis}_group_processes']}"
        )
    return report


def _fail(how: str, epoch: int) -> None:
    print(f"epoch {epoch + 1}: process {jax.process_index()} fails ({how})", flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "raise":
        raise RuntimeError(f"process {jax.process_index()} raised at epoch {epoch + 1}")
    else:
        while True:
            time.sleep(60)


def preemption_notice() -> Any:
    """The recipe's ``Preemption`` (jaxdist_lm/resilience.py): notes SIGTERM (``scancel``,
    Kubernetes) and SIGUSR1 (SLURM's ``--signal=USR1@60``); each step every process votes,
    so all stop at the same step, whichever got the signal."""
    from jaxdist_lm import layout, resilience

    return resilience.Preemption(layout.make_mesh("data=-1"))


def train_digits(
    epochs: int = 3,
    steps_per_epoch: int = 4,
    per_device_batch: int = 4,
    learning_rate: float = 3e-3,
    checkpoint_dir: str | None = None,
    fail_rank: int | None = None,
    fail_at_epoch: int | None = None,
    fail_how: str = "kill",
    devices: int | None = None,
    pause_s: float = 0.0,
) -> dict[str, Any]:
    """Data-parallel training of ``MODEL`` on the digits; returns the losses.

    Every process's devices take part. Chapter 05_resnet50's loop
    (``train.train_and_evaluate``) does the work. ``devices`` (default: all) takes the
    first devices of ``jax.devices()``. Checkpoints after every epoch into
    ``checkpoint_dir``, keyed by step, and starts from its latest checkpoint. Process
    ``fail_rank`` fails when epoch ``fail_at_epoch`` begins, as ``fail_how`` says:
    ``kill`` (SIGKILL, like the OOM killer), ``raise`` (a Python exception) or ``hang``
    (sleeps forever). With ``checkpoint_dir``, SIGTERM or SIGUSR1 saves the state before
    the next step and returns (``preempted`` names the signal); a rerun resumes at that
    step, mid-epoch, with the same batches. ``pause_s`` sleeps before each step (time to
    send a signal in a test).
    """
    if fail_how not in FAILURES:
        raise ValueError(f"fail_how must be one of {FAILURES}, got {fail_how!r}")
    used = devices or jax.device_count()
    config = train.Config(
        model="SmallCNN",
        model_kwargs={"channels": MODEL.channels},
        preprocess=PREPROCESS,
        devices=used,
        global_batch=per_device_batch * used,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        learning_rate=learning_rate,
        augment=False,
        evaluate=False,
        progress=False,
    )
    preemption = None if checkpoint_dir is None else preemption_notice()

    def before_step(step: int) -> bool:
        epoch = step // steps_per_epoch
        if epoch == fail_at_epoch and jax.process_index() == fail_rank:
            _fail(fail_how, epoch)
        time.sleep(pause_s)
        return preemption is not None and preemption.agreed(preemption.vote())

    result = train.train_and_evaluate(config, checkpoint_dir, before_step)
    preempted = preemption.signal if result.history.stopped else None
    if preempted:
        step = int(result.state.step)
        multihost.print0(f"{preempted}: saved step {step}, exiting", flush=True)
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "first_step": result.first_step,
        "preempted": preempted,
        "losses": [r["loss"] for r in result.history.train],
    }


# The rank prefixes of mpirun --output tag ([job,rank]<stream>:) and srun --label (rank:), and
# gloo's connection messages; gloo writes "... peer ranks is : " and the count apart, so a
# tagged line may hold the count alone ("[1,1]<stdout>: 7").
TAG = re.compile(r"^(?:\[\d+,(\d+)\]<(?:stdout|stderr)>: ?|\s*(\d+): )")
GLOO = re.compile(
    r"\[Gloo\]|peer ranks|^\s*\[\s*\d+\]\s*\d*\s*$|^\[\d+,\d+\]<(?:stdout|stderr)>: ?\d+\s*$"
)


@dataclasses.dataclass
class Job:
    """A finished command: its exit status, what it printed, and how long it took."""

    command: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run(command: str, timeout: float = 300, show_stderr: bool = False) -> Job:
    """Run ``command`` as a terminal would (this Python's environment first on ``PATH``), print its stdout, return it.

    Lines tagged by ``mpirun --output tag`` (``[1,0]<stdout>: ...``) or ``srun --label``
    (``0: ...``) show as ``[rank 0] ...``. Gloo's connection messages are counted, not shown.
    With ``show_stderr``, stderr follows. A last line names ``XLA_FLAGS`` when it is set
    (the test suite's faster compiling, conftest.py): the step times and tokens per
    second printed above are those of the code it compiled.
    """
    print(f"$ {command}")
    start = time.monotonic()
    result = subprocess.run(
        command,
        shell=True,
        env=multihost.launcher_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    job = Job(command, result.returncode, result.stdout, result.stderr, 0.0)
    job.seconds = time.monotonic() - start
    hidden = 0
    for line in job.stdout.splitlines() + (
        job.stderr.splitlines() if show_stderr else []
    ):
        if GLOO.search(line):
            hidden += 1
        else:
            print(TAG.sub(lambda m: f"[rank {m[1] or m[2]}] ", line))
    gloo = f"; {hidden} lines of gloo's connection messages hidden" if hidden else ""
    print(f"(exit status {job.returncode}, {job.seconds:.1f} s{gloo})")
    if flags := os.environ.get("XLA_FLAGS", "").strip():
        print(f"(XLA_FLAGS: {flags})")
    return job


SLURM_TOOLS = ("srun", "sbatch", "salloc")


def slurm_unavailable(settle_s: int = 30) -> str | None:
    """Why SLURM cannot run a job here now, or ``None`` when ``sinfo`` shows a node idle (or partly busy).

    Installed is not enough: on a machine whose controller is down, ``sbatch`` is on ``PATH`` and
    fails. A node still cleaning up after a job says ``comp``; it gets ``settle_s`` seconds.
    """
    if shutil.which("sinfo") is None:
        return "SLURM is not installed here"
    states: list[str] = []
    for _ in range(max(settle_s, 1)):
        try:
            done = subprocess.run(
                ["sinfo", "--noheader", "--format=%t"],
                capture_output=True,
                text=True,
                timeout=20,
            )
        except subprocess.TimeoutExpired:
            return "SLURM is installed, but sinfo did not answer in 20 s (is slurmctld running?)"
        if done.returncode != 0:
            last = (
                done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
            )[-1]
            return f"SLURM is installed, but sinfo failed ({last})"
        states = done.stdout.split()
        if any(state.startswith(("idle", "mix")) for state in states):
            return None
        time.sleep(1)
    return f"SLURM is installed, but no node is idle (sinfo: {' '.join(states) or 'no nodes'})"


def run_where(tool: str, command: str, timeout: float = 300) -> Job | None:
    """``run(command)`` where ``tool`` (``srun``, ``sbatch``) can run it; elsewhere print what would run, and why not here.

    A SLURM tool also needs a running cluster (:func:`slurm_unavailable`).
    """
    if shutil.which(tool) is None:
        reason = f"{tool} is not installed here"
    else:
        reason = slurm_unavailable() if tool in SLURM_TOOLS else None
    if reason is not None:
        print(f"{reason}; on a cluster with it, this runs:\n$ {command}")
        return None
    return run(command, timeout)


def parser() -> argparse.ArgumentParser:
    """The command line: ``hello``, ``hybrid``, ``train`` (one or more), the training options, and the timeouts."""
    p = argparse.ArgumentParser(
        prog="python -m jaxdist_lessons.multihost_demo",
        description=__doc__.split("\n")[0],
    )
    p.add_argument(
        "commands",
        nargs="+",
        choices=["hello", "hybrid", "train"],
        help="what to run, in order",
    )
    p.add_argument(
        "--devices", type=int, help="simulated CPU devices per process (default: 8)"
    )
    p.add_argument("--out", help="directory where every process writes rank<i>.json")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=4)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument(
        "--checkpoint-dir",
        help="save after every epoch here, and resume from the latest checkpoint",
    )
    p.add_argument("--fail-rank", type=int, help="the process that fails on purpose")
    p.add_argument(
        "--fail-at-epoch",
        type=int,
        help="0-based epoch at whose start --fail-rank fails",
    )
    p.add_argument(
        "--fail-how",
        choices=FAILURES,
        default="kill",
        help="how it fails (default: %(default)s)",
    )
    p.add_argument(
        "--pause", type=float, default=0.0, help="seconds to sleep after each step"
    )
    defaults = multihost.Timeouts()
    p.add_argument(
        "--initialization-timeout", type=int, default=defaults.initialization
    )
    p.add_argument("--heartbeat-timeout", type=int, default=defaults.heartbeat)
    p.add_argument("--shutdown-timeout", type=int, default=defaults.shutdown)
    p.add_argument(
        "--no-exit-on-error",
        action="store_true",
        help="let an exception exit through jax.distributed.shutdown() (to see the job wait)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Join the processes, run the commands, write ``--out``."""
    args = parser().parse_args(argv)
    # gloo's connection messages must not break our lines
    multihost.native_stdout_to_stderr()
    info = multihost.initialize(
        args.devices,
        timeouts=multihost.Timeouts(
            args.initialization_timeout, args.heartbeat_timeout, args.shutdown_timeout
        ),
        exit_on_error=not args.no_exit_on_error,
    )
    if jax.default_backend() == "cpu":  # simulated devices: devices.py says why
        devices.save_replicated_arrays_from_one_replica()
    report = {}
    for command in args.commands:
        if command == "hello":
            report["hello"] = hello(info)
        elif command == "hybrid":
            report["hybrid"] = hybrid()
        else:
            report["train"] = train_digits(
                args.epochs,
                args.steps_per_epoch,
                args.per_device_batch,
                checkpoint_dir=args.checkpoint_dir,
                fail_rank=args.fail_rank,
                fail_at_epoch=args.fail_at_epoch,
                fail_how=args.fail_how,
                pause_s=args.pause,
            )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{jax.process_index()}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1:])
