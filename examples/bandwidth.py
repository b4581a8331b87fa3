"""How fast are the links? Collectives timed over a mesh axis, as nccl-tests reports.

    python examples/bandwidth.py                          # every GPU of this machine
    srun python examples/bandwidth.py --axis across       # SLURM, one process a GPU
    mpirun -np 16 python examples/bandwidth.py --expect-gbps 300       # Open MPI 5
    python examples/bandwidth.py --num-devices 8 --per-node 4  # 8 CPU devices, 2 nodes

For each collective (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute) and each message size from --min-bytes to --max-bytes (doubling), it
prints the time of one operation and two bandwidths, as nccl-tests defines them
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

- size S: the bytes of one device's array for all-reduce, all-to-all and
  collective-permute; of the whole gathered (or scattered) array for all-gather and
  reduce-scatter;
- algbw = S / time;
- busbw = algbw x factor: 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
  reduce-scatter and all-to-all, 1 for a permute (nccl-tests' sendrecv). Bus bandwidth
  compares with the hardware's link bandwidth, whatever the group size n.

--axis chooses the devices of each group: "all" of them, those "inside" a node, or one
device of each node "across" nodes (a node: the processes on one host, or --per-node
devices). With --expect-gbps X, every process exits with status 1 when the largest
message's bus bandwidth of any collective is below X GB/s: a job script can refuse to
start on a node whose NCCL fell back to sockets. One process per GPU under srun and
mpirun, as JAX starts them; JAX and NumPy only.

With one device there is nothing to send between devices: it times copies between the
host's pinned memory and the device instead (host-to-device, device-to-host: the copies
that offloading makes), as CUDA's bandwidthTest does; --collective chooses one of them
on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
COPIES = ("host-to-device", "device-to-host")  # one device's copies, not collectives
ITEMSIZE = 4  # float32


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth, for a group of ``n``."""
    if collective == "all-reduce":
        return 2 * (n - 1) / n
    if collective == "collective-permute" or collective in COPIES:
        return 1.0
    return (n - 1) / n


def unit_bytes(collective: str, n: int) -> int:
    """The smallest size S that splits into whole float32 values on ``n`` devices."""
    split = collective in ("all-gather", "reduce-scatter", "all-to-all")
    return ITEMSIZE * (n if split else 1)


