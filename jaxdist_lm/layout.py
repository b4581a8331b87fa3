"""Where each array lives: the mesh, the check that the run splits over it (with
mesh_spec.py's rules and arithmetic), and ring attention's token order."""

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from . import mesh_spec, model_config
from .mesh_spec import AXES, BATCH, RULES
from .run_config import RunConfig


def make_mesh(spec: str, devices=None) -> jax.sharding.Mesh:
    """'data=2,tensor=2' -> a mesh over all of AXES (-1: the rest; unnamed: 1), over
    ``devices``, by default all of this job's."""
    devices = jax.devices() if devices is None else devices
    try:
        sizes = mesh_spec.parse(spec, len(devices))
    except ValueError as error:
        raise SystemExit(str(error)) from None
    shape = tuple(sizes[a] for a in AXES)
    axis_types = (AxisType.Auto,) * len(AXES)
    # Several TPU slices: jax.make_mesh refuses multi-slice topologies.
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        grid = slices_grid(sizes, devices)
        return jax.sharding.Mesh(grid, AXES, axis_types=axis_types)
    return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)


def slices_grid(sizes: dict[str, int], devices) -> np.ndarray:
    """The devices of several TPU slices as a grid over AXES: `data` across the slices
    (one gradient reduction a step over their network), every other axis inside one."""
    slices = len({d.slice_index for d in devices})
    if said := mesh_spec.slices_refusal(sizes, slices):
        raise SystemExit(f"--mesh: {said}")
    inside = [sizes[a] // slices if a == "data" else sizes[a] for a in AXES]
    across = [slices if a == "data" else 1 for a in AXES]
    return mesh_utils.create_hybrid_device_mesh(inside, across, devices)


def check_fits(config: model_config.ModelConfig, mesh, run: RunConfig) -> None:
    """Stop in one line on what the mesh does not split evenly, with the nearest meshes
    that do; JAX would raise for a weight and pad an activation."""
    if said := mesh_spec.stop_line(config, dict(mesh.shape), run):
        raise SystemExit(said)


def without(axis: str, rules=RULES) -> tuple:
    """The rules with one mesh axis taken out: inside a shard_map that makes ``axis``
    manual, layouts may name only the other axes."""
    drop = lambda axes: (
        tuple(a for a in axes if a != axis)
        if isinstance(axes, tuple)
        else (None if axes == axis else axes)
    )
    return tuple((name, drop(axes)) for name, axes in rules)


def zigzag(seq_len: int, num_devices: int) -> np.ndarray:
    """Token positions in the order that balances causal attention over a ring of
    devices: of 2n chunks, device i takes chunks i and 2n-1-i."""
    if seq_len % (2 * num_devices):
        raise ValueError(
            f"sequence length {seq_len} must divide into 2 x {num_devices} chunks"
        )
    chunks = np.arange(seq_len).reshape(2 * num_devices, -1)
    return np.concatenate(
        [chunks[[i, 2 * num_devices - 1 - i]].ravel() for i in range(num_devices)]
    )


def process_rows(mesh, global_batch: int, seq_len: int) -> slice:
    """The rows of each global batch that this process's devices hold."""
    sharding = NamedSharding(mesh, P(BATCH))
    index = sharding.addressable_devices_indices_map(
        (global_batch, seq_len + 1)
    ).values()
    starts = [i[0].start or 0 for i in index]
    stops = [global_batch if i[0].stop is None else i[0].stop for i in index]
    rows = slice(min(starts), max(stops))
    block = rows.stop - rows.start
    # Otherwise processes would share rows.
    if global_batch % block or rows.start % block:
        per_process = jax.local_device_count()
        spec = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1)
        raise SystemExit(
            f"--mesh {spec}: a batch row's devices span several processes "
            f"({per_process} devices each); make the axes after the batch axes "
            f"(sequence x tensor) divide {per_process}"
        )
    return rows
