"""planning.layouts: one Layout type for the planner and chapter 11_pipelines_mesh_shape's cost model."""

import pytest

from jaxdist_lessons.planning import cli, layouts


def test_a_layout_from_the_recipes_mesh_flag():
    tp = layouts.Layout.from_flag("fsdp=4,tensor=2", strategy="FSDP+TP")
    assert (tp.mesh, tp.devices, tp.batch_ways) == ((1, 4, 1, 1, 2), 8, 4)
    assert tp.mesh_flag == "fsdp=4,tensor=2" and tp.label == "FSDP 4 x tensor 2"
    staged = layouts.Layout(fsdp=4, stages=2, virtual=2, schedule="interleaved")
    assert staged.devices == 8 and staged.mesh_flag == "fsdp=4"
    assert [layouts.Layout(data=8 // t, tensor=t).label for t in (1, 2)] == [
        "(8,1)",
        "(4,2)",
    ]
    with pytest.raises(cli.PlanError, match="mesh 'fsdp=0': expected axis=size"):
        layouts.Layout.from_flag("fsdp=0")
    with pytest.raises(
        ValueError, match="Layout.tensor must be a positive integer, got 0"
    ):
        layouts.Layout(tensor=0)
