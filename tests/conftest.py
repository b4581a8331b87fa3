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

# Compiled programs are kept in _build/jax_cache, as the chapters keep theirs (devices.setup):
# the tests' subprocesses (mpirun and srun jobs, the LM recipe) read the variable too.
if os.environ.get("JAXDIST_COMPILATION_CACHE", "1") != "0":
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR",
        str(pathlib.Path(__file__).resolve().parents[1] / "_build" / "jax_cache"),
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    # A size limit makes JAX lock the folder: workers, kernels and jobs share it.
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 1024**3))

from jaxdist_lessons import devices  # noqa: E402  (after the cache's folder is set)

DEVICES = devices.setup(num_devices=8)

from jaxdist_lessons import hang_lab, multihost_demo  # noqa: E402  (after the setup)

# Chapters that submit jobs to the one-node SLURM cluster of .ci/slurm-up.
SLURM_CHAPTERS = {"07_troubleshooting.ipynb", "08_multi_host.ipynb"}


def pytest_configure(config):
    """Under pytest-xdist, build the offline digits data set once, here, before the workers
    start: two workers preparing it at once would race on the same directory."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        from jaxdist_lessons import data

        data.digits_source("train")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (-n), what uses the one-node SLURM cluster runs on one worker, one
    job after another: two jobs at once would find the node busy."""
    for item in items:
        if (
            "slurm" in getattr(item, "fixturenames", ())
            or item.path.name in SLURM_CHAPTERS
        ):
            item.add_marker(pytest.mark.xdist_group("slurm"))


def demo_pids() -> set[int]:
    """Process ids of running multihost_demo processes (to check that none is left behind)."""
    return hang_lab.module_pids("jaxdist_lessons.multihost_demo")


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
