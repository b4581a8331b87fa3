"""The hang lab under SLURM: the cases ``srun`` adds to chapter 07_troubleshooting's.

Chapter 07_troubleshooting runs every case of ``jaxdist_lessons.hang_lab`` under ``mpirun`` (all at once, with
JAX's timeouts set short) and checks that each ends within 60 s, with the message that names
its cause, leaving no process behind. The SLURM cases here need a running cluster
(``.ci/slurm-up``): they skip without one, and fail instead under ``JAXDIST_REQUIRE_SLURM=1``,
as ``test_slurm.py`` does.
"""

import json
import pathlib
import subprocess
import sys

from jaxdist_lessons import hang_lab

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT_S = 60


# --- Under SLURM ---------------------------------------------------------------------------

JAXS_SLURM_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


def test_one_task_per_node_drives_only_the_gpu_numbered_by_its_local_id(
    slurm, tmp_path
):
    # jax-ml/jax#16788: with --ntasks-per-node=1, JAX's SLURM detection gives the task
    # local_device_ids=[SLURM_LOCALID] = [0]: on an 8-GPU node it drives GPU 0 alone.
    result = subprocess.run(
        [
            "srun",
            "-n",
            "1",
            "--ntasks-per-node=1",
            sys.executable,
            "-m",
            "jaxdist_lessons.multihost_demo",
            "--devices",
            "2",
            "--out",
            str(tmp_path),
            "hello",
        ],
        cwd=ROOT,
        env=hang_lab.job_environment(),
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    hello = json.loads((tmp_path / "rank0.json").read_text())["hello"]
    assert hello["joined_by"] == "cluster detection"
    assert hello["cuda_visible_devices"] == "0"


def test_an_allocation_without_srun_lacks_the_variables_jax_detects(slurm):
    # jax-ml/jax#30073: salloc (or ssh into an allocated node) sets SLURM_JOB_ID but not the
    # step's variables, so JAX's SLURM detection does not apply and initialize() has no address.
    program = (
        "import os, jax\n"
        f"print('missing:', [v for v in {JAXS_SLURM_VARIABLES} if v not in os.environ], flush=True)\n"
        "jax.distributed.initialize(initialization_timeout=5)\n"
    )
    result = subprocess.run(
        ["salloc", "-n", "2", "--overcommit", sys.executable, "-c", program],
        cwd=ROOT,
        env=hang_lab.job_environment(),
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    assert result.returncode != 0
    assert (
        "missing: ['SLURM_STEP_NODELIST', 'SLURM_PROCID', 'SLURM_LOCALID']"
        in result.stdout
    )
    assert "ValueError: coordinator_address should be defined." in result.stderr
