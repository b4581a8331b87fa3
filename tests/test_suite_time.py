"""benchmarks/suite_time.py: where the suite's time goes, read from the processes' reports.

Its tables come from records every Python process of a run writes at exit; here, the tables
from records written by hand, the stages split at ``.ci/run``'s section lines, and one real
run of a small test module, whose processes must report themselves.
"""

import json
import os
import pathlib
import subprocess
import sys

from by_path import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
suite_time = load("suite_time", "benchmarks/suite_time.py")


def test_stages_run_from_each_section_line_to_the_next():
    lines = [
        (1.0, "installing"),
        (10.0, "== lint: ruff"),
        (12.0, "All checks passed!"),
        (15.0, "== tests: pytest"),
        (100.0, "(exit 0)"),
    ]
    assert suite_time.stages(lines, "install") == [
        ("install", 10.0),
        ("lint: ruff", 5.0),
        ("tests: pytest", 85.0),
    ]


def test_tables_add_up_the_phases_of_each_test_and_the_kinds_of_processes(tmp_path):
    phases = [
        ("tests/test_a.py::test_one", "setup", 1.0, 0.5, ""),
        ("tests/test_a.py::test_one", "call", 2.0, 1.0, ""),
        ("tests/test_a.py::test_two", "call", 0.5, 0.0, ""),
        ("book/01.ipynb::01.ipynb", "call", 7.0, 0.0, "6"),
    ]
    with open(tmp_path / "tests-1.jsonl", "w") as f:
        for nodeid, when, seconds, compiling, devices in phases:
            record = dict(
                nodeid=nodeid,
                when=when,
                seconds=seconds,
                compiling=compiling,
                devices=devices,
            )
            f.write(json.dumps(record) + "\n")
    table = suite_time.test_table(tmp_path, top=2)
    assert table[2:4] == [
        "| 7.0 | 0.0 | `book/01.ipynb::01.ipynb` (6) |",
        "| 3.0 | 1.5 | `tests/test_a.py::test_one` (8) |",
    ]
    assert "| 3.5 | 2 | `tests/test_a.py` (8) |" in table
    assert table[-1] == "| 10.5 | 3 | all, summed over the workers |"

    processes = [
        (["-c"], True, 9.0, 1.0, 2.0),
        (["/v/ipykernel_launcher.py", "-f"], False, 20.0, 3.0, 5.0),
        (["jaxdist_lm/train.py"], False, 4.0, 2.0, 1.0),
        (["examples/train.py"], False, 6.0, 1.0, 0.0),
    ]
    for pid, (argv, in_pytest, seconds, imported, compiled) in enumerate(processes):
        record = dict(
            argv=argv,
            pytest=in_pytest,
            seconds=seconds,
            trace=0.5,
            lower=0.5,
            compile=compiled,
            cached=0.0,
        )
        record["import"] = imported
        record["cpu"] = [4.0, 8.0, 2.0, 4.0][pid]
        (tmp_path / f"process-{pid}.json").write_text(json.dumps(record))
    assert suite_time.kind_table(tmp_path)[2:] == [
        "| 1 | chapter kernels | 20.0 | 8.0 | 3.0 | 0.5 | 0.5 | 5.0 | 0.0 | 11.0 |",
        "| 2 | jobs and other processes | 10.0 | 6.0 | 3.0 | 1.0 | 1.0 | 1.0 | 0.0 "
        "| 4.0 |",
        "| 1 | pytest and its workers | 9.0 | 4.0 | 1.0 | 0.5 | 0.5 | 2.0 | 0.0 | 5.0 |",
    ]
    # The jobs alone, by program, the largest CPU first.
    assert suite_time.job_table(tmp_path)[2:] == [
        "| 1 | `examples/train.py` | 6.0 | 4.0 | 1.0 | 0.0 |",
        "| 1 | `jaxdist_lm/train.py` | 4.0 | 2.0 | 2.0 | 1.0 |",
    ]


def test_a_run_reports_its_tests_and_every_process():
    """suite_time.py over one small module, in one process: the table names each of its
    tests, and pytest's process reported its imports."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    out = subprocess.run(
        [sys.executable, "benchmarks/suite_time.py", "--no-build", "--top", "5"]
        + ["--", "tests/test_versions.py", "-n", "0", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    tests = [line for line in out.splitlines() if "`tests/test_versions.py::" in line]
    assert len(tests) == 3, out
    [row] = [line for line in out.splitlines() if "| pytest and its workers |" in line]
    processes, _, lifetime, importing = row.split("|")[1:5]
    assert int(processes) == 1 and float(importing) > 0, row
