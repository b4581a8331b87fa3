"""benchmarks/tpu_report.py: the one-run report for a TPU chip, checked on the CPU.

The report itself needs a TPU; here, what it reads from the recipe's output, the flags it
gives the recipe, the table it prints, and book/data/tpu_report.json, the run the book shows.
"""

import json
import pathlib

import pytest
from by_path import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
tpu_report = load("tpu_report", "benchmarks/tpu_report.py")
REPORT = json.loads((ROOT / "book" / "data" / "tpu_report.json").read_text())

OUTPUT = """\
step 1 loss 10.9 grad_norm 1.0 tokens/s 1,000 step_time 30000 ms mfu 0.4%
step 2 loss 10.8 grad_norm 1.0 tokens/s 90,000 step_time 364 ms mfu 38.0%
step 3 loss 10.8 grad_norm 1.0 tokens/s 90,000 step_time 364 ms mfu 38.0%
step 4 loss 10.8 grad_norm 0.9 tokens/s 95,000 step_time 345 ms mfu 40.1%
step 5 loss 10.7 grad_norm 0.9 tokens/s 95,100 step_time 344 ms mfu 40.2%
step 6 loss 10.7 grad_norm 0.9 tokens/s 94,900 step_time 346 ms mfu 40.0%
peak memory per device 10.49 GB (of 16.91 GB JAX may use; memory_stats() 2.10 GB, \
the compiled step 10.49 GB)
"""


def test_step_summary_takes_the_medians_after_the_first_steps():
    """The first SKIP steps (compilation, warm-up) are left out of the medians."""
    assert tpu_report.step_summary(OUTPUT) == {
        "tokens_per_second": 95_000.0,
        "step_seconds": 0.345,
        "mfu": pytest.approx(0.401),
        "peak_memory_gb": 10.49,
    }
    assert tpu_report.step_summary("stopped") == {"peak_memory_gb": None}


def test_each_run_is_the_recipes_flags_on_the_one_chip():
    run = dict(zip(tpu_report.KEYS, tpu_report.RUNS[1], strict=True))
    argv = tpu_report.recipe_argv(run, "tokens.npy", "cache")
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    assert flags == {
        "--model": "1b",
        "--mesh": "data=1",
        "--dtype": "bfloat16",
        "--seq-len": "2048",
        "--attention": "splash",
        "--global-batch": "0",
        "--grad-accum": "1",
        "--remat": "full",
        "--offload": "none",
        "--steps": str(tpu_report.STEPS),
        "--moments": "bfloat16",
        "--data": "tokens.npy",
        "--compilation-cache": "cache",
    }


def test_the_books_report_is_one_tpu_v5e_run_with_every_field():
    """What the book shows: the date, the chip and the JAX version; one row a run with
    the fields the issue asks for; the rows that ran have numbers, the others say why."""
    assert REPORT["device_kind"] == "TPU v5 lite" and REPORT["jax_version"] == "0.10.2"
    assert REPORT["seconds"] <= 540  # one run within 9 minutes
    fields = {"model", "seq_len", "attention", "global_batch", "status"}
    measured = {"tokens_per_second", "mfu", "step_seconds", "peak_memory_gb"}
    for row in REPORT["runs"]:
        assert fields <= set(row)
        assert (row["status"] == "ran") == (measured <= set(row)), row
    ran = {(r["model"], r["seq_len"], r["attention"]): r for r in REPORT["runs"]}
    assert ran["125m", 2048, "splash"]["mfu"] >= 0.40
    assert ran["1b", 2048, "splash"]["mfu"] >= 0.45
    assert ran["1b", 2048, "splash"]["global_batch"] == 2  # 90% of the 3 that fit


def test_the_table_has_a_row_a_run(capsys):
    tpu_report.main(["--show", str(ROOT / "book" / "data" / "tpu_report.json")])
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "TPU v5 lite, jax 0.10.2, 2026-12-05"
    assert len(table) == 4 + len(REPORT["runs"])
    assert "| 125m | 2048 | splash | 16 | 1 | 95,035 | 40.1% |" in table[4]
