"""Several JAX processes as one program (chapter 8): join them, mesh their devices, share data and results.

JAX's multi-controller model: a cluster tool (``mpirun``, ``srun``, a Kubernetes JobSet, Cloud
TPU's ``--worker=all``) starts the same script once per host, and every copy calls
``jax.distributed.initialize`` *before* JAX starts its backends. JAX detects the cluster itself;
``initialize`` here only adds what a book on simulated devices needs: the number of CPU devices
per process, the mpi4py detection when ``mpirun`` started us (Open MPI 5 does not set the variable
JAX's own Open MPI detection reads), timeouts that suit a small job, and an exit at once on an
uncaught exception (otherwise the process waits in JAX's shutdown barrier).

From then on ``jax.devices()`` lists every process's devices, a mesh can span them all, and a
jitted function on arrays sharded over that mesh runs on all processes at once, with collectives
crossing processes (through gloo on the CPU, NCCL on GPUs, ICI/DCN on TPUs). Each process only
touches its own devices' shards: it loads its rows of a batch and
``jax.make_array_from_process_local_data`` assembles the global array.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

# PRIVATE (as in devices.py): the only way to ask "has JAX started?" without starting it.
from jax._src import xla_bridge
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import devices
from jaxdist_lessons import mesh as mesh_lib

# Set by MPI launchers in every rank's environment: Open MPI's mpirun (4 and 5), MPICH's and
# Intel MPI's Hydra. With one of them present, initialize() asks JAX for its mpi4py detection.
MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")

# What jax.distributed.initialize raises when it was given no coordinator and detected no cluster.
_NO_CLUSTER = "coordinator_address should be defined."


class MultihostError(RuntimeError):
    """Processes that cannot be joined as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """This process's place in the job: its index, the process count, and the devices it sees."""

    process_index: int
    process_count: int
    local_devices: int
    global_devices: int
    platform: str
    joined_by: str  # "mpi4py", "cluster detection", "arguments" or "single process"

    def __str__(self) -> str:
        return (
            f"process {self.process_index} of {self.process_count}: {self.local_devices} local and "
            f"{self.global_devices} global {self.platform.upper()} devices (joined by {self.joined_by})"
        )


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """``jax.distributed.initialize``'s three timeouts, in seconds, as ``initialize`` sets them."""

    initialization: int = dataclasses.field(
        default=300,
        metadata={
            "bounds": "every process's wait for all the others to join: the slowest host's start"
        },
    )
    heartbeat: int = dataclasses.field(
        default=30,
        metadata={
            "bounds": "the coordinator's wait for a silent process before it aborts them all"
        },
    )
    shutdown: int = dataclasses.field(
        default=60,
        metadata={"bounds": "the final barrier's wait for the last process to finish"},
    )


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher (``mpirun``, ``mpiexec``) started this process."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in MPI_VARIABLES)


def initialize(
    num_devices: int | None = None,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    timeouts: Timeouts = Timeouts(),
    exit_on_error: bool = True,
) -> ProcessInfo:
    """Join this process to the others through JAX's cluster detection, then start JAX.

    ``num_devices`` (else ``$JAXDIST_NUM_DEVICES``, else 8) is the number of simulated CPU
    devices *per process*. Under an MPI launcher JAX uses mpi4py; otherwise it detects SLURM,
    Kubernetes or Cloud TPU, or takes the explicit arguments; with none of them this is a
    single process. ``local_device_ids`` (the GPUs this process drives) goes to
    ``jax.distributed.initialize``. ``exit_on_error`` ends the process at once on an uncaught
    exception (``exit_at_once_on_error``).
    """
    if xla_bridge.backends_are_initialized() or jax.distributed.is_initialized():
        raise MultihostError(
            "JAX has already started in this process, and processes can only be joined before "
            "JAX's first operation: call multihost.initialize() first thing in the script "
            "(instead of devices.setup()), and start one copy per process (mpirun -np N, srun -n N)"
        )
    # The CPU client is created once, after initialize(): the device count must be set before it.
    jax.config.update(
        "jax_num_cpu_devices",
        devices.requested_num_devices(num_devices) or devices.DEFAULT_NUM_DEVICES,
    )
    explicit = coordinator_address is not None or num_processes is not None
    method = "mpi4py" if launched_by_mpi() and not explicit else None
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids,
            cluster_detection_method=method,
            initialization_timeout=timeouts.initialization,
            heartbeat_timeout_seconds=timeouts.heartbeat,
            shutdown_timeout_seconds=timeouts.shutdown,
        )
    except ValueError as error:
        if str(error) != _NO_CLUSTER or explicit:
            raise
        return process_info("single process")
    if exit_on_error:
        exit_at_once_on_error()
    return process_info(method or ("arguments" if explicit else "cluster detection"))


def process_info(joined_by: str = "single process") -> ProcessInfo:
    """This process's index, the process count and the devices it sees (starts JAX if needed)."""
    return ProcessInfo(
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
        joined_by,
    )


