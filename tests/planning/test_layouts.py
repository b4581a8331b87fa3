"""planning.layouts: one Layout type for the planner and chapter 11_pipelines_mesh_shape's cost model."""

import pytest
from planning_helpers import assert_the_recipe_takes

from jaxdist_lessons.planning import cli, layouts, ranking


def test_a_layout_from_the_recipes_mesh_flag():
    tp = layouts.Layout.from_flag("fsdp=4,tensor=2", strategy="FSDP+TP")
    assert (tp.mesh, tp.devices, tp.batch_ways) == ((1, 4, 1, 1, 2), 8, 4)
    assert tp.mesh_flag == "fsdp=4,tensor=2" and tp.label == "FSDP 4 x tensor 2"
    staged = layouts.Layout(fsdp=4, stages=2, virtual=2, schedule="interleaved")
    assert staged.devices == 8 and staged.mesh_flag == "pipeline=2,fsdp=4"
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


@pytest.mark.parametrize(
    "request_flags",
    [
        ["--model", "tiny", "--seq-len", "128", "--global-batch", "16"],
        ["--model", "tiny", "--seq-len", "96", "--global-batch", "12"],
        ["--model", "125m", "--seq-len", "2048", "--global-batch", "24"],
        ["--model", "8b", "--seq-len", "4096", "--global-batch", "32"],
        ["--model", "tiny", "--experts", "4", "--top-k", "2", "--group-size", "64"]
        + ["--seq-len", "128", "--global-batch", "16"],
    ],
    ids=["tiny", "tiny-12x96", "125m", "8b", "tiny-experts"],
)
def test_the_planner_proposes_no_mesh_the_recipe_refuses(request_flags):
    """The planner's ``problems`` is the recipe's own check (``mesh_spec.refusals``, read
    through the link): on 1 to 8 devices, in one node or two, every layout it keeps
    passes ``layout.check_fits`` with the flags it prints, and every one it drops says why
    in the recipe's words."""
    kept = dropped = 0
    for devices in range(1, 9):
        for nodes in (1, 2) if devices % 2 == 0 else (1,):
            argv = [*request_flags, "--devices", str(devices), "--nodes", str(nodes)]
            run = cli.make_run(cli.parse_args(argv))
            for c in filter(layouts.runnable, layouts.candidates(run)):
                if said := layouts.problems(run, c):
                    dropped += 1
                    assert all(" split" in s or "--grad-accum" in s for s in said), said
                    continue
                kept += 1
                assert_the_recipe_takes(
                    ranking.recipe_flags(ranking.accumulated(run, c), c)
                )
    assert kept and dropped
