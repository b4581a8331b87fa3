"""benchmarks/linen_nnx.py: the recipe's NNX block and its Linen twin
(jaxdist_lessons/models/linen_block.py) compile to the same program, here for the tiny
preset and in book/data for 125m; and on the chip the two steps take the same time
(book/data/linen_nnx_tpu_*.json, measured once on a TPU v5e)."""

import json
import pathlib

import pytest
from by_path import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
linen_nnx = load("linen_nnx", "benchmarks/linen_nnx.py")
DATA = ROOT / "book" / "data"


def test_opcodes_counts_each_kind_of_instruction():
    text = """ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %all-gather-start = (f32[4]{0}, f32[8]{0}) all-gather-start(%p), dimensions={0}
  %all-gather-done = f32[8]{0} all-gather-done(%all-gather-start)
  %a = f32[4]{0} add(%p, %p)
  ROOT %b = f32[4]{0} add(%a, %p)
}"""
    assert linen_nnx.opcodes(text) == {
        "add": 2,
        "all-gather-done": 1,
        "all-gather-start": 1,
        "parameter": 1,
    }


def test_both_apis_compile_the_tiny_block_to_one_program():
    programs = linen_nnx.compiled("tiny", batch=8, seq_len=16)
    assert programs["linen"] == programs["nnx"]
    # Sharded by the rules: the weights' gathers and the gradients' reductions are there.
    assert set(programs["nnx"]["collectives"]) >= {"all-gather", "all-reduce"}
    assert programs["nnx"]["temporaries"] > 0


def test_the_books_125m_block_is_one_program_in_both():
    record = json.loads((DATA / "linen_nnx_cpu_125m.json").read_text())
    linen, nnx = record["compiled"]["linen"], record["compiled"]["nnx"]
    assert linen == nnx
    assert linen["collectives"] == {"all-gather": 27_927_552, "all-reduce": 29_893_632}
    assert (linen["arguments"], linen["temporaries"]) == (7_080_960, 39_337_464)
    assert sum(linen["instructions"].values()) == 1349


@pytest.mark.parametrize("preset", ["1b", "8b"])
def test_on_the_chip_nnx_takes_the_time_linen_takes(preset):
    record = json.loads((DATA / f"linen_nnx_tpu_{preset}.json").read_text())
    meta, seconds = record["meta"], record["seconds"]
    assert (meta["device_kind"], meta["jax_version"]) == ("TPU v5 lite", "0.10.2")
    assert (meta["preset"], meta["seq_len"]) == (preset, 2048)
    # The ratio the chapter prints: within half a percent.
    assert 1.0 <= seconds["nnx"] / seconds["linen"] < 1.005
