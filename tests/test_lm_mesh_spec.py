"""jaxdist_lm/mesh_spec.py: --mesh read the same way by the recipe and the planner."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from jaxdist_lessons.planning import layouts  # noqa: E402
from jaxdist_lm import mesh_spec  # noqa: E402


def test_a_spec_gives_every_axis_a_size_and_minus_one_takes_the_rest():
    assert mesh_spec.parse("fsdp=-1,tensor=2", 8) == {
        "pipeline": 1, "data": 1, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 2,
    }  # fmt: skip  # one axis a pair
    assert mesh_spec.parse("data=2,fsdp=3") == dict(mesh_spec.parse("data=2,fsdp=3", 6))


@pytest.mark.parametrize(
    ("spec", "devices", "says"),
    [
        ("dp=8", 8, "expected axis=size with axes"),
        ("data=0", 8, "an axis of size 0 holds no devices"),
        ("data=-1,fsdp=-1", 8, "does not fit 8 devices"),
        ("data=3", 8, "does not fit 8 devices"),
        ("data=2,tensor=2", 8, "has 4 devices, not the 8 there are"),
        ("fsdp=-1", None, "expected axis=size"),  # -1 needs a device count
    ],
)
def test_a_bad_spec_says_what_is_wrong(spec, devices, says):
    with pytest.raises(ValueError, match=says):
        mesh_spec.parse(spec, devices)


def test_the_planner_reads_the_recipes_spec():
    assert layouts.mesh_sizes("fsdp=4,tensor=2") == {
        "data": 1, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 2,
    }  # fmt: skip  # one axis a pair
    with pytest.raises(layouts.PlanError, match="expected axis=size"):
        layouts.mesh_sizes("pipeline=2,fsdp=4")
