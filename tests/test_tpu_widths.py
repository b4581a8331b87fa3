"""benchmarks/tpu_widths.py: the recipe at four widths on one chip, checked on the CPU.

The runs need a TPU; here, the shapes it gives the recipe (which the recipe accepts), the
table it prints, and book/data/tpu_widths.json, the run the book shows."""

import json
import pathlib

import pytest
from by_path import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
tpu_widths = load("tpu_widths", "benchmarks/tpu_widths.py")
REPORT = json.loads((ROOT / "book" / "data" / "tpu_widths.json").read_text())


def test_each_width_is_a_llama_config_the_recipe_reads():
    from jaxdist_lm import model_config

    for width in tpu_widths.WIDTHS:
        hf = tpu_widths.shape(width)
        path = pathlib.Path(f"/tmp/jaxdist-width-{width}.json")
        path.write_text(json.dumps(hf))
        config = model_config.config_from_hf(str(path))
        assert (config.width, config.num_layers) == (width, 2)
        assert config.head_width == 128 and config.num_kv_heads == config.num_heads
        # SwiGLU at 8/3 of the width, to a multiple of 128
        assert config.mlp_width % 128 == 0
        assert abs(config.mlp_width - 8 * width / 3) <= 64


def test_the_book_shows_one_chips_run_at_every_width(capsys):
    assert REPORT["device_kind"] == "TPU v5 lite" and REPORT["batch"] == 4
    assert [r["width"] for r in REPORT["runs"]] == list(tpu_widths.WIDTHS)
    assert all(r["status"] == "ran" for r in REPORT["runs"])
    for r in REPORT["runs"]:
        assert r["hfu"] == r["mfu"] * tpu_widths.remat_factor(r["width"])
    tpu_widths.show(REPORT)
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "TPU v5 lite, jax 0.10.2, 2026-12-06"
    assert len(table) == 3 + len(tpu_widths.WIDTHS)
    assert table[3] == "| 512 | 1408 | 688,840 | 12 | 57.5% | 64.9% |"


def test_it_refuses_a_machine_without_a_tpu(tmp_path):
    with pytest.raises(SystemExit, match=r"no TPU here \(cpu\): this measures a TPU"):
        tpu_widths.main(["--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_full_remat_runs_the_blocks_forward_again_not_the_heads():
    """The output projection, 6 x vocabulary x width flops a token, has no remat
    around it: the factor is 1 + the blocks' share / 3, below 4/3, nearer it as the
    blocks grow."""
    factors = [tpu_widths.remat_factor(w) for w in tpu_widths.WIDTHS]
    assert factors == sorted(factors) and factors[0] > 1 and factors[-1] < 4 / 3
    assert round(factors[0], 3) == 1.129
