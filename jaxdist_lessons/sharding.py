"""Where an array's pieces live: shard shapes, bytes per device, specs for a whole tree, batches.

A ``PartitionSpec`` is positional: entry *i* says which mesh axes split array dimension *i*
(``None``: not split; a tuple of names: split over their product). Mesh axes the spec does
not name hold replicas.

A batch is split along its leading axis. ``check_batch_divides`` is the one check that a
global batch splits evenly over the devices (and processes) that share it, which the input
pipeline (``data.batches``) and ``check_batch`` both make; ``pad_batch`` and
``drop_remainder`` are the two fixes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons._checks import positive_int


class ShardingError(ValueError):
    """A spec that does not fit an array or a mesh; the message names the fix."""


# --- One array --------------------------------------------------------------------------------


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def check_spec(shape: Sequence[int], mesh: Mesh, spec: P, name: str = "array") -> None:
    """Raise ``ShardingError`` unless ``spec`` can shard an array of ``shape`` on ``mesh``."""
    shape = tuple(shape)
    if len(spec) > len(shape):
        raise ShardingError(
            f"{name}: spec {spec} has {len(spec)} entries but the array has rank {len(shape)} {shape}: "
            "a spec has at most one entry per array dimension"
        )
    used: list[str] = []
    for dim, entry in enumerate(spec):
        axes = _entry_axes(entry)
        for axis in axes:
            if axis not in mesh.shape:
                raise ShardingError(
                    f"{name}: spec {spec} names axis {axis!r}, which is not in the mesh "
                    f"{dict(mesh.shape)}: use one of {tuple(mesh.axis_names)}"
                )
            if axis in used:
                raise ShardingError(
                    f"{name}: spec {spec} uses mesh axis {axis!r} twice; each mesh axis "
                    "can split at most one array dimension"
                )
            used.append(axis)
        ways = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % ways:
            raise ShardingError(
                f"{name}: dimension {dim} of shape {shape} has size {shape[dim]}, which {ways} devices "
                f"(axes {axes}) cannot split evenly: drop the remainder, pad it to a multiple of {ways}, "
                f"or leave it unsharded (None) in the spec"
            )


def shard_shape(shape: Sequence[int], mesh: Mesh, spec: P) -> tuple[int, ...]:
    """``NamedSharding(mesh, spec).shard_shape(shape)``, after ``check_spec``'s clearer errors.

    Kept for the exercises (``exercises.ch03_sharding``); pages call ``NamedSharding.shard_shape`` themselves.
    """
    check_spec(shape, mesh, spec)
    return NamedSharding(mesh, spec).shard_shape(tuple(shape))


def expected_bytes_per_device(
    shape: Sequence[int], dtype: Any, mesh: Mesh, spec: P
) -> int:
    """Bytes each device holds for an array of ``shape`` and ``dtype`` sharded by ``spec``."""
    check_spec(shape, mesh, spec)
    block = NamedSharding(mesh, spec).shard_shape(tuple(shape))
    return math.prod(block) * np.dtype(dtype).itemsize


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Bytes each device holds of an array, or of every array in a tree, keyed by device id.

    Read from the arrays' addressable shards, so it is what the devices really hold.
    """
    held: dict[int, int] = {}
    for array in jax.tree.leaves(tree):
        for shard in array.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def blocks(
    shape: Sequence[int], sharding: jax.sharding.Sharding
) -> dict[tuple[tuple[int, int], ...], list[int]]:
    """Each distinct block, as ``((start, stop), ...)`` per dimension, with the ids of the devices holding it."""
    held: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        key = tuple(
            (s.start or 0, size if s.stop is None else s.stop)
            for s, size in zip(index, shape)
        )
        held.setdefault(key, []).append(device.id)
    return {key: sorted(ids) for key, ids in sorted(held.items())}


PLACEMENT_HEADERS = [
    "spec",
    "block shape",
    "copies of each block",
    "bytes per device",
    "distinct blocks",
]


def placement_rows(arrays: Iterable[jax.Array]) -> list[list[Any]]:
    """Rows under ``PLACEMENT_HEADERS``, read from arrays placed with ``NamedSharding``s."""
    rows = []
    for array in arrays:
        held = blocks(array.shape, array.sharding)
        rows.append(
            [
                str(array.sharding.spec),
                array.sharding.shard_shape(array.shape),
                max(len(ids) for ids in held.values()),
                max(bytes_per_device(array).values()),
                len(held),
            ]
        )
    return rows


# --- A whole tree, from rules -----------------------------------------------------------------


Rules = Sequence[tuple[str, P]]


def spec_for(name: str, rules: Rules, default: P | None = P()) -> P:
    """The spec of the first rule whose regular expression matches ``name`` (``re.search``).

    With no match, ``default``; ``default=None`` makes a missing rule an error.
    """
    for pattern, spec in rules:
        if re.search(pattern, name):
            return spec
    if default is None:
        raise ShardingError(
            f"no rule matches {name!r}; add one, or pass a default spec"
        )
    return default