def sizes(collective: str, n: int, low: int, high: int) -> list[int]:
    """Doubling sizes from ``low`` to ``high``, each rounded down to a whole
    ``unit_bytes`` (and at least one unit), without repeats."""
    unit, out, size = unit_bytes(collective, n), [], low
    while size <= high:
        rounded = max(size // unit * unit, unit)
        if rounded not in out:
            out.append(rounded)
        size *= 2
    return out


def per_device_elements(collective: str, size: int, n: int) -> int:
    """The float32 values each device holds before the collective, for size S."""
    split = collective in ("all-gather",)  # S is the gathered array: each holds 1/n
    return size // ITEMSIZE // (n if split else 1)


def operation(collective: str, axis: str, n: int):
    """The per-device function of one collective over mesh axis ``axis`` (n devices)."""
    if collective == "all-reduce":
        return lambda x: jax.lax.psum(x, axis)
    if collective == "all-gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if collective == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
    if collective == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    ring = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: jax.lax.ppermute(x, axis, ring)


def node_of_processes(per_node: int | None) -> list[int]:
    """Each process's node, the same list on every process: ``per_node`` devices to a
    node, or the processes that share a hostname (gathered from all of them)."""
    if per_node:
        local = jax.local_device_count()
        return [p * local // per_node for p in range(jax.process_count())]
    if jax.process_count() == 1:
        return [0]
    name = np.zeros(256, np.uint8)
    encoded = socket.gethostname().encode()[:256]
    name[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    names = [bytes(r).rstrip(b"\0") for r in multihost_utils.process_allgather(name)]
    order = list(dict.fromkeys(names))
    return [order.index(n) for n in names]


def node_mesh(per_node: int | None) -> Mesh:
    """A (node, local) mesh of every device: a row per node, in process and device
    order. With one process, ``per_node`` cuts its devices into simulated nodes."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if jax.process_count() == 1 and per_node:
        nodes = [i // per_node for i in range(len(devices))]
    else:
        of_process = node_of_processes(per_node)
        nodes = [of_process[d.process_index] for d in devices]
    count = max(nodes) + 1
    if len(devices) % count or any(
        nodes.count(k) != len(devices) // count for k in range(count)
    ):
        raise SystemExit(f"the nodes hold different numbers of devices: {nodes}")
    grid = np.array(devices, dtype=object).reshape(count, len(devices) // count)
    return Mesh(grid, ("node", "local"), axis_types=(AxisType.Explicit,) * 2)


def program(collective: str, mesh: Mesh, axis: str, size: int):
    """The jitted collective of size S over ``axis`` of ``mesh``, and its input: every
    device holds its own block (float32 ones)."""
    every = P(("node", "local"))
    elements = per_device_elements(collective, size, mesh.shape[axis])
    step = jax.jit(
        jax.shard_map(
            operation(collective, axis, mesh.shape[axis]),
            mesh=mesh,
            in_specs=every,
            out_specs=every,
        )
    )
    make = jax.jit(
        lambda: jnp.ones((mesh.size * elements,), jnp.float32),
        out_shardings=NamedSharding(mesh, every),
    )
    return step, make()


def copy_program(direction: str, size: int):
    """A copy of S bytes (float32 ones) between this process's first device and its
    pinned host memory, in ``direction``, and its input."""
    device = jax.local_devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    source, target = (
        (host, on_device) if direction == "host-to-device" else (on_device, host)
    )
    x = jax.device_put(np.ones(size // ITEMSIZE, np.float32), source)
    return (lambda x: jax.device_put(x, target)), x


def timed(step, x, iters: int, warmup: int) -> float:
    """Seconds for one run of ``step`` (the slowest process's mean over ``iters`` runs,
    after ``warmup``)."""
    for _ in range(warmup):
        step(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        out = step(x)
    out.block_until_ready()
    seconds = np.array([(time.perf_counter() - start) / iters])
    return float(multihost_utils.process_allgather(seconds).max())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--collective", default="all", choices=["all", *COLLECTIVES, *COPIES]
    )
    parser.add_argument("--axis", default="all", choices=["all", "inside", "across"])
    parser.add_argument("--min-bytes", type=int, default=8)
    parser.add_argument(
        "--max-bytes",
        type=int,
        help="default: 1 GiB on a GPU or TPU, 4 MiB on CPU devices",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--per-node",
        type=int,
        help="devices a node (default: the processes on one host)",
    )
    parser.add_argument(
        "--expect-gbps",
        type=float,
        help="exit 1 when the largest message's bus bandwidth is below this",
    )
    parser.add_argument(
        "--num-devices",
        type=int,
        help="simulated CPU devices (one process, no accelerator)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    for name in ("min_bytes", "iters", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_bytes is not None and args.max_bytes < args.min_bytes:
        parser.error("--max-bytes must be at least --min-bytes")
    return args


# Join only when a launcher started several processes. With none, initialize() still
# looks for a cluster, and on a TPU VM it asks the Cloud metadata server, which fails or
# hangs where there is none. JAX's detection reads these variables (jax/_src/clusters/).
def join_processes() -> bool:
    """Join the job's other processes if a launcher started several; say whether."""
    env = os.environ
    mpi = int(env.get("OMPI_COMM_WORLD_SIZE", 1)) > 1  # Open MPI's mpirun
    tpu_hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES", "")
    several = (
        mpi
        # srun; an salloc shell or a batch script has SLURM_NTASKS but no step
        or (int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_STEP_NODELIST" in env)
        or "JOB_COMPLETION_INDEX" in env  # a pod of a Kubernetes Indexed Job (a JobSet)
        or "," in tpu_hosts  # a TPU slice of several hosts on GKE
        or int(env.get("MEGASCALE_NUM_SLICES", 1)) > 1  # several TPU slices
        or "JAX_COORDINATOR_ADDRESS" in env  # set by hand, as for a Cloud TPU VM slice
    )
    if several:  # jax 0.10.2 finds Open MPI 5's processes only through mpi4py
        jax.distributed.initialize(cluster_detection_method="mpi4py" if mpi else None)
    return several


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.num_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.num_devices)
    join_processes()  # before anything else touches JAX's backends
    mesh = node_mesh(args.per_node)
    axis = {"all": ("node", "local"), "inside": "local", "across": "node"}[args.axis]
    n = mesh.size if args.axis == "all" else mesh.shape[axis]
    copies_only = n < 2 and args.axis == "all" and args.collective == "all"
    if n < 2 and not copies_only and args.collective not in COPIES:
        raise SystemExit(
            f"--axis {args.axis} has groups of {n} device: nothing to send "
            f"(mesh: {dict(mesh.shape)} nodes x devices)"
        )
    nodes = mesh.shape["node"]
    if args.axis == "all":  # one axis over every device
        flat = np.array(mesh.devices).reshape(1, -1)
        mesh = Mesh(flat, ("node", "local"), axis_types=(AxisType.Explicit,) * 2)
        axis = "local"
    accelerator = jax.default_backend() != "cpu"
    high = args.max_bytes or (2**30 if accelerator else 2**22)
    chosen = COLLECTIVES if args.collective == "all" else (args.collective,)
    lead = jax.process_index() == 0
    if lead:
        kind = jax.devices()[0].device_kind
        print(
            f"# {jax.device_count()} devices ({kind}) on {nodes} node(s), "
            f"{jax.process_count()} process(es); groups of {n} over --axis "
            f"{args.axis}\n# jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}",
            flush=True,
        )
    if copies_only:
        chosen = COPIES
        if lead:
            print(
                "# one device: no collective to time; copies between pinned host "
                "memory and the device instead"
            )
    rows = []
    for collective in chosen:
        if lead:
            print(f"\n# {collective}, bus factor {bus_factor(collective, n):.4g}")
            print(
                f"{'size (B)':>12} {'count':>11} {'time (us)':>11} "
                f"{'algbw (GB/s)':>13} {'busbw (GB/s)':>13}",
                flush=True,
            )
        for size in sizes(collective, n, args.min_bytes, high):
            if collective in COPIES:
                step, x = copy_program(collective, size)
            else:
                step, x = program(collective, mesh, axis, size)
            seconds = timed(step, x, args.iters, args.warmup)
            algbw = size / seconds / 1e9
            row = {
                "collective": collective,
                "size": size,
                "count": size // ITEMSIZE,
                "group": 1 if collective in COPIES else n,
                "seconds": seconds,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * bus_factor(collective, n),
            }
            rows.append(row)
            if lead:
                print(
                    f"{size:>12} {row['count']:>11} {seconds * 1e6:>11.2f} "
                    f"{algbw:>13.3f} {row['busbw_gbps']:>13.3f}",
                    flush=True,
                )
    if args.json and lead:
        with open(args.json, "w") as f:
            json.dump({"axis": args.axis, "group": n, "rows": rows}, f, indent=1)
    if args.expect_gbps is not None:
        # each collective's last, largest size
        largest = {r["collective"]: r for r in rows}
        slow = [r for r in largest.values() if r["busbw_gbps"] < args.expect_gbps]
        if slow:
            worst = ", ".join(f"{r['collective']} {r['busbw_gbps']:.3g}" for r in slow)
            print(
                f"bandwidth FAILED on process {jax.process_index()}: bus bandwidth at "
                f"{max(r['size'] for r in slow):,} B below {args.expect_gbps:g} GB/s: "
                f"{worst} GB/s",
                file=sys.stderr,
                flush=True,
            )
            return 1
        if lead:
            print(
                f"\nbandwidth passed: every collective's bus bandwidth at its largest "
                f"size is at least {args.expect_gbps:g} GB/s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
