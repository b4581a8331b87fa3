"""benchmarks/gpu_report.py: the one-run report for an accelerator machine, checked on the CPU.

The full run needs a GPU or TPU machine; here it runs one chapter and the benchmarks' CPU sizes.
"""

import pathlib
import sys

import pytest
from by_path import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
gpu_report = load("gpu_report", "benchmarks/gpu_report.py")


def test_chapters_are_every_notebook_of_the_book_by_default():
    names = [p.stem for p in gpu_report.chapters()]
    notebooks = [
        p for p in (ROOT / "book").glob("*.md") if p.with_suffix(".ipynb").exists()
    ]
    assert names == sorted(p.stem for p in notebooks)
    assert [p.stem for p in gpu_report.chapters(["02_device_mesh"])] == [
        "02_device_mesh"
    ]


def test_an_unknown_chapter_is_named_with_the_real_ones():
    with pytest.raises(
        SystemExit, match=r"no chapter \['2_mesh'\]; the chapters are .*02_device_mesh"
    ):
        gpu_report.chapters(["2_mesh"])


def test_run_keeps_the_output_and_reports_failure_and_timeouts(tmp_path):
    log = tmp_path / "log.txt"
    assert gpu_report.run([sys.executable, "-c", "print('hi')"], log, 60)[0]
    assert log.read_text() == "hi\n"
    assert not gpu_report.run([sys.executable, "-c", "raise SystemExit(3)"], log, 60)[0]
    passed, _ = gpu_report.run(
        [sys.executable, "-c", "import time; time.sleep(5)"], log, 0.5
    )
    assert not passed and log.read_text().startswith("timed out after 0.5 s")


def test_lm_summary_takes_the_median_of_the_steps_after_the_first_five():
    lines = [
        f"step {i} loss 3.0 grad_norm 1.0 tokens/s {t:,} step_time {ms} ms mfu {m}%"
        for i, t, ms, m in [
            (5, 10, 999, 1.0),
            (6, 1000, 100, 40.0),
            (7, 3000, 120, 44.0),
            (8, 2000, 110, 42.0),
        ]  # fmt: skip
    ]
    assert gpu_report.lm_summary("\n".join(lines)) == (
        "median of steps 6-8: 2,000 tokens/s, 110 ms/step, MFU 42.0%"
    )
    cpu = "step 9 loss 3.0 grad_norm 1.0 tokens/s 5,000 step_time 20 ms"
    assert gpu_report.lm_summary(cpu).endswith("MFU n/a (no known peak)")
    assert gpu_report.lm_summary("compiling") == "no step after the first 5 finished"


def test_lm_commands_train_on_every_device_with_fsdp():
    commands = gpu_report.lm_commands("python", 8, small=False)
    assert commands["train"][:2] == ["python", "examples/lm/train.py"]
    train = " ".join(commands["train"])
    assert (
        "--model 1b --attention cudnn --mesh fsdp=8 --global-batch 64 --grad-accum 2 "
        "--dtype bfloat16 --steps 40" in train
    )
    assert commands["compile-only"][-1] == "--compile-only"
