"""benchmarks/tpu_meshes.py's JSON (book/data/tpu_meshes.json): the recipe's step compiled for
a v5e-256 and two v5p-128 slices. Read, not recompiled: each compile takes 10-30 s."""

import json
import math

import pytest
from by_path import ROOT, load

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import checking, ranking

MESHES = json.loads((ROOT / "book" / "data" / "tpu_meshes.json").read_text())
BENCHMARK = load("tpu_meshes", "benchmarks/tpu_meshes.py")


def test_the_json_says_what_compiled_it_and_holds_every_shape():
    meta = MESHES["meta"]
    assert meta["compiler"] == "XLA:CPU's compile of simulated devices"
    assert meta["jax_version"] and meta["date"] and meta["sequences_per_chip"] == 1
    assert [(r["name"], r["mesh"]) for r in MESHES["rows"]] == [
        (s[0], s[7]) for s in BENCHMARK.SHAPES
    ]


@pytest.mark.parametrize(
    "row", MESHES["rows"], ids=lambda r: f"{r['name']} {r['mesh']}"
)
def test_each_mesh_multiplies_to_the_chips_and_fits_their_memory(row):
    chip = hardware.chip(row["chip"])
    sizes = [int(part.split("=")[1]) for part in row["mesh"].split(",")]
    assert math.prod(sizes) == row["chips"]
    # the axis across slices, if any, has as many members as there are slices
    if row["slices"] > 1 and row["mesh"].startswith("data="):
        assert sizes[0] == row["slices"]
    compiled = row["compiled"]
    assert 0 < compiled["total"] < chip.memory_bytes
    assert compiled["total"] >= compiled["arguments"] + compiled["temporaries"] - 1


@pytest.mark.parametrize(
    "row", MESHES["rows"], ids=lambda r: f"{r['name']} {r['mesh']}"
)
def test_the_bytes_by_axis_add_up_and_name_the_mesh_axes(row):
    by_axis, whole = row["compiled"]["by_axis"], row["compiled"]["collectives"]
    assert {k: sum(a.get(k, 0) for a in by_axis.values()) for k in whole} == whole
    names = {part.split("=")[0] for part in row["mesh"].split(",")}
    assert all(set(axis.split("+")) <= names for axis in by_axis)


@pytest.mark.parametrize(
    "row", MESHES["rows"], ids=lambda r: f"{r['name']} {r['mesh']}"
)
def test_the_planner_agrees_with_the_compiled_step_within_1_percent(row):
    """The planner's count of XLA:CPU's arguments and collectives (the ones --check compares)
    for the same flags; its flags are the ones the benchmark compiled. Rerun the benchmark
    if the recipe changed, or look at the planner if it did."""
    shape = next(
        s for s in BENCHMARK.SHAPES if (s[0], s[7]) == (row["name"], row["mesh"])
    )
    _, planned = BENCHMARK.planned(shape)
    assert planned["flags"] == row["flags"] and planned["fits"]
    assert checking.agrees(checking.compare(planned, row["compiled"]), tolerance=0.01)


def test_each_shapes_first_mesh_is_the_planners_first_choice():
    for shape in BENCHMARK.SHAPES[::2]:
        run, _ = BENCHMARK.planned(shape)
        assert ranking.plan(run)[0]["mesh"] == shape[7], shape


@pytest.mark.parametrize(
    "row", MESHES["rows"], ids=lambda r: f"{r['name']} {r['mesh']}"
)
def test_the_tpu_compilers_rows_fit_add_up_or_say_the_recipes_refusal(row):
    """The TPU compiler's compile for each shape's topology (--libtpu): the topology the
    benchmark names for the shape; a program that fits the chip, whose bytes by axis add
    up to its bytes by kind, with the data-center network's sends on `data` alone; or,
    for fsdp over two slices, the recipe's refusal."""
    assert MESHES["meta"]["tpu_compiler"] == BENCHMARK.TPU_COMPILER
    tpu = row["tpu_compiled"]
    assert (tpu["topology"], row["slices"]) == BENCHMARK.TOPOLOGIES[row["name"]]
    if row["slices"] > 1 and not row["mesh"].startswith("data="):
        assert tpu == {
            "topology": tpu["topology"],
            "error": f"--mesh: data=1 does not split over the {row['slices']} slices: "
            f"only the data axis crosses slices, so make it a multiple of "
            f"{row['slices']}",
        }
        return
    assert 0 < tpu["total"] < hardware.chip(row["chip"]).memory_bytes
    assert tpu["attention"] == "splash"
    by_axis, whole = tpu["by_axis"], tpu["collectives"]
    assert {k: sum(a.get(k, 0) for a in by_axis.values()) for k in whole} == whole
    across = {axis for axis, kinds in by_axis.items() if "dcn-all-reduce" in kinds}
    assert across == ({"data"} if row["slices"] > 1 else set())
