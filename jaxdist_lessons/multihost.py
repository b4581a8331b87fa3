"""Several JAX processes as one program (chapter 08_multi_host): join them, mesh their devices, share data and results.

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
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

from jaxdist_lessons import devices

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


def launcher_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with this Python's folder first on ``PATH``,
    as an activated virtual environment has it: a command started from a notebook then
    finds the environment's ``mpirun`` and ``python`` even when the kernel was started
    without activating it."""
    env = dict(os.environ if environ is None else environ)
    env["PATH"] = os.pathsep.join(
        [os.path.dirname(sys.executable)] + ([env["PATH"]] if env.get("PATH") else [])
    )
    return env


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

    ``num_devices`` (else ``$JAXDIST_NUM_DEVICES``, else 8) is the number of simulated
    CPU devices *per process*. Under an MPI launcher JAX uses mpi4py; otherwise it
    detects SLURM, Kubernetes or Cloud TPU, or takes the explicit arguments; with none
    of them this is a single process. ``local_device_ids`` (the GPUs this process
    drives) goes to ``jax.distributed.initialize``. ``exit_on_error`` ends the process
    at once on an uncaught exception (``exit_at_once_on_error``).
    """
    started = MultihostError(
        "JAX has already started in this process, and processes can only be joined "
        "before JAX's first operation: call multihost.initialize() first thing in the "
        "script (instead of devices.setup()), and start one copy per process "
        "(mpirun -np N, srun -n N)"
    )
    if jax.distributed.is_initialized():
        raise started
    # The CPU client is created once, after initialize(): the device count must be set
    # before it. JAX refuses the setting (RuntimeError) once its backends have started:
    # the public way to ask whether they have.
    count = devices.requested_num_devices(num_devices) or devices.DEFAULT_NUM_DEVICES
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        raise started from None
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
    except RuntimeError as error:  # JAX started already, with the same CPU device count
        if "must be called before any JAX calls" in str(error):
            raise started from None
        raise
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
    """Make an uncaught exception print its traceback and end the process at once, with
    status 1.

    Otherwise Python exits through ``jax.distributed.shutdown()`` (registered with
    ``atexit``), whose barrier waits up to the shutdown timeout for the other processes,
    while they wait for this one in their next collective. Exiting at once lets
    ``mpirun`` or ``srun --kill-on-bad-exit=1`` stop the job, and the others' broken
    collectives end them too.
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


# --- Meshes across processes ---------------------------------------------------------------------


# What the launcher says about this process's node. SLURM numbers the nodes of a job
# (SLURM_NODEID); Open MPI does not (OMPI_COMM_WORLD_NODE_RANK is a rank *within* a node, like
# OMPI_COMM_WORLD_LOCAL_RANK), so under mpirun a node is known by its hostname.
NODE_VARIABLE = "SLURM_NODEID"
# "0,0,0,0,1,1,1,1": the node of each process, for tests and demos on one machine.
NODE_OVERRIDE = "JAXDIST_NODE_OF_PROCESS"
_KEY_BYTES = 256  # hostnames are at most 253 characters


def node_key(environ: Mapping[str, str] | None = None) -> str:
    """What names this process's node: SLURM's node index when ``srun`` started it, else the hostname."""
    environ = os.environ if environ is None else environ
    if NODE_VARIABLE in environ:
        return f"slurm node {environ[NODE_VARIABLE]}"
    return socket.gethostname()


def number_nodes(keys: Sequence[str]) -> list[int]:
    """Node numbers 0, 1, ... for each process's node key, in the order the nodes first appear."""
    first: dict[str, int] = {}
    return [first.setdefault(key, len(first)) for key in keys]


