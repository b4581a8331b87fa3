"""planning.ranking: the rows, their flags (which the recipe takes), their order and
--grad-accum auto."""

import dataclasses
import json
import re

import pytest
from planning_helpers import (
    EXAMPLE,
    assert_the_recipe_takes,
    run_main,
)

from jaxdist_lessons.planning import (
    cli,
    layouts,
    ranking,
)


def test_json_has_the_tables_rows():
    status, printed, _ = run_main(EXAMPLE)
    assert status == 0
    status, as_json, _ = run_main([*EXAMPLE, "--json"])
    assert status == 0
    rows = json.loads(as_json)["rows"]
    lines = printed.splitlines()
    table_rows = lines[3 : 3 + len(rows)]  # title, headers, rule, then one line a row
    assert len(rows) >= 8 and not lines[3 + len(rows)].strip()
    for line, r in zip(table_rows, rows):
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:3] == [r["strategy"], r["mesh"], "yes" if r["fits"] else "no"]
        assert cells[3] == str(r["grad_accum"] or "pipeline")
        assert float(cells[8]) == pytest.approx(
            r["memory_bytes"]["total"] / 1e9, rel=1e-3
        )
        assert cells[-1] == f"{r['mfu']:.1%}"
    strategies = {r["strategy"] for r in rows}
    assert {
        "DP",
        "ZeRO-1",
        "FSDP",
        "HSDP",
        "FSDP+TP",
        "sequence",
        "pipeline 1F1B",
    } <= strategies
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # fitting rows first
    for r in rows:  # each printed flag line is the row's, and the recipe takes it
        assert f"{r['strategy']:<22} {r['flags']}" in printed
        if not r["runnable"]:
            assert r["flags"] == layouts.NEEDS[r["strategy"]]
            continue
        assert_the_recipe_takes(r["flags"])
        assert ("--zero1" in r["flags"]) == (r["strategy"] == "ZeRO-1")
        if "pipeline" in r["strategy"]:  # the recipe's flags for its schedule
            schedule = r["strategy"].split()[1].lower()
            assert f"--schedule {schedule}" in r["flags"], r
            assert "--mesh pipeline=" in r["flags"] and "--grad-accum " in r["flags"]


H100_70B_64 = [
    "--model",
    "70b",
    "--devices",
    "64",
    "--nodes",
    "8",
    "--chip",
    "h100",
    "--seq-len",
    "4096",
]


@pytest.mark.parametrize(
    "request_",
    [
        [*H100_70B_64, "--global-batch", "256"],
        [
            "--model",
            "8b",
            "--devices",
            "16",
            "--nodes",
            "2",
            "--chip",
            "h100",
            "--seq-len",
            "8192",
            "--global-batch",
            "32",
        ],
        [
            "--model",
            "1b",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--devices",
            "8",
            "--chip",
            "a100",
            "--seq-len",
            "2048",
            "--global-batch",
            "32",
        ],
    ],
)
def test_every_ranked_row_has_flags_the_recipe_takes(request_):
    """Pipelines (with their schedule and micro-batches, tensor parallelism inside the
    stages), ZeRO-1, host offload and dropless experts included; the one the recipe does
    not run (ZeRO-2) says what it needs, and ranks after every runnable row that fits."""
    status, as_json, _ = run_main([*request_, "--json"])
    assert status == 0
    rows = json.loads(as_json)["rows"]
    strategies = {r["strategy"] for r in rows}
    assert {
        "pipeline 1F1B",
        "pipeline 1F1B + TP",
        "FSDP + offload",
        "ZeRO-2",
    } <= strategies
    if "--experts" in request_:
        assert "experts dropless" in strategies
    order = [(not r["fits"], not r["runnable"]) for r in rows]
    assert order == sorted(order)
    for r in rows:
        if r["strategy"] == "ZeRO-2":
            assert not r["runnable"] and r["flags"].startswith("needs: ZeRO-2")
            continue
        assert_the_recipe_takes(r["flags"])
        assert ("--offload optimizer,activations" in r["flags"]) == (
            r["strategy"] == "FSDP + offload"
        )
        assert ("--dispatch dropless" in r["flags"]) == ("dropless" in r["strategy"])


