"""examples/train.py with Orbax checkpoints: it resumes after a failure or a preemption.

Start one copy per process; run the same command again to resume from the latest one:

    JAX_NUM_CPU_DEVICES=4 mpirun -np 2 python examples/resumable.py /tmp/checkpoints
    srun python examples/resumable.py /shared/checkpoints

Orbax saves the state every --save-every steps. On SIGTERM (scancel, Kubernetes) or
SIGUSR1 (SLURM's --signal=USR1@60; under mpirun, send it to mpirun, which forwards it),
every process saves at the same step and exits 0.
"""

import argparse
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import AxisType
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
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("checkpoint_dir")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--pause", type=float, default=0.0, help="seconds after each step")
args = parser.parse_args()
print(f"process {jax.process_index()}: pid {os.getpid()}", flush=True)

mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,))
jax.set_mesh(mesh)  # the mesh a bare PartitionSpec refers to
FEATURES, GLOBAL_BATCH = 4 * jax.device_count(), 16 * jax.device_count()
ROWS = GLOBAL_BATCH // jax.process_count()  # each process supplies its devices' rows
TRUE_W = np.random.default_rng(0).normal(size=FEATURES).astype(np.float32)
tx = optax.adam(0.05)


def local_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of global batch ``step``, which depends on the step alone."""
    x = np.random.default_rng(step).normal(size=(GLOBAL_BATCH, FEATURES))
    mine = x[jax.process_index() * ROWS :][:ROWS].astype(np.float32)
    return mine, mine @ TRUE_W


def global_array(local: np.ndarray) -> jax.Array:
    """One array over every process's devices, from this process's rows of it."""
    shape = (GLOBAL_BATCH, *local.shape[1:])
    return jax.make_array_from_process_local_data(P("data"), local, shape)


@jax.jit
def train_step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """One Adam step on mean squared error."""

    def loss_fn(w):  # w is sharded over the devices, as in FSDP: gather it whole
        return jnp.mean((x @ jax.sharding.reshard(w, P()) - y) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    updates, opt = tx.update(grad, state["opt"], state["w"])
    return {"w": optax.apply_updates(state["w"], updates), "opt": opt}, loss


# A preemption notice: note the signal, and stop at the next step.
notice = {}
for signum in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(signum, lambda s, _: notice.update(signal=signal.Signals(s).name))


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process: the same answer on every process."""
    return bool(multihost_utils.process_allgather(np.int32(flag)).any())


w = jnp.zeros(FEATURES, out_sharding=P("data"))
state = {"w": w, "opt": tx.init(w)}  # Adam's moments are sharded as w is
manager = ocp.CheckpointManager(os.path.abspath(args.checkpoint_dir))
start = manager.latest_step() or 0  # the latest complete checkpoint
if start:  # every process reads its own shards, into the shardings of `state`
    state = manager.restore(start, args=ocp.args.StandardRestore(state))
    if jax.process_index() == 0:
        print(f"resumed from step {start}", flush=True)
for step in range(start, args.steps):
    # A signal may reach one process a step before another: all stop at one step.
    if any_process("signal" in notice):
        manager.save(step, args=ocp.args.StandardSave(state))
        if jax.process_index() == 0:
            print(f"{notice.get('signal', 'a signal elsewhere')}: saved step {step}")
        break  # and exit with status 0: nothing failed
    state, loss = train_step(state, *map(global_array, local_batch(step)))
    loss = float(loss)  # on every process: it waits for the step, so none runs ahead
    if jax.process_index() == 0 and (step + 1) % 5 == 0:
        print(f"step {step + 1}: loss {loss:.9g}", flush=True)
    if (step + 1) % args.save_every == 0:
        # Every process calls save: each writes the shards its devices hold.
        manager.save(step + 1, args=ocp.args.StandardSave(state))
    time.sleep(args.pause)
manager.wait_until_finished()  # Orbax writes in the background