def specs_from_rules(
    tree: Any, mesh: Mesh, rules: Rules, default: P | None = P()
) -> Any:
    """A tree of ``PartitionSpec``s, one per leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``s).

    Every spec is checked against its leaf's shape and the mesh, so a bad rule fails here,
    with the leaf's path in the message, rather than deep inside ``device_put`` or ``jit``.
    """

    def leaf_spec(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        spec = spec_for(name, rules, default)
        check_spec(leaf.shape, mesh, spec, name=name)
        return spec

    return jax.tree_util.tree_map_with_path(leaf_spec, tree)


def shardings_from_rules(
    tree: Any, mesh: Mesh, rules: Rules, default: P | None = P()
) -> Any:
    """``specs_from_rules`` turned into ``NamedSharding``s, ready for ``device_put`` or ``jit(out_shardings=...)``."""
    specs = specs_from_rules(tree, mesh, rules, default)
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


# --- A batch over the devices -----------------------------------------------------------------


class BatchError(ShardingError):
    """A batch that cannot be sharded as asked; raised before JAX sees it, and names the fix."""


def check_batch_divides(
    global_batch: int,
    mesh: Mesh,
    axes: str | Sequence[str] | None,
    process_count: int = 1,
    name: str = "global batch",
) -> int:
    """Raise ``BatchError`` unless ``global_batch`` splits evenly over the devices of mesh ``axes``
    (a name, names, or a spec's entry) and over ``process_count`` processes; the devices it splits over.
    """
    positive_int("global_batch", global_batch)
    for axis in _entry_axes(axes):
        if axis not in mesh.shape:
            raise ShardingError(
                f"mesh {dict(mesh.shape)} has no axis {axis!r} to shard the batch over"
            )
    ways = math.prod(mesh.shape[a] for a in _entry_axes(axes))
    multiple = math.lcm(ways, process_count)
    if global_batch % multiple:
        down, up = (
            global_batch // multiple * multiple,
            -(-global_batch // multiple) * multiple,
        )
        processes = f" and the {process_count} processes" if process_count > 1 else ""
        fixes = f"pad it to {up} and mask the padding (sharding.pad_batch)"
        if down:
            fixes += (
                f", or drop the remainder to {down} (sharding.drop_remainder, or "
                "drop_remainder=True in the input pipeline)"
            )
        raise BatchError(
            f"{name}: a batch of {global_batch} does not split over the {ways} devices of mesh "
            f"axes {axes!r} (mesh {dict(mesh.shape)}){processes}. Fix: {fixes}"
        )
    return ways


def _name(path: Any) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "batch"


def batch_size(batch: Any) -> int:
    """The leading (batch) size that every array of ``batch`` shares; ``BatchError`` if they differ or there are none."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise BatchError("the batch has no arrays in it")
    sizes = {
        _name(path): np.shape(leaf)[0] if np.ndim(leaf) else None
        for path, leaf in leaves
    }
    scalars = [name for name, size in sizes.items() if size is None]
    if scalars:
        raise BatchError(
            f"every array of a batch needs a leading (batch) axis; {', '.join(scalars)} "
            f"{'is a scalar' if len(scalars) == 1 else 'are scalars'}"
        )
    if len(set(sizes.values())) > 1:
        raise BatchError(
            f"the arrays of a batch must share their leading (batch) size, got {sizes}"
        )
    return next(iter(sizes.values()))


def check_batch(batch: Any, mesh: Mesh, spec: P) -> None:
    """Raise ``BatchError`` unless every array in ``batch`` can be sharded with ``spec``
    on ``mesh``.

    Every leaf must share one leading (batch) size (``batch_size``), and the mesh axes
    in ``spec[0]`` must divide it (``check_batch_divides``). Other problems (an axis
    name not in the mesh, a spec longer than an array's rank) raise ``ShardingError``
    naming the leaf.
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if len(spec):  # a replicated batch (P()) may hold scalars
        size = batch_size(batch)
        if all(axis in mesh.shape for axis in _entry_axes(spec[0])):
            first = _name(leaves[0][0])
            check_batch_divides(size, mesh, spec[0], name=first)
    for path, leaf in leaves:
        check_spec(np.shape(leaf), mesh, spec, name=_name(path))


def pad_batch(batch: Any, multiple: int) -> tuple[Any, np.ndarray]:
    """Pad every array's leading axis with zeros to a multiple of ``multiple``; return it and a 0/1 mask.

    Weight the loss by the mask so that the padded examples count for nothing. Every array must
    share one leading size (``BatchError`` otherwise).
    """
    positive_int("multiple", multiple)
    size = batch_size(batch)
    padded = -(-size // multiple) * multiple
    pad = lambda x: np.concatenate(
        [
            np.asarray(x),
            np.zeros((padded - size, *np.shape(x)[1:]), np.asarray(x).dtype),
        ]
    )
    mask = (np.arange(padded) < size).astype(np.float32)
    return jax.tree.map(pad, batch), mask


def drop_remainder(batch: Any, multiple: int) -> Any:
    """Keep the largest leading slice of every array whose size is a multiple of ``multiple``."""
    positive_int("multiple", multiple)
    size = batch_size(batch)
    if size < multiple:
        raise BatchError(
            f"a batch of {size} has no full slice of {multiple}: nothing would be left"
        )
    return jax.tree.map(lambda x: x[: size // multiple * multiple], batch)
