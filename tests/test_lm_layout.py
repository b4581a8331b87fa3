"""jaxdist_lm/layout.py: the recipe's mesh over TPUs of several slices (multislice)."""

import pathlib
import types

import numpy as np
import pytest

from jaxdist_lm import (
    layout,
    mesh_spec,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def chips(slices: int, per_slice: int) -> list:
    """Stand-ins for TPU devices: what the grid reads of one, its id and slice."""
    kind = {"platform": "cpu", "device_kind": "cpu"}
    return [
        types.SimpleNamespace(id=i, slice_index=i // per_slice, **kind)
        for i in range(slices * per_slice)
    ]


def test_data_crosses_the_slices_and_every_other_axis_stays_inside_one():
    sizes = mesh_spec.parse("data=4,fsdp=2,tensor=2", 16)
    grid = layout.slices_grid(sizes, chips(slices=2, per_slice=8))
    assert grid.shape == tuple(sizes[a] for a in mesh_spec.AXES)
    # each device's slice, by data, fsdp, tensor
    slice_of = np.vectorize(lambda d: d.slice_index)(grid).squeeze()
    # data=4 is 2 slices x 2 replicas in each; fsdp and tensor groups never leave a slice
    assert (slice_of == np.array([0, 0, 1, 1])[:, None, None]).all()
    assert sorted(d.id for d in grid.flat) == list(range(16))


def test_a_data_axis_that_the_slices_do_not_divide_is_refused():
    sizes = mesh_spec.parse("data=1,fsdp=8", 8)
    with pytest.raises(SystemExit, match="data=1 does not split over the 2 slices"):
        layout.slices_grid(sizes, chips(slices=2, per_slice=4))
