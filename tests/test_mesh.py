import math
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxdist_lessons import mesh
from jaxdist_lessons.mesh import MeshError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_mesh_shapes_lists_every_factorisation():
    assert mesh.mesh_shapes(8, ("data", "tensor")) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert mesh.mesh_shapes(8, ("data",)) == [(8,)]
    three = mesh.mesh_shapes(8, ("data", "fsdp", "tensor"))
    assert (
        len(three) == 10
        and all(math.prod(s) == 8 for s in three)
        and len(set(three)) == 10
    )
    assert mesh.mesh_shapes(12, ("data", "tensor")) == [
        (1, 12),
        (2, 6),
        (3, 4),
        (4, 3),
        (6, 2),
        (12, 1),
    ]
    assert mesh.mesh_shapes(7, ("data", "tensor")) == [(1, 7), (7, 1)]


def test_mesh_shape_fills_in_the_free_axis():
    assert mesh.mesh_shape(8, data=-1, tensor=2) == (4, 2)
    assert mesh.mesh_shape(8, tensor=2, data=-1) == (2, 4)
    assert mesh.mesh_shape(2, data=-1, tensor=2) == (1, 2)
    assert mesh.mesh_shape(4, data=4) == (4,)


def test_device_coordinates_agree_with_the_device_grid():
    n = jax.device_count()
    m = jax.make_mesh(
        (n // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    coords = mesh.device_coordinates(m)
    for index in np.ndindex(m.devices.shape):
        assert coords[m.devices[index].id] == {"data": index[0], "tensor": index[1]}


def test_divisors():
    assert mesh.divisors(12) == [1, 2, 3, 4, 6, 12]
    assert mesh.divisors(1) == [1]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: mesh.mesh_shape(8, data=-1, tensor=3),
            "8 devices cannot be split as {'data': -1, 'tensor': 3}: the fixed sizes multiply to 3, which does not "
            "divide 8. Choose sizes whose product divides 8 (its divisors: [1, 2, 4, 8])",
        ),
        (
            lambda: mesh.mesh_shape(8, data=2, tensor=2),
            "the sizes {'data': 2, 'tensor': 2} use 4 devices, but there are 8: make their product 8, or let one "
            "axis take the rest with -1",
        ),
        (
            lambda: mesh.mesh_shape(8, data=-1, tensor=-1),
            "at most one axis may be -1, got ['data', 'tensor']",
        ),
        (
            lambda: mesh.mesh_shape(8, data=0),
            "axis sizes must be positive integers or -1, got {'data': 0}",
        ),
        (
            lambda: mesh.mesh_shapes(4, ("data", "data")),
            "duplicate axis names ['data'] in ('data', 'data'): give every mesh axis its own name, "
            "for example from ('pipeline', 'data', 'fsdp', 'expert', 'sequence', 'tensor')",
        ),
        (
            lambda: mesh.mesh_shapes(8, "data"),
            "axis_names must be a sequence of names, not the string 'data': write ('data',)",
        ),
        (
            lambda: mesh.mesh_shapes(0, ("data",)),
            "num_devices must be a positive integer, got 0",
        ),
    ],
)
def test_bad_input_gets_an_error_naming_the_fix(call, message):
    with pytest.raises(MeshError) as info:
        call()
    assert str(info.value) == message


def test_devices_for_axis_drops_the_remainder_so_the_axis_splits_evenly():
    devices = jax.devices()
    assert mesh.devices_for_axis(2, devices[:7]) == devices[:6]
    assert mesh.devices_for_axis(2, devices[:8]) == devices[:8]
    assert mesh.devices_for_axis(3, devices[:8]) == devices[:6]
    with pytest.raises(MeshError, match="an axis of 2 needs at least 2 devices, got 1"):
        mesh.devices_for_axis(2, devices[:1])


def test_one_axis_order_the_recipes():
    """The package's axis names, the planner's and chapter 09's 3-axis mesh all follow
    jaxdist_lm/mesh_spec.py's AXES."""
    import ast

    from jaxdist_lessons import partitioning
    from jaxdist_lessons.planning import layouts

    layout = ROOT / "jaxdist_lm" / "mesh_spec.py"
    [axes] = [
        ast.literal_eval(node.value)
        for node in ast.parse(layout.read_text()).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "AXES"
    ]
    assert axes == mesh.AXIS_NAMES
    assert tuple(a for a in axes if a != "pipeline") == layouts.AXES
    assert (
        tuple(a for a in axes if a in ("data", "fsdp", "tensor"))
        == partitioning.MESH_AXES
    )
