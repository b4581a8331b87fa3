"""planning.footprint: activations under each remat, and micro-batches."""

import dataclasses
import json

import pytest
from planning_helpers import (
    GPU_8B,
    assert_the_recipe_takes,
    fsdp_run,
    run_main,
)

from jaxdist_lessons.planning import (
    footprint,
    layouts,
    timing,
)


def test_remat_trades_memory_for_flops_and_grad_accum_memory_for_nothing():
    run, fsdp = fsdp_run(GPU_8B)
    by = {r: dataclasses.replace(run, remat=r) for r in ("none", "dots", "full")}
    kept = [footprint.activation_bytes(by[r], fsdp) for r in ("none", "dots", "full")]
    assert kept == sorted(kept, reverse=True) and kept[0] > 3 * kept[2]
    flops = [timing.remat_flops(by[r]) for r in ("none", "dots", "full")]
    assert flops[0] == 1 < flops[1] < flops[2] == 4 / 3
    thirds = dataclasses.replace(run, grad_accum=3)
    assert layouts.problems(thirds, fsdp) == [
        "--global-batch 16 does not split into --grad-accum 3 micro-batches"
    ]
    halves = dataclasses.replace(run, grad_accum=2)
    assert footprint.activation_bytes(halves, fsdp) == pytest.approx(kept[2] / 2)
    assert (
        timing.step_seconds(halves, fsdp)["compute"]
        == timing.step_seconds(run, fsdp)["compute"]
    )
    status, as_json, _ = run_main(
        [*GPU_8B, "--remat", "dots", "--grad-accum", "2", "--json"]
    )
    for r in filter(lambda r: r["runnable"], json.loads(as_json)["rows"]):
        assert_the_recipe_takes(r["flags"])
        assert "--remat dots" in r["flags"] and r["strategy"] != "FSDP + offload"
        assert ("--grad-accum 2" in r["flags"]) == ("pipeline" not in r["strategy"])
        assert r["tokens_per_second_per_device"] == pytest.approx(
            16 * 4096 / r["step_seconds"] / 8
        )
        assert sum(
            v for k, v in r["memory_gb"].items() if k != "total"
        ) == pytest.approx(r["memory_gb"]["total"])