def node_of_processes(environ: Mapping[str, str] | None = None) -> list[int]:
    """The node of every process (index: process index), the same list on every process.

    ``$JAXDIST_NODE_OF_PROCESS`` (``"0,0,1,1"``) overrides; otherwise every process's
    ``node_key`` is gathered from all of them (a collective: every process must call this).
    """
    environ = os.environ if environ is None else environ
    if environ.get(NODE_OVERRIDE):
        nodes = [int(v) for v in environ[NODE_OVERRIDE].split(",")]
        if len(nodes) != jax.process_count():
            raise MultihostError(
                f"{NODE_OVERRIDE}={environ[NODE_OVERRIDE]} names {len(nodes)} processes' nodes; "
                f"the job has {jax.process_count()} processes"
            )
        return nodes
    if jax.process_count() == 1:
        return [0]
    key = np.zeros(_KEY_BYTES, np.uint8)
    encoded = node_key(environ).encode()[:_KEY_BYTES]
    key[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    # (processes, _KEY_BYTES), in process order
    gathered = multihost_utils.process_allgather(key)
    return number_nodes([bytes(row).rstrip(b"\0").decode() for row in gathered])


def node_device_grid(
    ici_shape: Sequence[int],
    dcn_shape: Sequence[int],
    devices: Sequence[Any],
    nodes: Mapping[int, int],
) -> np.ndarray:
    """Devices arranged as ``ici_shape * dcn_shape``: axis ``i`` takes ``ici_shape[i]`` devices of a node
    times ``dcn_shape[i]`` nodes. ``nodes`` maps each device's id to its node.

    A node's devices keep their order (process, then device id), so on GPUs a node's block is
    its GPUs in order. Any objects with ``id`` and ``process_index`` will do, real devices or not.
    """
    if not len(ici_shape) == len(dcn_shape):
        raise MultihostError(
            f"ici_shape {tuple(ici_shape)} and dcn_shape {tuple(dcn_shape)} need one entry per axis each"
        )
    by_node: dict[int, list[Any]] = {}
    for device in devices:
        by_node.setdefault(nodes[device.id], []).append(device)
    per_node = {len(group) for group in by_node.values()}
    if len(by_node) != int(np.prod(dcn_shape)) or per_node != {int(np.prod(ici_shape))}:
        counts = sorted(len(group) for group in by_node.values())
        raise MultihostError(
            f"dcn_shape {tuple(dcn_shape)} must multiply to the {len(by_node)} nodes and ici_shape "
            f"{tuple(ici_shape)} to the devices of each node ({counts})"
        )
    ordered = [d for node in sorted(by_node) for d in sorted(by_node[node], key=_order)]
    size = len(ordered) // len(by_node)
    # As JAX's create_hybrid_device_mesh, on positions in `ordered`: a grid of nodes, each
    # node's block of ici_shape in its place.
    blocks = [
        np.arange(k * size, (k + 1) * size).reshape(ici_shape)
        for k in range(len(by_node))
    ]
    node_grid = np.arange(len(blocks)).reshape(dcn_shape)
    positions = np.block(
        np.vectorize(lambda k: blocks[k], otypes=[object])(node_grid).tolist()
    )
    grid = np.empty(positions.shape, dtype=object)
    for index, position in np.ndenumerate(positions):
        grid[index] = ordered[position]
    return grid


def _order(device: Any) -> tuple[int, int]:
    return device.process_index, device.id


def hybrid_mesh(
    ici_shape: Sequence[int],
    dcn_shape: Sequence[int],
    axis_names: Sequence[str],
    axis_types: AxisType = AxisType.Explicit,
    *,
    devices: Sequence[jax.Device] | None = None,
    nodes: Mapping[int, int] | None = None,
) -> Mesh:
    """A mesh whose axis ``i`` has ``ici_shape[i]`` devices inside a node times
    ``dcn_shape[i]`` nodes.

    Collectives along an axis with ``dcn_shape[i] == 1`` never leave a node (NVLink on
    GPUs): put ``tensor`` there, and ``data`` across nodes. ``nodes`` (device id to
    node) defaults to ``node_of_devices()``. It works for one process per GPU as for one
    process per node: JAX's ``mesh_utils.create_hybrid_device_mesh`` groups by TPU slice
    or by process, and with one process per GPU a process is one GPU, not a node.
    """
    if len(axis_names) != len(ici_shape):
        raise MultihostError(
            f"ici_shape {tuple(ici_shape)} and axis_names {tuple(axis_names)} need one "
            "entry per axis each"
        )
    devices = jax.devices() if devices is None else devices
    nodes = node_of_devices(devices) if nodes is None else nodes
    grid = node_device_grid(ici_shape, dcn_shape, devices, nodes)
    return Mesh(grid, tuple(axis_names), axis_types=(axis_types,) * len(axis_names))


def node_of_devices(devices: Sequence[jax.Device] | None = None) -> dict[int, int]:
    """Each device's id mapped to its node, from ``node_of_processes()`` (a collective)."""
    of_process = node_of_processes()
    return {d.id: of_process[d.process_index] for d in (devices or jax.devices())}


def node_grid(mesh: Mesh, nodes: Mapping[int, int]) -> np.ndarray:
    """The mesh with each device replaced by its node (``nodes``: device id to node)."""
    return np.vectorize(lambda d: nodes[d.id], otypes=[int])(mesh.devices)


def process_grid(mesh: Mesh) -> np.ndarray:
    """The mesh with each device replaced by the index of the process that owns it."""
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def processes_per_group(mesh: Mesh, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each group of a collective compiled on ``mesh``, the processes its devices belong to.

    ``groups`` as ``hlo.replica_group_lists`` reads them: positions in the mesh's device order.
    """
    flat = mesh.devices.flat
    return [sorted({flat[i].process_index for i in group}) for group in groups]


def is_primary() -> bool:
    """Whether this is process 0, which prints and writes the files only one process should write."""
    return jax.process_index() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on process 0 only, flushed at once (so a job's output is in order)."""
    if is_primary():
        print(*args, **{"flush": True, **kwargs})
