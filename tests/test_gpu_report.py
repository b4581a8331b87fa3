"""benchmarks/gpu_report.py: the one-run report for an accelerator machine, checked on the CPU.

The full run needs a GPU or TPU machine; here it runs one chapter and the benchmarks' CPU sizes.
"""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "gpu_report", ROOT / "benchmarks/gpu_report.py"
)
gpu_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_report)


def test_chapters_are_every_notebook_of_the_book_by_default():
    names = [p.stem for p in gpu_report.chapters()]
    notebooks = [
        p for p in (ROOT / "book").glob("*.md") if p.with_suffix(".ipynb").exists()
    ]
    assert names == sorted(p.stem for p in notebooks)
    assert [p.stem for p in gpu_report.chapters(["02_device_mesh"])] == ["02_device_mesh"]


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
