"""Several JAX processes as one program (chapter 8): join them, mesh their devices, share data and results.

JAX's multi-controller model: every process runs the same script. ``initialize()`` joins the
processes through ``jax.distributed.initialize`` *before* JAX starts its backends; from then on
``jax.devices()`` lists every process's devices, a mesh can span them all, and a jitted
function on arrays sharded over that mesh runs on all processes at once, with collectives
crossing processes (through gloo on the CPU, NCCL on GPUs, ICI/DCN on TPUs).

Each process only ever touches its own devices' shards: it loads its rows of a batch and
``jax.make_array_from_process_local_data`` assembles the global array (``data.batches`` does
this), and it reads back only what it holds unless ``allgather`` collects the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

# PRIVATE JAX modules (jax._src can change in any release; tests/test_multihost.py fails if these move):
# the only way to ask "has JAX started?" and "which cluster would JAX detect?" without side effects.
from jax._src import clusters, xla_bridge
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import devices, launch, train
from jaxdist_lessons import mesh as mesh_lib


class MultihostError(RuntimeError):
    """Processes that cannot be joined as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class LauncherSettings:
    """What ``jaxdist_lessons.launch`` put in a process's environment."""

    coordinator: str
    num_processes: int
    process_id: int
    bind: str


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """This process's place in the job: its index, the process count, and the devices it sees."""

    process_index: int
    process_count: int
    local_devices: int
    global_devices: int
    platform: str
    joined_by: (
        str  # "launcher", a cluster JAX detected (e.g. "SlurmCluster"), or "single process"
    )

    def __str__(self) -> str:
        return (
            f"process {self.process_index} of {self.process_count}: {self.local_devices} local and "
            f"{self.global_devices} global {self.platform.upper()} devices (joined by {self.joined_by})"
        )


def launcher_settings(environ: Mapping[str, str] | None = None) -> LauncherSettings | None:
    """The launcher's variables from ``environ`` (default ``os.environ``), or ``None`` if it did not start us."""
    environ = os.environ if environ is None else environ
    names = (launch.ENV_COORDINATOR, launch.ENV_NUM_PROCESSES, launch.ENV_PROCESS_ID)
    present = [name for name in names if environ.get(name)]
    if not present:
        return None
    if len(present) < len(names):
        missing = sorted(set(names) - set(present))
        raise MultihostError(
            f"{present} are set but {missing} are not: set all three (the launcher does), "
            "or none to let JAX detect the cluster"
        )
    counts = {}
    for name in (launch.ENV_NUM_PROCESSES, launch.ENV_PROCESS_ID):
        if not re.fullmatch(r"\d+", environ[name]):
            raise MultihostError(
                f"{name} must be a non-negative integer, got {environ[name]!r}"
            )
        counts[name] = int(environ[name])
    num_processes, process_id = (
        counts[launch.ENV_NUM_PROCESSES],
        counts[launch.ENV_PROCESS_ID],
    )
    if not 0 <= process_id < num_processes:
        raise MultihostError(
            f"{launch.ENV_PROCESS_ID}={process_id} must be in 0..{num_processes - 1} "
            f"for {launch.ENV_NUM_PROCESSES}={num_processes}"
        )
    coordinator = environ[launch.ENV_COORDINATOR]
    return LauncherSettings(
        coordinator,
        num_processes,
        process_id,
        bind=environ.get(launch.ENV_COORDINATOR_BIND) or coordinator,
    )


def detected_cluster() -> str | None:
    """The cluster environment ``jax.distributed.initialize()`` would detect on its own (SLURM, Cloud TPU, Open MPI...).

    Reads JAX's private list of cluster types (``jax._src.clusters``), as ``initialize`` does;
    it may change in a later JAX release.
    """
    registry = getattr(clusters.ClusterEnv, "_cluster_types", None)
    if registry is None:
        raise MultihostError(
            f"jax {jax.__version__} moved its private list of cluster types "
            "(jax._src.clusters.ClusterEnv._cluster_types): update multihost.detected_cluster"
        )
    found = (env for env in registry if not env.opt_in_only_method and env.is_env_present())
    env = next(found, None)
    return None if env is None else env.__name__


