"""The package tests run on 8 simulated CPU devices, chosen before anything else touches JAX.

Always 8, whatever ``JAXDIST_NUM_DEVICES`` says (that variable sets the notebooks' count): a test
that needs another count, 1 or a count that is not a power of two, builds its mesh over a subset
of the 8.

``pytest`` runs on every core (pytest-xdist, ``-n auto`` in pyproject.toml); ``-n 0`` runs in one
process.
"""

import os
import pathlib

import pytest

from jaxdist_lessons import devices  # after ../conftest.py set the cache and flags

DEVICES = devices.setup(num_devices=8)

from jaxdist_lessons import multihost_demo  # noqa: E402  (after the setup)


def pytest_configure(config):
    """Under pytest-xdist, build the offline digits data set once, here, before the workers
    start: two workers preparing it at once would race on the same directory."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        from jaxdist_lessons import data

        data.digits_source("train")


# Modules whose module-scoped fixtures run jobs or whole pages: under pytest-xdist each worker
# that took one of their tests would build the fixture again, so each runs on one worker.
ONE_WORKER_MODULES = {
    "test_lm_recipe.py",  # trains the recipe on every mesh
    "test_multihost.py",  # compiles a job's layouts
    "test_multihost_demo.py",  # the single-process reference run
    "test_colab.py",  # builds the wheel and a venv
}


def pytest_itemcollected(item):
    """Under pytest-xdist (-n), what uses the one-node SLURM cluster runs on one worker, one
    job after another: two jobs at once would find the node busy (book/conftest.py groups
    the chapters that submit jobs). What uses libtpu runs on one worker too: libtpu takes
    its lock file even to compile. The modules above each run on one worker too. Marked
    here, as each test is collected: pytest-xdist reads the groups before
    ``pytest_collection_modifyitems`` hooks of conftest files run."""
    if "slurm" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group("slurm"))
    elif "libtpu" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group("libtpu"))
    elif item.path.name in ONE_WORKER_MODULES:
        item.add_marker(pytest.mark.xdist_group(item.path.name))


def pytest_collection_modifyitems(config, items):
    """The chapters, the longest items, start first, so that no worker is left finishing
    one alone at the end (pytest-xdist sends the groups first, the largest first)."""
    # A stable sort: the chapters keep their order, and so do the tests.
    items.sort(key=lambda item: item.path.suffix != ".ipynb")


@pytest.fixture(scope="session")
def libtpu() -> pathlib.Path:
    """The folder holding libtpu, the TPU compiler (requirements-libtpu.txt), that
    JAXDIST_LIBTPU names, for a subprocess's PYTHONPATH: skip a test without one, or fail
    it under JAXDIST_REQUIRE_LIBTPU=1."""
    root = pathlib.Path(__file__).resolve().parents[1]
    folder = pathlib.Path(
        os.environ.get("JAXDIST_LIBTPU") or root / ".libtpu"
    ).resolve()
    if (folder / "libtpu").is_dir():
        return folder
    reason = (
        f"no libtpu in {folder}: pip install --target {folder} -r "
        f"requirements-libtpu.txt, and JAXDIST_LIBTPU={folder}"
    )
    if os.environ.get("JAXDIST_REQUIRE_LIBTPU") == "1":
        pytest.fail(f"JAXDIST_REQUIRE_LIBTPU=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def slurm():
    """Skip a test that needs an idle SLURM node, or fail it under JAXDIST_REQUIRE_SLURM=1."""
    reason = multihost_demo.slurm_unavailable()
    if reason and os.environ.get("JAXDIST_REQUIRE_SLURM") == "1":
        pytest.fail(
            f"JAXDIST_REQUIRE_SLURM=1 but {reason}; start one with .ci/slurm-up"
        )
    if reason:
        pytest.skip(reason)
