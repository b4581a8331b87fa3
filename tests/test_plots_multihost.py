"""plots.process_collectives: processes, their devices, and which replica groups cross them."""

import jax
import matplotlib
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, hlo, plots


def psum_groups(m, axis):
    """The replica groups of a compiled psum over ``axis`` of mesh ``m``, as mesh positions."""
    fn = jax.jit(
        jax.shard_map(
            lambda b: jax.lax.psum(b, axis),
            mesh=m,
            in_specs=P(*m.axis_names),
            out_specs=P(*m.axis_names),
        )
    )
    x = jax.device_put(
        np.ones(m.devices.shape, np.float32), NamedSharding(m, P(*m.axis_names))
    )
    [op] = [
        c
        for c in comms.collectives(fn.lower(x).compile().as_text())
        if c.kind == "all-reduce"
    ]
    return hlo.replica_group_lists(op.replica_groups, num_devices=m.size)


def lines_by_colour(ax):
    return [matplotlib.colors.to_hex(line.get_color()) for line in ax.lines]


def test_groups_across_the_process_axis_are_red_and_inside_one_are_green():
    m = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    # As if each row of the mesh belonged to its own process (2 processes x 4 devices).
    owner = np.array([[0, 0, 0, 0], [1, 1, 1, 1]])
    groups = {axis: psum_groups(m, axis) for axis in ("data", "tensor")}
    assert groups == {
        "data": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "tensor": [[0, 1, 2, 3], [4, 5, 6, 7]],
    }
    fig = plots.process_collectives(owner, m.axis_names, groups)
    data_ax, tensor_ax = fig.axes
    red, green = (
        matplotlib.colors.to_hex("tab:red"),
        matplotlib.colors.to_hex("tab:green"),
    )
    assert (
        lines_by_colour(data_ax) == [red] * 4
        and lines_by_colour(tensor_ax) == [green] * 2
    )
    assert (
        data_ax.get_title() == "all-reduce over 'data': 4 of 4 groups cross processes"
    )
    assert (
        tensor_ax.get_title()
        == "all-reduce over 'tensor': 0 of 2 groups cross processes"
    )
    assert sum(t.get_text().startswith("process 1, ") for t in data_ax.texts) == 4
    matplotlib.pyplot.close(fig)


def test_only_2d_meshes():
    with pytest.raises(ValueError, match="draws 2-D meshes"):
        plots.process_collectives(np.zeros(4, int), ("data",), {"data": [[0, 1, 2, 3]]})
