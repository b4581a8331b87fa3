"""A sharded training script to copy whole: JAX, Flax, Optax, Orbax, sklearn's digits.

One process:      JAX_NUM_CPU_DEVICES=8 python examples/recipe.py
Several (MPI):    JAX_NUM_CPU_DEVICES=4 mpirun -np 2 python examples/recipe.py
On GPUs or TPUs the same file uses the accelerators (leave JAX_NUM_CPU_DEVICES unset).
The environment may set STEPS (default 100) and CHECKPOINT_DIR (default /tmp/recipe).
"""

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

# Sharding rules: the first parameter path (a regex) that matches gives the spec, and
# the rest are replicated. Megatron's MLP split: hidden units over 'tensor', the batch
# over 'data'.
RULES = [
    (r"Dense_0/kernel", P(None, "tensor")),
    (r"Dense_0/bias", P("tensor")),
    (r"Dense_1/kernel", P("tensor", None)),
]


class MLP(nn.Module):
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


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


def spec_for(path, rules=RULES) -> P:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return next((spec for pattern, spec in rules if re.search(pattern, name)), P())


def create_state(mesh, learning_rate: float) -> train_state.TrainState:
    """Parameters and Adam's moments, born sharded: a device holds only its shards."""
    model, tx = MLP(), optax.adam(learning_rate)

    # run under jit with out_shardings, each device makes only its shards
    def init(
        rng,
    ):
        params = model.init(rng, jnp.zeros((1, 64)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    shapes = jax.eval_shape(init, jax.random.key(0))
    specs = jax.tree_util.tree_map_with_path(lambda path, _: spec_for(path), shapes)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    return jax.jit(init, out_shardings=shardings)(jax.random.key(0))


def make_train_step(state, mesh):
    shardings = jax.tree.map(lambda x: x.sharding, state)

    def train_step(state, images, labels):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, images)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, labels
            ).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch, batch),
        out_shardings=(shardings, replicated),
        donate_argnums=0,  # the old state's buffers are reused for the new one
    )


def global_batches(mesh, global_batch: int, steps: int, seed: int = 0):
    """Each process loads only its rows of a batch; JAX assembles the global array."""
    digits = load_digits()
    images, labels = (
        (digits.data / 16.0).astype(np.float32),
        digits.target.astype(np.int32),
    )
    per_process = global_batch // jax.process_count()
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, P("data"))
    for _ in range(steps):
        # the same on every process
        rows = rng.choice(len(images), global_batch, replace=False)
        mine = rows.reshape(jax.process_count(), per_process)[jax.process_index()]
        yield tuple(
            jax.make_array_from_process_local_data(
                sharding, a[mine], (global_batch, *a.shape[1:])
            )
            for a in (images, labels)
        )


def main(steps: int, checkpoint_dir: str) -> None:
    join_processes()
    n = jax.device_count()
    # tensor parallel in pairs where the count allows
    tensor_axis = 2 if n % 2 == 0 else 1
    shape, axes = (n // tensor_axis, tensor_axis), ("data", "tensor")
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto, AxisType.Auto))
    state = create_state(mesh, learning_rate=1e-3)
    train_step = make_train_step(state, mesh)
    batch = 16 * shape[0]  # a multiple of the 'data' axis, hence of the processes
    for step, (images, labels) in enumerate(global_batches(mesh, batch, steps)):
        state, loss = train_step(state, images, labels)
        # on every process: it waits for the step, so none runs ahead
        loss = float(loss)
        if jax.process_index() == 0:
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)

    # Every process writes its own shards; Orbax writes each replicated array once.
    path = os.path.join(os.path.abspath(checkpoint_dir), str(int(state.step)))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state, force=True)
    if jax.process_index() == 0:
        print(f"saved step {int(state.step)} to {path} on a {dict(mesh.shape)} mesh")


if __name__ == "__main__":
    main(
        int(os.environ.get("STEPS", "100")),
        os.environ.get("CHECKPOINT_DIR", "/tmp/recipe"),
    )
