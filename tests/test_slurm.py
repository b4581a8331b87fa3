"""Multi-process JAX on a real one-node SLURM cluster (started by ``.ci/slurm-up``).

``srun`` starts the processes and JAX's own SLURM detection joins them, with no arguments to
``initialize``; ``--kill-on-bad-exit=1`` ends a job whose task failed, leaving nothing behind;
chapter 08_multi_host's batch script (``examples/slurm/train.sbatch``) runs through ``sbatch``.

Without SLURM these tests skip, saying why; with ``JAXDIST_REQUIRE_SLURM=1`` (as CI sets) they
fail instead, so a CI run cannot pass by skipping them.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxdist_lessons import hang_lab

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = os.path.dirname(sys.executable)
DEMO = "jaxdist_lessons.multihost_demo"  # its processes: a job leaves none behind


pytestmark = pytest.mark.usefixtures("slurm")  # the fixture of conftest.py


def srun(*args, timeout=180):
    """``args`` from the repository root, with this environment's Python first on PATH."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_"))
    }
    env["PATH"] = f"{BIN}:{env['PATH']}"
    return subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_srun_joins_three_processes_through_jaxs_slurm_detection(tmp_path):
    result = srun(
        "srun",
        "--overcommit",
        "-n",
        "3",
        "python",
        "-m",
        "jaxdist_lessons.multihost_demo",
        "--devices",
        "2",
        "--out",
        str(tmp_path),
        "hello",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(3):
        hello = json.loads((tmp_path / f"rank{rank}.json").read_text())["hello"]
        # No arguments and no MPI: JAX read SLURM_PROCID, SLURM_NTASKS and the node list.
        assert hello["joined_by"] == "cluster detection"
        assert hello["environment"]["SLURM_PROCID"] == str(rank)
        assert (hello["process_index"], hello["process_count"]) == (rank, 3)
        assert len(hello["global_device_ids"]) == 6
        assert hello["psum_on_my_devices"] == [21.0, 21.0]  # 1 + 2 + ... + 6
        # JAX's SLURM detection: task i of a node drives the GPU numbered SLURM_LOCALID.
        assert hello["cuda_visible_devices"] == hello["environment"]["SLURM_LOCALID"]


def test_kill_on_bad_exit_ends_a_job_whose_task_failed(tmp_path):
    before = set(hang_lab.module_pids(DEMO))
    result = srun(
        "srun",
        "--overcommit",
        "--kill-on-bad-exit=1",
        "-n",
        "2",
        "python",
        "-m",
        "jaxdist_lessons.multihost_demo",
        "--devices",
        "1",
        "train",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "2",
        "--fail-rank",
        "1",
        "--fail-at-epoch",
        "0",
        "--fail-how",
        "raise",
    )
    assert result.returncode != 0
    assert "RuntimeError: process 1 raised at epoch 1" in result.stderr
    assert "task 1: Exited with exit code 1" in result.stderr
    assert set(hang_lab.module_pids(DEMO)) <= before


def test_train_py_under_srun_matches_mpirun():
    env = {"JAX_NUM_CPU_DEVICES": "2"}
    result = srun(
        "env",
        *(f"{k}={v}" for k, v in env.items()),
        "srun",
        "--overcommit",
        "-n",
        "3",
        "python",
        "examples/train.py",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 processes x 2 devices; w = [ 1.    -1.997  2.996  0.5  ]" in result.stdout


def test_the_chapters_batch_script_runs_through_sbatch(tmp_path):
    script = ROOT / "examples/slurm/train.sbatch"
    assert "srun --kill-on-bad-exit=1 python examples/train.py" in script.read_text()
    result = srun(
        "sbatch", "--wait", f"--output={tmp_path}/%x-%j.out", str(script), timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Submitted batch job ")
    [log] = tmp_path.glob("jaxdist-train-*.out")
    text = log.read_text()
    assert "step 30: loss 0.000040" in text
    assert "3 processes x 2 devices; w = [ 1.    -1.997  2.996  0.5  ]" in text


def test_the_gpu_batch_script_runs_on_one_node_with_cpu_devices(tmp_path):
    # As written: 2 nodes x 8 GPUs. Here, options on sbatch's command line override its #SBATCH
    # lines: one node, 2 tasks, no GPUs; JAX_NUM_CPU_DEVICES=1 stands for one GPU per process.
    script = ROOT / "examples/slurm/gpu.sbatch"
    text = script.read_text()
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8"):
        assert f"#SBATCH {line}\n" in text
    assert (
        "source examples/slurm/gpu_env.sh"
        in (ROOT / "examples/slurm/lm.sbatch").read_text()
    )
    result = srun(
        "env",
        "JAX_NUM_CPU_DEVICES=1",
        "sbatch",
        "--wait",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--gpus-per-node=0",
        "--overcommit",
        f"--output={tmp_path}/%x-%j.out",
        str(script),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [log] = tmp_path.glob("jaxdist-gpu-*.out")
    lines = log.read_text().splitlines()
    assert (
        "process 1 of 2 on " in log.read_text()
        and "smoke test passed: psum over 2 devices = 3" in lines
    )
    assert lines[-1].startswith("2 processes x 1 devices; w = [ 1.")


def test_the_gpu_variables_are_set_and_a_value_given_before_wins():
    program = "source examples/slurm/gpu_env.sh; echo $NCCL_SOCKET_IFNAME $NCCL_IB_HCA $NCCL_DEBUG $XLA_PYTHON_CLIENT_MEM_FRACTION $XLA_FLAGS"
    env = {
        "PATH": os.environ["PATH"],
        "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
        "XLA_FLAGS": "--xla_dump_to=/tmp/x",
    }
    result = subprocess.run(
        ["bash", "-c", program], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.stdout.split() == [
        "^lo,docker",
        "=mlx5_0,mlx5_1",
        "WARN",
        "0.90",
        "--xla_dump_to=/tmp/x",
        "--xla_gpu_enable_latency_hiding_scheduler=true",
    ]
