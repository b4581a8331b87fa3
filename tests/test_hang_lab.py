"""The hang lab: each way a multi-process job hangs, run once under ``mpirun`` (and ``srun``), ended in seconds.

Every case of ``jaxdist_lessons.hang_lab`` starts at once (they are independent), with JAX's
timeouts set short; each must end within 60 s, with a message that names the cause, leaving
no process behind. The SLURM cases need a running cluster (``.ci/slurm-up``): they skip without
one, and fail instead under ``JAXDIST_REQUIRE_SLURM=1``, as ``test_slurm.py`` does.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from jaxdist_lessons import hang_lab
from jaxdist_lessons.hang_lab import ROOT_OK

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT_S = 60


def clean_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "SLURM_"))
    }
    return {
        **env,
        **ROOT_OK,
        "PATH": f"{os.path.dirname(sys.executable)}:{env['PATH']}",
    }


@pytest.fixture(scope="module")
def lab():
    """Every case at once: the outcomes, the seconds for all, and the processes left behind."""
    before, start = hang_lab.case_pids(), time.monotonic()
    outcomes = hang_lab.run_cases(limit_s=LIMIT_S)
    time.sleep(1)  # mpirun's last kills
    yield outcomes, time.monotonic() - start, hang_lab.case_pids() - before


def test_every_case_ends_within_the_limit_and_leaves_nothing_behind(lab):
    outcomes, total, left = lab
    for case, o in outcomes.items():
        assert o.returncode != 0 and o.seconds < LIMIT_S, (
            case,
            o.returncode,
            o.output[-2000:],
        )
        assert o.message is not None, (case, o.output[-3000:])
    assert total < LIMIT_S + 2 and not left


def test_a_live_stuck_process_is_named_by_the_watchdog_with_every_stack(lab):
    status, output = lab[0]["sleep"].returncode, lab[0]["sleep"].output
    assert status == 124  # the watchdog's exit status, passed on by mpirun
    assert (
        "watchdog: process 1 did not reach step 2 within 3 s (process 1 at step 1); "
        "processes 0 wait at step 2"
    ) in output
    assert (
        "process 1's Python stacks:" in output
        and "process 0's Python stacks:" in output
    )
    assert 'hang_lab.py", line' in output and "in main" in output


def test_a_stopped_process_is_caught_by_jaxs_heartbeat(lab):
    output = lab[0]["stop"].output
    assert (
        "The following tasks are unhealthy (stopped sending heartbeats):\n1\n" in output
    )


@pytest.mark.parametrize("case", ["order", "shape"])
def test_collectives_that_differ_between_processes_fail_in_gloo(lab, case):
    output = lab[0][case].output
    assert (
        "Received data size doesn't match expected size. Is there a distributed collective "
        "mismatch in your code?"
    ) in output


@pytest.mark.parametrize("case", ["unreachable", "partial"])
def test_a_process_that_cannot_join_times_out_in_register_task(lab, case):
    output = lab[0][case].output
    assert "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded" in output
    assert "RPC: /xla.coordination.CoordinationService/RegisterTask" in output
    assert "step 0" not in output  # no process got past initialize()


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
        ["srun", "-n", "1", "--ntasks-per-node=1", sys.executable, "-m", "jaxdist_lessons.multihost_demo",
         "--devices", "2", "--out", str(tmp_path), "hello"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=LIMIT_S,
    )  # fmt: skip
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
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=LIMIT_S,
    )  # fmt: skip
    assert result.returncode != 0
    assert (
        "missing: ['SLURM_STEP_NODELIST', 'SLURM_PROCID', 'SLURM_LOCALID']"
        in result.stdout
    )
    assert "ValueError: coordinator_address should be defined." in result.stderr
