"""benchmarks/tpu_flags.py's JSON (book/data/tpu_flags.json): the recipe's step compiled by
libtpu under each flag set of the "Running on TPUs" page. Read, not recompiled: it needs
libtpu (requirements-libtpu.txt) and about 3 minutes."""

import json

from by_path import ROOT, load

FLAGS = json.loads((ROOT / "book" / "data" / "tpu_flags.json").read_text())
BENCHMARK = load("tpu_flags", "benchmarks/tpu_flags.py")


def test_each_flag_set_of_the_benchmark_compiled_once_with_its_flags():
    assert FLAGS["meta"]["libtpu_version"] and FLAGS["meta"]["run"] == BENCHMARK.RUN
    assert [(r["name"], r["slices"], r["flags"]) for r in FLAGS["rows"]] == [
        (name, slices, flags) for name, slices, flags in BENCHMARK.CASES
    ]
    for row in FLAGS["rows"]:
        if row["name"] == "a misspelled flag":  # libtpu refuses a flag it does not know
            assert row.keys() == {"name", "slices", "flags", "error"}, row
            continue
        assert "error" not in row, row
        assert len(row["program_sha256"]) == 64
        assert 0 < row["temporaries"] < row["total"]


def test_across_slices_only_the_two_slice_programs_send_over_the_dcn():
    for row in (r for r in FLAGS["rows"] if "error" not in r):
        sends = row["collectives"].get("dcn-all-reduce", 0)
        assert (sends > 0) == ("--slices" in row["slices"]), row["name"]


def test_a_program_without_continuation_fusions_has_fewer_async_starts():
    """The same collectives, each started once, whether or not inside a continuation
    fusion: the bytes by kind do not change, the count of async starts does."""
    rows = {r["name"]: r for r in FLAGS["rows"]}
    on, off = rows["default"], rows["continuation fusion off"]
    assert on["collectives"] == off["collectives"]
    assert off["continuation_fusions"] == 0 < on["continuation_fusions"]
    assert off["async_starts"] < on["async_starts"]