def exit_at_once_on_error() -> None:
    """Make an uncaught exception print its traceback and end the process at once, with status 1.

    Otherwise Python exits through ``jax.distributed.shutdown()`` (registered with ``atexit``),
    whose barrier waits up to the shutdown timeout for the other processes, while they wait for
    this one in their next collective. Exiting at once lets ``mpirun`` or ``srun
    --kill-on-bad-exit=1`` stop the job, and the others' broken collectives end them too.
    """
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skips atexit, and the shutdown barrier with it

    sys.excepthook = hook


def native_stdout_to_stderr() -> None:
    """Send what native code writes to stdout to stderr instead; Python's ``print`` still goes to stdout.

    Gloo prints a line per connection (``[Gloo] Rank 0 is connected to 7 peer ranks...``) to the
    C-level stdout, in pieces and from several threads at once. On the same file descriptor as the
    program's own lines, those pieces land inside them. This points file descriptor 1, where C++
    writes, at stderr, and gives ``sys.stdout`` the original stdout. Call it first thing in a script
    whose output is read line by line; it changes the whole process, so not in a notebook.
    """
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdout = open(original, "w", buffering=1, encoding=encoding, errors=errors)  # noqa: SIM115


def split_devices(total: int, processes: int = 2) -> tuple[int, int]:
    """``(processes, devices per process)`` for ``total`` devices, or the nearest smaller total that splits evenly."""
    if total < processes:
        raise MultihostError(f"{total} devices cannot be shared by {processes} processes")
    return processes, total // processes


# --- Meshes and arrays across processes ---------------------------------------------------------


def global_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str],
    axis_types: AxisType = AxisType.Explicit,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh over every process's devices (``jax.devices()`` lists them all, process 0's first)."""
    return mesh_lib.make_mesh(shape, axis_names, axis_types=axis_types, devices=devices)


def hybrid_mesh(
    ici_shape: Sequence[int],
    dcn_shape: Sequence[int],
    axis_names: Sequence[str],
    axis_types: AxisType = AxisType.Explicit,
) -> Mesh:
    """A mesh whose axis ``i`` has ``ici_shape[i]`` devices inside a process times ``dcn_shape[i]`` processes.

    Collectives along an axis with ``dcn_shape[i] == 1`` never leave a host: put the chattiest
    parallelism (``model``) there and the least chatty (``data``) across hosts.
    """
    if len(ici_shape) != len(dcn_shape) or len(ici_shape) != len(axis_names):
        raise MultihostError(
            f"ici_shape {tuple(ici_shape)}, dcn_shape {tuple(dcn_shape)} and axis_names "
            f"{tuple(axis_names)} need one entry per axis each"
        )
    if (
        int(np.prod(dcn_shape)) != jax.process_count()
        or int(np.prod(ici_shape)) != jax.local_device_count()
    ):
        raise MultihostError(
            f"dcn_shape {tuple(dcn_shape)} must multiply to the {jax.process_count()} processes and ici_shape "
            f"{tuple(ici_shape)} to the {jax.local_device_count()} devices of each process"
        )
    # process_is_granule: a "slice" is a process (simulated CPU devices have no TPU slice ids).
    grid = mesh_utils.create_hybrid_device_mesh(
        ici_shape, dcn_shape, process_is_granule=True
    )
    types = (axis_types,) * len(axis_names)
    return Mesh(grid, tuple(axis_names), axis_types=types)


def process_grid(mesh: Mesh) -> np.ndarray:
    """The mesh with each device replaced by the index of the process that owns it."""
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def processes_per_group(mesh: Mesh, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each group of a collective compiled on ``mesh``, the processes its devices belong to.

    ``groups`` as ``hlo.replica_group_lists`` reads them: positions in the mesh's device order.
    """
    flat = mesh.devices.flat
    return [sorted({flat[i].process_index for i in group}) for group in groups]


def global_array(local: np.ndarray, mesh: Mesh, spec: P | None = None) -> jax.Array:
    """One global array from each process's rows, sharded as ``spec`` (default ``P('data')``).

    The first axis is split across processes in process order.
    """
    spec = P("data") if spec is None else spec
    global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    return jax.make_array_from_process_local_data(
        NamedSharding(mesh, spec), local, global_shape
    )


def allgather(tree: Any, tiled: bool = False) -> Any:
    """Every process's value of ``tree`` on every process as NumPy, stacked (or concatenated if ``tiled``).

    An array that spans processes comes back whole, on every process.
    """
    return multihost_utils.process_allgather(tree, tiled=tiled)


def sync(name: str) -> None:
    """Wait until every process reaches the barrier ``name``."""
    multihost_utils.sync_global_devices(name)


def is_primary() -> bool:
    """Whether this is process 0, which prints and writes the files only one process should write."""
    return jax.process_index() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on process 0 only, flushed at once (so a job's output is in order)."""
    if is_primary():
        print(*args, **{"flush": True, **kwargs})
