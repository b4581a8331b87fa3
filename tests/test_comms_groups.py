"""comms.replica_group_lists: the device groups of a collective, from every spelling XLA uses."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms
from jaxdist_lessons.mesh import make_mesh


@pytest.mark.parametrize(
    "text, groups",
    [
        ("{{0,1},{2,3}}", [[0, 1], [2, 3]]),
        ("{{0,2,4,6},{1,3,5,7}}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("mesh['a'=2,'b'=2,'c'=2] {'c', 'a'}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
        ("mesh['a'=2,'b'=4] {}", [[0], [1], [2], [3], [4], [5], [6], [7]]),
        # The mesh's devices in another order: an iota ([2,4] transposed, laid out as the 2 x 4 mesh) or a list.
        (
            "mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}",
            [[0, 4, 1, 5], [2, 6, 3, 7]],
        ),
        ("mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'y'}", [[0, 2], [1, 3]]),
    ],
)
def test_every_spelling(text, groups):
    assert comms.replica_group_lists(text) == groups


def test_the_groups_agree_with_group_size():
    for text in [
        "{{0,1},{2,3}}",
        "[4,2]<=[2,4]T(1,0)",
        "mesh['axis_0'=4,'axis_1'=2] {'axis_0'}",
        "mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}",
    ]:
        assert {len(g) for g in comms.replica_group_lists(text)} == {
            comms.group_size(text)
        }, text


def test_empty_groups_mean_every_device():
    assert comms.replica_group_lists("{}", num_devices=4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="pass num_devices"):
        comms.replica_group_lists("{}")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{0,1}",
        "[2,2]<=",
        "mesh['a'=2] {'b'}",
        "mesh['a'=4] {'a':(2)2}",
        "source_target_pairs",
    ],
)
def test_unreadable_groups_are_an_error(text):
    with pytest.raises(ValueError, match="cannot read replica groups"):
        comms.replica_group_lists(text)


@pytest.mark.parametrize("axis", ["data", "model"])
def test_groups_of_a_compiled_psum_are_the_mesh_axis(axis):
    n = jax.device_count()
    if n % 2:
        pytest.skip("needs an even number of devices")
    mesh = make_mesh((n // 2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(
        np.ones((n // 2, 2), np.float32), NamedSharding(mesh, P("data", "model"))
    )
    fn = jax.jit(
        jax.shard_map(
            lambda b: jax.lax.psum(b, axis),
            mesh=mesh,
            in_specs=P("data", "model"),
            out_specs=P("data", "model"),
        )
    )
    [op] = [
        c
        for c in comms.collectives(fn.lower(x).compile().as_text())
        if c.kind == "all-reduce"
    ]
    groups = comms.replica_group_lists(op.replica_groups, num_devices=n)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # Positions in the compiled program are the mesh's device order; along `axis`, one group per row/column.
    position = {int(i): k for k, i in enumerate(ids.flat)}
    expected = ids if axis == "model" else ids.T
    assert sorted(sorted(g) for g in groups) == sorted(
        sorted(position[int(i)] for i in row) for row in expected
    )