def initialize(
    num_devices: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
    shutdown_timeout_seconds: int = 300,
) -> ProcessInfo:
    """Join this process to the others, then start JAX; the multi-process ``devices.setup()``.

    Reads the launcher's variables; without them, lets JAX detect SLURM, Cloud TPU or Open MPI;
    without those, runs as a single process. ``num_devices`` (else ``$JAXDIST_NUM_DEVICES``, else 8)
    is the number of simulated CPU devices *per process*. ``local_device_ids`` (the GPUs this
    process drives) and the timeouts go to ``jax.distributed.initialize`` (JAX's defaults). On
    SLURM and Open MPI without ``local_device_ids``, JAX gives each process only the GPU numbered
    by its local rank (``SLURM_LOCALID``): start one process per GPU, or pass
    ``local_device_ids=range(8)`` to drive a host's 8 GPUs from one process. A single process
    ignores it.
    """
    if xla_bridge.backends_are_initialized() or jax.distributed.is_initialized():
        raise MultihostError(
            "JAX has already started in this process, and processes can only be joined before JAX's first "
            "operation: call multihost.initialize() first thing in the script (instead of devices.setup()), "
            "and start one process per host (python -m jaxdist_lessons.launch does)"
        )
    # The CPU client is created once, after initialize(): the device count must be set before it.
    jax.config.update(
        "jax_num_cpu_devices",
        devices.requested_num_devices(num_devices) or devices.DEFAULT_NUM_DEVICES,
    )
    options = {
        "local_device_ids": local_device_ids,
        "initialization_timeout": initialization_timeout,
        "heartbeat_timeout_seconds": heartbeat_timeout_seconds,
        "shutdown_timeout_seconds": shutdown_timeout_seconds,
    }
    settings = launcher_settings()
    if settings is not None:
        jax.distributed.initialize(
            settings.coordinator,
            settings.num_processes,
            settings.process_id,
            coordinator_bind_address=settings.bind,
            **options,
        )
        joined_by = "launcher"
    elif (cluster := detected_cluster()) is not None:
        jax.distributed.initialize(**options)
        joined_by = cluster
    else:
        joined_by = "single process"
    return process_info(joined_by)


def process_info(joined_by: str = "") -> ProcessInfo:
    """This process's index, the process count and the devices it sees (starts JAX if needed)."""
    return ProcessInfo(
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
        joined_by or ("launcher" if launcher_settings() else "unknown"),
    )


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


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """On an uncaught exception, print it and exit at once with status 1.

    Without this, a process that raises waits in JAX's shutdown barrier for the others
    (``shutdown_timeout_seconds``, 300 s by default) while they wait for it in their next
    collective: the whole job hangs. Exiting at once lets the launcher (or srun) stop the job.
    """
    try:
        yield
    except BaseException as error:
        if not jax.distributed.is_initialized() or (
            isinstance(error, SystemExit) and error.code in (0, None)
        ):
            raise
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        code = (
            error.code
            if isinstance(error, SystemExit) and isinstance(error.code, int)
            else 1
        )
        os._exit(code)  # skips atexit's jax.distributed.shutdown(), and its barrier


# --- Meshes and arrays across processes ---------------------------------------------------------


def global_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str],
    axis_types: AxisType = AxisType.Explicit,
) -> Mesh:
    """A mesh over every process's devices (``jax.devices()`` lists them all, process 0's first)."""
    return mesh_lib.make_mesh(shape, axis_names, axis_types=axis_types)


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

    ``groups`` as ``comms.replica_group_lists`` reads them: positions in the mesh's device order.
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
    """``print`` on process 0 only."""
    if is_primary():
        print(*args, **kwargs)


# --- Checkpoints --------------------------------------------------------------------------------


def save_checkpoint(root: str, step: int, state: Any) -> str:
    """Save ``state`` as ``root/<step>``: every process must call it; each writes its own shards.

    Orbax lets process 0 alone write the metadata and waits for all processes, so a checkpoint
    directory only appears once it is complete.
    """
    path = os.path.join(root, str(step))
    train.save_checkpoint(path, state)
    return path


def latest_step(root: str) -> int | None:
    """The highest step saved completely under ``root`` (Orbax writes to a temporary name, then renames)."""
    if not os.path.isdir(root):
        return None
    steps = [int(name) for name in os.listdir(root) if name.isdigit()]
    return max(steps, default=None)


def restore_latest(root: str, like: Any, shardings: Any) -> tuple[Any, int] | None:
    """``(state, step)`` from the latest checkpoint under ``root`` with the given shardings, or ``None``."""
    step = latest_step(root)
    if step is None:
        return None
    return train.restore_checkpoint(os.path.join(root, str(step)), like, shardings), step
