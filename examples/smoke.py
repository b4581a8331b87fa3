"""Run this first on a new cluster: do the processes join, does a psum reach them all?

    srun python examples/smoke.py --expect-devices 16            # SLURM, 2 x 8 GPUs
    mpirun -np 16 python examples/smoke.py --expect-devices 16   # Open MPI 5
    JAX_NUM_CPU_DEVICES=2 mpirun -np 2 python examples/smoke.py  # here, on CPU devices

Every process prints its index, its host and its devices; process 0 prints "smoke test
passed". Otherwise every process exits with status 1 and a message that says what went
wrong.
"""

import argparse
import os
import socket
import sys

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def fail(message: str) -> None:
    print(
        f"smoke test FAILED on process {jax.process_index()}: {message}",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(1)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--expect-devices", type=int, help="the devices the job should have in all"
    )
    args = parser.parse_args()
    if not join_processes():  # first, before anything else touches JAX
        print(
            "running as one process: no launcher (mpirun, srun, Kubernetes, a TPU "
            "slice) started several",
            flush=True,
        )
    local = ", ".join(str(d) for d in jax.local_devices())
    print(
        f"process {jax.process_index()} of {jax.process_count()} "
        f"on {socket.gethostname()}: "
        f"{jax.local_device_count()} local devices [{local}], "
        f"{jax.device_count()} in all",
        flush=True,
    )
    total = jax.device_count()
    if args.expect_devices is not None and total != args.expect_devices:
        fail(
            f"the job has {total} devices, not {args.expect_devices}: "
            "check the tasks per node, the GPUs each task sees (CUDA_VISIBLE_DEVICES) "
            "and local_device_ids"
        )
    # Device k of the mesh holds k + 1; a psum over them all gives 1 + 2 + ... + total.
    mesh = jax.make_mesh((total,), ("all",), axis_types=(AxisType.Explicit,))
    values = np.arange(1, total + 1, dtype=np.float32)
    x = jax.make_array_from_callback(
        (total,), NamedSharding(mesh, P("all")), lambda i: values[i]
    )
    psum = jax.jit(
        jax.shard_map(
            lambda b: jax.lax.psum(b, "all"),
            mesh=mesh,
            in_specs=P("all"),
            out_specs=P(),
        )
    )
    got = float(np.asarray(psum(x).addressable_shards[0].data)[0])
    expected = total * (total + 1) / 2
    if got != expected:
        fail(f"psum over {total} devices gave {got}, not {expected}")
    if jax.process_index() == 0:
        print(f"smoke test passed: psum over {total} devices = {got:g}", flush=True)


if __name__ == "__main__":
    main()
