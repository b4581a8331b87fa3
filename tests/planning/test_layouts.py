"""planning.layouts: one Layout type for the planner and chapter 11_pipelines_mesh_shape's cost model."""

import dataclasses

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


def plan_request(flags: str) -> layouts.Run:
    return cli.make_run(cli.parse_args(flags.split()))


H100_70B = "--model 70b --devices 64 --nodes 8 --chip h100 --seq-len 4096"


def test_the_planner_offers_the_layouts_published_runs_use():
    """Megatron's data x tensor, HSDP's replicas across nodes with FSDP and tensor
    inside, context parallelism beside tensor parallelism, and pipelines of every depth
    that divides the devices and the layers (not only the node count), with data
    parallelism or FSDP and tensor parallelism inside the stages: the recipe takes each
    with the flags the planner prints, and ``--check`` leaves alone the ones whose
    XLA:CPU bytes were never compiled."""
    run = plan_request(f"{H100_70B} --global-batch 256")
    offered = {(c.strategy, c.mesh_flag) for c in layouts.candidates(run)}
    wanted = {
        ("DP+TP", "data=32,tensor=2"),
        ("DP+TP", "data=8,tensor=8"),
        ("HSDP+TP", "data=8,fsdp=4,tensor=2"),
        ("HSDP+TP", "data=8,fsdp=2,tensor=4"),
        ("sequence + TP", "fsdp=16,sequence=2,tensor=2"),
        ("sequence + TP", "fsdp=8,sequence=4,tensor=2"),
        ("pipeline 1F1B", "pipeline=2,fsdp=32"),
        ("pipeline 1F1B", "pipeline=16,fsdp=4"),
        ("pipeline 1F1B + TP", "pipeline=4,fsdp=4,tensor=4"),
        ("pipeline 1F1B + DP+TP", "pipeline=8,data=2,tensor=4"),
        ("pipeline 1F1B + DP+TP", "pipeline=16,data=2,tensor=2"),
    }
    assert wanted <= offered, wanted - offered
    # 80 layers: no pipeline of 32 or 64 stages; GPipe and interleaved at the node
    # count's depth only
    depths = {c.stages for c in layouts.candidates(run)}
    assert depths == {1, 2, 4, 8, 16} == {1, *layouts.pipeline_depths(run)}
    schedules = {c.stages for c in layouts.candidates(run) if c.schedule == "GPipe"}
    assert schedules == {8}
    for c in layouts.candidates(run):
        if (c.strategy, c.mesh_flag) in wanted:
            assert not layouts.problems(run, c), c
            flags = ranking.recipe_flags(ranking.accumulated(run, c), c)
            assert_the_recipe_takes(flags)
    # --check compiles only layouts whose XLA:CPU counts were read: FSDP beside tensor,
    # not data or sequence beside it
    one = dataclasses.replace(run, grad_accum=1)
    flag = layouts.Layout.from_flag
    assert layouts.checked(one, flag("fsdp=32,tensor=2", strategy="FSDP+TP"))
    for mesh in (
        "data=32,tensor=2",
        "data=8,fsdp=4,tensor=2",
        "fsdp=16,sequence=2,tensor=2",
    ):
        assert not layouts.checked(one, flag(mesh, strategy="DP+TP")), mesh


def test_tensor_parallelism_of_16_only_where_a_node_holds_16():
    """A TPU v5p slice of 64 chips (one node) offers MaxText's FSDP 4 x TP 16 and its
    replicas across two slices (only data crosses them: FSDP 8 x TP 16 would span
    both); eight-GPU nodes never go past tensor=8."""
    v5p = plan_request(
        "--model 70b --devices 128 --nodes 2 --chip v5p --global-batch 64"
    )
    assert layouts.tensor_sizes(v5p) == [2, 4, 8, 16]
    offered = {c.mesh_flag for c in layouts.candidates(v5p)}
    assert "data=2,fsdp=4,tensor=16" in offered
    assert "fsdp=8,tensor=16" not in offered
    one = plan_request(
        "--model 70b --devices 64 --nodes 1 --chip v5p --global-batch 64"
    )
    assert "fsdp=4,tensor=16" in {c.mesh_flag for c in layouts.candidates(one)}
    gpus = plan_request(f"{H100_70B} --global-batch 256")
    assert max(c.tensor for c in layouts.candidates(gpus)) == 8


def test_the_recipes_refusals_hold_for_the_new_layouts():
    """The recipe refuses a tensor axis that does not split the MLP, and a pipeline
    whose stages do not hold whole layers or that has fewer micro-batches than stages;
    ``problems`` says so in its words and the other sizes stay."""
    run = plan_request(f"{H100_70B} --global-batch 256")
    # 28,676 splits in 4, not 8; 36 layers over 8 nodes
    odd = dataclasses.replace(
        run, shape=dataclasses.replace(run.shape, mlp_width=28_676, num_layers=36)
    )
    said = {
        (c.strategy, c.mesh_flag): layouts.problems(odd, c)
        for c in layouts.candidates(odd)
    }
    assert said[("DP+TP", "data=8,tensor=8")] == [
        "mlp_width 28676 does not split over tensor=8"
    ]
    assert said[("DP+TP", "data=16,tensor=4")] == []
    assert said[("HSDP+TP", "data=8,fsdp=2,tensor=4")] == []
    assert said[("pipeline 1F1B", "pipeline=8,fsdp=8")] == [
        "num_layers 36 does not split over pipeline=8"
    ]
    assert said[("pipeline 1F1B + DP+TP", "pipeline=4,data=8,tensor=2")] == []
    assert {c.stages for c in layouts.candidates(odd)} == {1, 2, 4, 8}
    pipe = layouts.Layout.from_flag(
        "data=16,tensor=2", stages=2, schedule="1F1B", strategy="pipeline 1F1B + DP+TP"
    )
    assert layouts.problems(dataclasses.replace(run, global_batch=32), pipe) == []
    assert layouts.problems(dataclasses.replace(run, global_batch=16), pipe) == [
        "pipeline=2 needs at least 2 micro-batches: set --grad-accum to 2 or more "
        "(more micro-batches, a smaller bubble)"
    ]


def test_the_candidates_stay_few_enough_to_plan_8192_devices_quickly():
    """Every divisor of the devices that divides the layers is a pipeline depth: on
    8,192 devices of 256 a node and 64 layers, still about a hundred layouts."""
    run = plan_request(
        "--model 8b --devices 8192 --nodes 32 --chip v5p --global-batch 8192"
    )
    run = dataclasses.replace(run, shape=dataclasses.replace(run.shape, num_layers=64))
    assert layouts.pipeline_depths(run) == [32, 2, 4, 8, 16, 64]
    assert len(layouts.candidates(run)) < 130
