"""Device meshes: the shapes N devices allow, and where each device sits in a mesh.

A mesh arranges devices in an n-dimensional grid and names each grid axis. The names are
only labels: ``('data', 'tensor')`` does nothing until a ``PartitionSpec`` uses them.
Our axis names throughout the book (and the LM recipe's): ``data``, ``fsdp``, ``tensor``,
``sequence``, ``expert``, ``pipeline``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdist_lessons._checks import positive_int

# The book's one axis order, the recipe's (jaxdist_lm/mesh_spec.py's AXES): tests/test_mesh.py
# holds the two equal.
AXIS_NAMES = ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")


class MeshError(ValueError):
    """A mesh that cannot be built as asked; the message names the fix."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_names(axis_names: Sequence[str]) -> tuple[str, ...]:
    names = tuple(axis_names)
    if isinstance(axis_names, str):
        raise MeshError(
            f"axis_names must be a sequence of names, not the string {axis_names!r}: "
            f"write ({axis_names!r},)"
        )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise MeshError(
            f"duplicate axis names {duplicates} in {names}: give every mesh axis its own name, "
            f"for example from {AXIS_NAMES}"
        )
    if not names:
        raise MeshError("a mesh needs at least one axis name, for example ('data',)")
    return names


def mesh_shapes(num_devices: int, axis_names: Sequence[str]) -> list[tuple[int, ...]]:
    """Every mesh shape for ``num_devices`` devices and these axis names (sizes of 1 included)."""
    names = _check_names(axis_names)
    try:
        positive_int("num_devices", num_devices)
    except ValueError as err:
        raise MeshError(str(err)) from None
    return [
        shape
        for shape in itertools.product(divisors(num_devices), repeat=len(names))
        if math.prod(shape) == num_devices
    ]


def devices_for_axis(
    size: int, devices: Sequence[jax.Device] | None = None
) -> list[jax.Device]:
    """The most of ``devices`` (default: all) that an axis of ``size`` splits evenly: all of them,
    or all but the remainder (6 of 7 for a ``tensor`` axis of 2). A 2-D mesh on a prime count has
    one axis of 1; chapters use this to show the nearest mesh with both axes above 1 instead.
    """
    positive_int("size", size)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < size:
        raise MeshError(
            f"an axis of {size} needs at least {size} devices, got {len(devices)}"
        )
    return devices[: len(devices) - len(devices) % size]


def mesh_shape(num_devices: int, **sizes: int) -> tuple[int, ...]:
    """Sizes for the named axes, in order, where one size may be ``-1``: "whatever is left".

    ``mesh_shape(8, data=-1, tensor=2)`` is ``(4, 2)``. Chapters use it to adapt to the device count.
    """
    names = _check_names(tuple(sizes))
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise MeshError(f"at most one axis may be -1, got {free}")
    bad = {
        n: s for n, s in sizes.items() if not isinstance(s, int) or (s < 1 and s != -1)
    }
    if bad:
        raise MeshError(f"axis sizes must be positive integers or -1, got {bad}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if num_devices % fixed:
        raise MeshError(
            f"{num_devices} devices cannot be split as {dict(sizes)}: the fixed sizes multiply to {fixed}, "
            f"which does not divide {num_devices}. Choose sizes whose product divides {num_devices} "
            f"(its divisors: {divisors(num_devices)})"
        )
    if not free and fixed != num_devices:
        raise MeshError(
            f"the sizes {dict(sizes)} use {fixed} devices, but there are {num_devices}: make their product "
            f"{num_devices}, or let one axis take the rest with -1"
        )
    return tuple(num_devices // fixed if n in free else sizes[n] for n in names)


def device_coordinates(mesh: Mesh) -> dict[int, dict[str, int]]:
    """Each device id's coordinates in the mesh, by axis name."""
    return {
        int(mesh.devices[index].id): dict(zip(mesh.axis_names, (int(i) for i in index)))
        for index in np.ndindex(mesh.devices.shape)
    }
