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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--expect-devices", type=int, help="the devices the job should have in all"
    )
    args = parser.parse_args()
    # First, before anything else touches JAX. Open MPI 5's mpirun needs the mpi4py
    # detection; SLURM, Kubernetes and Cloud TPU are detected with no arguments.
    method = "mpi4py" if "OMPI_COMM_WORLD_SIZE" in os.environ else None
    try:
        jax.distributed.initialize(cluster_detection_method=method)
    except ValueError as error:  # no launcher found: go on as one process, and say so
        print(f"no cluster detected ({error}); running as one process", flush=True)
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
