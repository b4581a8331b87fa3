"""Data-parallel training over every device of every process, with JAX alone.

Start one copy per process with the cluster's own tool; JAX finds the others:

    JAX_NUM_CPU_DEVICES=2 mpirun -np 3 python examples/train.py
    JAX_NUM_CPU_DEVICES=2 srun -n 3 python examples/train.py

JAX_NUM_CPU_DEVICES gives each process 2 simulated CPU devices; leave it out on GPUs.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


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


join_processes()  # first, before anything else touches JAX

mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,))
GLOBAL_BATCH = 16 * jax.device_count()
ROWS = GLOBAL_BATCH // jax.process_count()  # each process supplies its devices' rows
TRUE_W = np.array([1.0, -2.0, 3.0, 0.5], np.float32)  # what training should find


def local_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of global batch ``step`` (a real loader reads only these)."""
    rng = np.random.default_rng(step)  # the same global batch on every process...
    x = rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32)
    first = jax.process_index() * ROWS  # ...of which this process keeps its own rows
    return x[first : first + ROWS], x[first : first + ROWS] @ TRUE_W


def global_array(local: np.ndarray, spec: P) -> jax.Array:
    """One array over every process's devices, from this process's part of it."""
    shape = (GLOBAL_BATCH, *local.shape[1:]) if spec == P("data") else local.shape
    return jax.make_array_from_process_local_data(
        NamedSharding(mesh, spec), local, shape
    )


@jax.jit
def train_step(w: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One step of gradient descent on mean squared error; XLA all-reduces gradients."""
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * grad, loss


# replicated: every process passes all of it
w = global_array(np.zeros(4, np.float32), P())
for step in range(30):
    x, y = local_batch(step)
    w, loss = train_step(w, global_array(x, P("data")), global_array(y, P("data")))
    loss = float(loss)  # on every process: it waits for the step, so none runs ahead
    if jax.process_index() == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss:.6f}", flush=True)
if jax.process_index() == 0:
    w = np.round(np.asarray(w), 3)
    print(
        f"{jax.process_count()} processes x {jax.local_device_count()} devices; w = {w}"
    )
