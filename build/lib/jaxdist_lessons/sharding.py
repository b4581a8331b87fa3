"""Where an array's pieces live: shard shapes, bytes per device, and specs for a whole tree.

A ``PartitionSpec`` is positional: entry *i* says which mesh axes split array dimension *i*
(``None``: not split; a tuple of names: split over their product). Mesh axes the spec does
not name hold replicas.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


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
    """The shape of the block each device holds, computed from the spec alone."""
    check_spec(shape, mesh, spec)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(
        size // math.prod(mesh.shape[a] for a in _entry_axes(e))
        for size, e in zip(shape, entries)
    )


def replicas(mesh: Mesh, spec: P) -> int:
    """How many devices hold each block: the product of the mesh axes the spec does not name."""
    named = {a for entry in spec for a in _entry_axes(entry)}
    return math.prod(size for axis, size in mesh.shape.items() if axis not in named)


def expected_bytes_per_device(shape: Sequence[int], dtype: Any, mesh: Mesh, spec: P) -> int:
    """Bytes each device holds for an array of ``shape`` and ``dtype`` sharded by ``spec``."""
    return math.prod(shard_shape(shape, mesh, spec)) * np.dtype(dtype).itemsize


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Bytes each device holds of an array, or of every array in a tree, keyed by device id.

    Read from the arrays' addressable shards, so it is what the devices really hold.
    """
    held: dict[int, int] = {}
    for array in jax.tree.leaves(tree):
        for shard in array.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def shard_shapes(array: jax.Array) -> dict[int, tuple[int, ...]]:
    """The shape of the block each device holds, keyed by device id."""
    return {shard.device.id: tuple(shard.data.shape) for shard in array.addressable_shards}


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


# --- A whole tree, from rules -----------------------------------------------------------------


Rules = Sequence[tuple[str, P]]


def path_name(path: Sequence[Any]) -> str:
    """A tree path as ``'params/conv_init/kernel'``, the string rules match against."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def spec_for(name: str, rules: Rules, default: P | None = P()) -> P:
    """The spec of the first rule whose regular expression matches ``name`` (``re.search``).

    With no match, ``default``; ``default=None`` makes a missing rule an error.
    """
    for pattern, spec in rules:
        if re.search(pattern, name):
            return spec
    if default is None:
        raise ShardingError(f"no rule matches {name!r}; add one, or pass a default spec")
    return default


def specs_from_rules(tree: Any, mesh: Mesh, rules: Rules, default: P | None = P()) -> Any:
    """A tree of ``PartitionSpec``s, one per leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``s).

    Every spec is checked against its leaf's shape and the mesh, so a bad rule fails here,
    with the leaf's path in the message, rather than deep inside ``device_put`` or ``jit``.
    """

    def leaf_spec(path, leaf):
        name = path_name(path)
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
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )
