"""``xdist_group`` keeps its tests on one worker, as tests/conftest.py relies on (SLURM jobs one
at a time, costly module fixtures built once). It stopped doing so, silently, under pytest 9.2
(pytest-xdist issue 1386); requirements.txt pins a pytest where it works."""

import os
import subprocess
import sys

TESTS = """
import os
import pytest

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i, tmp_path_factory):
    with open(os.environ["WORKERS_FILE"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
"""


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_groups.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's options
    workers = tmp_path / "workers.txt"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-q",
            "-p",
            "no:cacheprovider",
            "test_groups.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "WORKERS_FILE": str(workers)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran_on = workers.read_text().split()
    assert len(ran_on) == 6
    assert len(set(ran_on)) == 1, f"the group was split over workers {set(ran_on)}"
