"""Seconds Orbax takes to save chapter 05_resnet50's train state, with and without replica-parallel writing.

The state is chapter 05_resnet50's on a laptop (ResNet50 at width 1/8 for 16x16 images, with Adam's
moments: 591 arrays, 4.5 MB), replicated over the simulated devices, saved three times by a
``CheckpointManager`` in a fresh process per row:

- ``one replica``: what ``devices.setup()`` registers on simulated devices (Orbax's own default
  when ``JAX_PLATFORMS`` names a GPU platform): one replica writes each replicated array whole;
- ``replica-parallel``: Orbax's default elsewhere: the replicas share the writing of each
  replicated array, each slicing out its part with a program compiled for that shape.

    python benchmarks/orbax_saves.py [--saves 3]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import subprocess
import sys

MODES = ("one replica", "replica-parallel")
SAVE = """
import sys, tempfile, time
from jaxdist_lessons import devices
devices.setup()
import jax, optax
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxdist_lessons import recompiles, train
from jaxdist_lessons.models import resnet

if sys.argv[1] == "replica-parallel":  # Orbax's own default handler on CPU
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(), override=True
    )
model = resnet.ResNet50(num_classes=10, width=0.125)
init = train.init_fn(model, optax.adam(1e-3), (16, 16, 3))
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
replicated = NamedSharding(mesh, P())
shardings = jax.tree.map(lambda _: replicated, jax.eval_shape(init, jax.random.key(0)))
state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
jax.block_until_ready(state)
with (
    recompiles.count_compiles("slice") as slicing,
    ocp.CheckpointManager(tempfile.mkdtemp()) as manager,
):
    for step in range(int(sys.argv[2])):
        start = time.perf_counter()
        manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        print(time.perf_counter() - start)
print("ARRAYS", len(jax.tree.leaves(state)), slicing.compiles)
"""


def seconds_per_save(mode: str, saves: int) -> tuple[list[float], int, int]:
    """Each save's seconds in a fresh process, the number of arrays saved, and the number
    of slicing programs compiled."""
    out = subprocess.run(
        [sys.executable, "-c", SAVE, mode, str(saves)], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"saving with {mode} failed:\n{out.stderr[-3000:]}")
    lines = out.stdout.splitlines()
    _, arrays, slices = lines[-1].split()
    return [float(line) for line in lines[-1 - saves : -1]], int(arrays), int(slices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    versions = {
        name: importlib.metadata.version(name) for name in ("jax", "orbax-checkpoint")
    }
    devices = os.environ.get("JAXDIST_NUM_DEVICES", "8")
    print(
        ", ".join(f"{name} {version}" for name, version in versions.items())
        + f"; {devices} simulated CPU devices, {os.cpu_count()} cores, "
        + f"{datetime.date.today()}"
    )
    rows = {mode: seconds_per_save(mode, args.saves) for mode in MODES}
    arrays = rows[MODES[0]][1]
    print(
        f"| writing ({arrays} arrays) | first save (s) | each later save (s) "
        "| slicing programs compiled |"
    )
    print("|---|---|---|---|")
    for mode, (seconds, _, slices) in rows.items():
        later = sum(seconds[1:]) / max(len(seconds) - 1, 1)
        print(f"| {mode} | {seconds[0]:.2f} | {later:.2f} | {slices} |")


if __name__ == "__main__":
    main()
