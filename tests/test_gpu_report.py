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
    assert gpu_report.run([sys.executable, "-c", "print('hi')"], log, 0) == (False, 0)
    assert log.read_text() == "not run: the budget was spent\n"


TRAIN_LOG = """\
step 5 loss 3.1 grad_norm 1.0 tokens/s 10 step_time 999 ms mfu 1.0%
step 6 loss 3.0 grad_norm 1.0 tokens/s 36,000 step_time 455 ms mfu 29.9%
step 7 loss 3.0 grad_norm 1.0 tokens/s 37,000 step_time 443 ms mfu 30.8%
step 8 loss 2.9 grad_norm 1.0 tokens/s 35,000 step_time 468 ms mfu 29.1%
peak memory per device 31.40 GB (of 127.00 GB JAX may use)
"""


def test_step_summary_takes_the_median_after_the_first_five_and_the_peak():
    assert gpu_report.step_summary(TRAIN_LOG) == {
        "steps": [6, 8],
        "tokens_per_second": 36_000,
        "step_ms": 455,
        "mfu": pytest.approx(0.299),
        "peak_memory_gb": 31.4,
    }
    cpu = "step 9 loss 3.0 grad_norm 1.0 tokens/s 5,000 step_time 20 ms"
    assert gpu_report.step_summary(cpu)["mfu"] is None  # no known peak
    assert gpu_report.step_summary(cpu)["peak_memory_gb"] is None
    assert gpu_report.step_summary("compiling") is None


def test_compiled_memory_reads_the_compile_only_line():
    line = (
        "per device: arguments 14.830 GB, temporaries 11.402 GB, total 26.232 GB\n"
        "collectives per device and step:\n"
        "  all-gather                 42,281,984 B"
    )
    assert gpu_report.compiled_memory(line) == {
        "arguments_gb": 14.83,
        "temporaries_gb": 11.402,
        "total_gb": 26.232,
    }
    assert gpu_report.compiled_memory("Traceback") is None


def test_the_planners_pick_is_its_first_row_that_fits_and_runs():
    rows = [
        {"mesh": "data=8", "fits": False, "runnable": True},
        {"mesh": "data=2,fsdp=4", "fits": True, "runnable": False},
        {"mesh": "fsdp=8", "fits": True, "runnable": True},
        {"mesh": "data=8", "fits": True, "runnable": True},
    ]
    assert gpu_report.chosen_row({"rows": rows})["mesh"] == "fsdp=8"
    with pytest.raises(ValueError, match="no layout that fits"):
        gpu_report.chosen_row({"rows": rows[:2]})


def test_the_commands_run_the_planners_flags_with_cudnn_and_a_profile(tmp_path):
    plan = gpu_report.plan_command("python", 8, "H200 141GB", small=False)
    assert " ".join(plan[1:]) == (
        "-m jaxdist_lessons.planning --model 1b --seq-len 2048 --devices 8 "
        "--chip H200 141GB --global-batch 64 --dtype bfloat16 --grad-accum 2 --json"
    )
    flags = "--model 1b --mesh fsdp=8 --seq-len 2048 --global-batch 64"
    gpu = gpu_report.recipe_commands("python", flags, False, tmp_path / "t")
    assert gpu["compile-only"] == [
        *("python", "-m", "jaxdist_lm.train"),
        *flags.split(),
        "--attention",
        "cudnn",
        "--compile-only",
    ]
    assert gpu["train"][-4:] == ["--steps", "30", "--profile", str(tmp_path / "t")]
    small = gpu_report.recipe_commands("python", flags, True, tmp_path / "t")
    assert "--num-devices" in small["train"] and "cudnn" not in small["train"]
    assert gpu_report.chip_name("NVIDIA H200") == "H200 141GB"
    assert gpu_report.chip_name("NVIDIA H100 NVL") == "h100"  # not in the table


def test_the_report_compares_and_shows_what_it_measured():
    report = {
        "date": "2026-12-03 20:00 UTC",
        "machine": {
            "devices": 1,
            "device_kind": "NVIDIA H200",
            "platform": "gpu",
            "jax": "0.10.2",
        },
        "parts": {
            "train": {
                "command": "-m jaxdist_lm.train",
                "passed": True,
                "seconds": 61.0,
            }
        },
        "bandwidth": {"host-to-device": {"size": 2**30, "busbw_gbps": 52.5}},
        "plan": {
            "strategy": "DP",
            "mesh": "data=1",
            "step_ms": 442.8,
            "tokens_per_second": 37_000.0,
            "mfu": 0.3075,
            "memory_gb": 27.55,
        },
        "compile_only": {"total_gb": 26.232},
        "train": gpu_report.step_summary(TRAIN_LOG),
        "attribution": {
            "compute": {"ms": 1200.0, "exposed_ms": 0.0, "collectives": {}}
        },
    }
    report["ratios"] = gpu_report.comparisons(report)
    assert report["ratios"] == {
        "step time, measured / planner": 455 / 442.8,
        "peak memory / compile-only total": 31.4 / 26.232,
        "compile-only total / planner": 26.232 / 27.55,
    }
    text = gpu_report.markdown(report)
    assert "| 1 x NVIDIA H200" not in text  # the heading is a heading
    assert text.startswith("# 1 x NVIDIA H200 (gpu), jax 0.10.2, 2026-12-03 20:00 UTC")
    for row in (
        "| train | yes | 61 | `-m jaxdist_lm.train` |",
        "| host-to-device | 1,073,741,824 | 52.5 |",
        "| step time (ms) | 443 | 455 |",
        "| MFU | 30.8% | 29.9% |",
        "| memory per device (GB) | 27.55 | 31.40 peak, 26.23 compile-only |",
        "- step time, measured / planner: 1.03",
        "| compute | 1200.0 | 0.0 |  |",
    ):
        assert row in text.splitlines(), row
    no_train = {**report, "train": None, "ratios": {}}
    assert "| step time (ms) | 443 | n/a |" in gpu_report.markdown(no_train)


def test_without_an_accelerator_it_says_what_it_would_run(capsys, tmp_path):
    assert gpu_report.main(["--out", str(tmp_path)]) is None
    said = capsys.readouterr().out
    assert said.startswith("No accelerator here (") and "nothing measured" in said
    assert "python -m jaxdist_lm.train FLAGS --attention cudnn --steps 30" in said
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_parts_json_is_read_before_its_warnings():
    text = '{"rows": [1, 2]}\nW1203 xla_bridge.cc: a warning {with braces}\n'
    assert gpu_report.first_json(text) == {"rows": [1, 2]}
