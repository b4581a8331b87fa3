"""The exercises of ``book/02_device_mesh.md``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist_lessons.exercises.checking import (
    Exercise,
    Hint,
    _axis,
    _groups,
)


def _mesh_groups(mesh: Any) -> dict[str, list[list[int]]]:
    """For each axis of ``mesh``, the groups of device ids that differ only along it."""
    import numpy as np

    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    groups = {}
    for i, name in enumerate(mesh.axis_names):
        moved = np.moveaxis(ids, i, -1)
        groups[name] = moved.reshape(-1, moved.shape[-1]).tolist()
    return groups


def exercises(ctx: Mapping[str, Any]) -> dict[int, Exercise]:
    mesh = ctx["mesh"]
    groups = _mesh_groups(mesh)
    data_axis, other = mesh.axis_names[0], mesh.axis_names[-1]

    def swapped(a: Any, e: Any) -> bool:
        got = {_axis(k): v for k, v in a.items()}
        return _groups(got[_axis(data_axis)]) == _groups(groups[other]) and len(
            groups[data_axis][0]
        ) != len(groups[other][0])

    def even_mesh(m: Any) -> bool:
        import jax

        ids = [d.id for d in m.devices.flat]
        return sorted(ids) == list(range(0, jax.device_count(), 2))

    return {
        1: Exercise(
            asks="a dict from each axis name to its all-reduce groups, lists of device ids, "
            "e.g. {'data': [[...], ...], 'tensor': [[...], ...]}",
            expected={
                name: Exercise(asks="", expected=g, kind="groups")
                for name, g in groups.items()
            },
            kind="dict",
            why="a group holds the devices whose mesh coordinates differ only along that axis, "
            "which is what XLA writes as the replica groups.",
            hints=(
                Hint(
                    "the groups of the two axes are swapped: a group along an axis walks "
                    "that axis of the device array, with the other coordinates fixed.",
                    swapped,
                ),
            ),
        ),
        2: Exercise(
            asks="a list of groups of device ids, the devices of each group holding the same "
            "block",
            expected=groups[data_axis],
            kind="groups",
            why="the axis the spec does not name holds copies: the groups are those of the "
            f"all-reduce over {data_axis!r}.",
            hints=(
                Hint(
                    "those devices hold different columns of the kernel: the spec splits "
                    f"them over {_axis(other)!r}. Copies lie along the axis it does not name.",
                    lambda a, e: _groups(a) == _groups(groups[other]),
                ),
            ),
        ),
        3: Exercise(
            asks="a Mesh over the even-numbered devices",
            expected=lambda m: hasattr(m, "devices") and even_mesh(m),
            kind="callable",
            why="without devices=, jax.make_mesh takes the first devices of jax.devices(), odd "
            "ones included; devices= says which ones. The shape should use all of them: a "
            "smaller one silently keeps only the first math.prod(shape) of the list.",
            hints=(
                Hint(
                    "your mesh holds odd-numbered devices: without devices=, jax.make_mesh takes "
                    "them from all of jax.devices().",
                    lambda a, e: any(d.id % 2 for d in a.devices.flat),
                ),
                Hint(
                    "some even-numbered devices are missing.",
                    lambda a, e: not even_mesh(a),
                ),
            ),
        ),
    }