def test_grad_accum_auto_takes_each_layouts_fewest_micro_batches_that_fit():
    """8b on 16 H100s, 256 x 8192 a step: FSDP fits with 2 micro-batches, not 1; ZeRO-2
    (gradients split too) needs fewer than ZeRO-1; tensor parallelism inside a pipeline's
    stages waits on its activations' collectives."""
    argv = [
        "--model",
        "8b",
        "--devices",
        "16",
        "--nodes",
        "2",
        "--seq-len",
        "8192",
        "--global-batch",
        "256",
    ]
    rows = {
        (r["strategy"], r["mesh"]): r
        for r in json.loads(run_main([*argv, "--json"])[1])["rows"]
    }
    fsdp = rows[("FSDP", "fsdp=16")]
    assert (
        fsdp["fits"] and fsdp["grad_accum"] == 2 and "--grad-accum 2" in fsdp["flags"]
    )
    run = cli.make_run(cli.parse_args(argv))
    one = dataclasses.replace(run, fit_accum=False)
    assert not ranking.row(one, layouts.Layout.from_flag("fsdp=16", strategy="FSDP"))[
        "fits"
    ]
    zero1, zero2 = rows[("ZeRO-1", "data=16")], rows[("ZeRO-2", "data=16")]
    assert zero2["grad_accum"] < zero1["grad_accum"]
    assert zero2["memory_bytes"]["optimizer"] == zero1["memory_bytes"]["optimizer"]
    assert zero2["memory_bytes"]["gradients"] < zero1["memory_bytes"]["gradients"] / 10
    staged = rows[("pipeline 1F1B + TP", "pipeline=2,fsdp=4,tensor=2")]
    assert (
        staged["seconds"]["exposed"] > 0
        and "--mesh pipeline=2,fsdp=4,tensor=2" in staged["flags"]
    )
    # a pipeline's FSDP waits only for its first gather and last reduction
    pipelined = rows[("pipeline 1F1B", "pipeline=2,fsdp=8")]["seconds"]
    assert 0 < pipelined["exposed"] < pipelined["overlapped"] / 20


def test_the_new_families_are_ranked_rows_and_ties_go_to_fewer_axes():
    """70b on 64 H100s in 8 nodes: data x tensor, HSDP x tensor, context x tensor and
    pipelines of 2 to 16 stages (data or FSDP beside tensor parallelism inside them) are
    rows with flags the recipe takes. Where the predicted steps tie (within 1% of each
    other, in bands over the fastest row's), the row with fewer mesh axes ranks first,
    then the one sending fewer bytes across nodes, then fewer to the host, then the one
    holding less memory."""
    argv = [*H100_70B_64, "--global-batch", "256"]
    rows = json.loads(run_main([*argv, "--json"])[1])["rows"]
    strategies = {r["strategy"] for r in rows}
    assert {
        "DP+TP",
        "HSDP+TP",
        "sequence + TP",
        "pipeline 1F1B + DP+TP",
    } <= strategies
    depths = {
        int(r["mesh"].split(",")[0].split("=")[1])
        for r in rows
        if r["mesh"].startswith("pipeline=")
    }
    assert depths == {2, 4, 8, 16}
    for r in rows:
        if r["runnable"]:
            assert_the_recipe_takes(r["flags"])
    fastest = min(r["step_seconds"] for r in rows if r["fits"] and r["runnable"])
    keys = [ranking.rank(r, fastest) for r in rows]
    assert keys == sorted(keys)
    tied = [(a, b) for a, b in zip(keys, keys[1:]) if a[:3] == b[:3]]
    assert len(tied) > 5  # ties are common: they are broken by what follows
    assert all(a[3:] <= b[3:] for a, b in tied)
    # a band is 1% of the fastest step: the first band's rows are within 1% of it
    first = [r for r, k in zip(rows, keys) if k[:3] == (False, False, 0)]
    assert first and all(r["step_seconds"] < 1.01 * fastest for r in first)
    assert [k[3] for k in keys[: len(first)]] == sorted(
        k[3] for k in keys[: len(first)]
    )


def test_several_tpu_slices_take_only_layouts_whose_data_axis_crosses_them():
    """On 4 v5e slices the recipe puts ``data`` across the slices and every other axis
    inside one (``layout.slices_grid``): FSDP over all 1,024 chips is left out of the
    candidates (XLA:CPU's simulated devices, one host, would still compile it), FSDP in
    each slice with data across them is a row; one slice refuses nothing of the kind."""
    argv = ["--model", "8b", "--chip", "TPU v5e", "--devices", "1024"]
    argv += ["--slices", "4", "--seq-len", "2048", "--global-batch", "1024"]
    run = cli.make_run(cli.parse_args(argv))
    whole = layouts.Layout(fsdp=1024, strategy="FSDP")
    assert layouts.multislice_refusals(run, whole) == [
        "data=1 does not split over the 4 slices: only the data axis crosses slices, "
        "so make it a multiple of 4"
    ]
    offered = layouts.candidates(run)
    assert offered and all(c.data % 4 == 0 for c in offered)
    assert "fsdp=1024" not in {c.mesh_flag for c in offered}
    assert layouts.problems(run, whole) == []  # XLA:CPU's simulated devices run it
    hybrid = layouts.Layout(data=4, fsdp=256, strategy="HSDP")
    assert layouts.multislice_refusals(run, hybrid) == []
    meshes = {r["mesh"] for r in ranking.plan(run)}
    assert "data=4,fsdp=256" in meshes and "fsdp=1024" not in meshes
    assert all(int(m.split("data=")[1].split(",")[0]) % 4 == 0 for m in meshes)
    one = dataclasses.replace(run, nodes=1)
    assert layouts.multislice_refusals(one, whole) == []
    assert "fsdp=1024" in {c.mesh_flag for c in layouts.candidates(one)}
