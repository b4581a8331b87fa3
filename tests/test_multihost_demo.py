"""The chapter's command runner: what it prints of a command's output, and where a tool is missing."""

from jaxdist_lessons import multihost_demo


def test_run_prints_stdout_with_mpiruns_and_sruns_tags_as_ranks(capsys):
    job = multihost_demo.run(
        "printf '[1,0]<stdout>: zero\\n[1,1]<stdout>: one\\n2: two\\n'; exit 3"
    )
    assert (job.returncode, job.stdout.count("\n")) == (3, 3)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("$ printf")
    assert lines[1:4] == ["[rank 0] zero", "[rank 1] one", "[rank 2] two"]
    assert lines[4].startswith("(exit status 3, ")


def test_run_names_the_xla_flags_its_command_compiled_with(capsys, monkeypatch):
    """Step times under the test suite's flags are not those of a reader's run."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    multihost_demo.run("true")
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "(XLA_FLAGS: --xla_backend_optimization_level=0)"
    monkeypatch.delenv("XLA_FLAGS")
    multihost_demo.run("true")
    assert capsys.readouterr().out.splitlines()[-1].startswith("(exit status 0, ")


def test_run_shows_stderr_without_gloos_messages_when_asked(capsys):
    multihost_demo.run(
        "echo '[Gloo] Rank 0 is connected to 1 peer ranks.' >&2; echo 'real error' >&2",
        show_stderr=True,
    )
    printed = capsys.readouterr().out.splitlines()[1:]  # after the command line
    assert printed[0] == "real error" and not any("Gloo" in line for line in printed)
    assert printed[1].endswith("; 1 lines of gloo's connection messages hidden)")


def test_run_where_runs_the_command_when_the_tool_is_there(capsys):
    job = multihost_demo.run_where("sh", "echo here")
    assert job is not None and job.stdout == "here\n"


def test_run_where_prints_the_command_when_the_tool_is_missing(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert multihost_demo.run_where("srun", "srun -n 2 python job.py") is None
    assert capsys.readouterr().out == (
        "srun is not installed here; on a cluster with it, this runs:\n"
        "$ srun -n 2 python job.py\n"
    )


def fake_tools(tmp_path, monkeypatch, sinfo: str) -> None:
    """``sbatch`` and an ``sinfo`` running the shell line ``sinfo``, alone on ``PATH``."""
    for name, body in {"sinfo": sinfo, "sbatch": "echo submitted"}.items():
        tool = tmp_path / name
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_slurm_unavailable_says_so_without_slurm(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert multihost_demo.slurm_unavailable() == "SLURM is not installed here"


def test_run_where_skips_sbatch_when_the_controller_does_not_answer(
    tmp_path, monkeypatch, capsys
):
    fake_tools(
        tmp_path,
        monkeypatch,
        "echo 'sinfo: error: Unable to contact slurm controller' >&2; exit 1",
    )
    assert multihost_demo.run_where("sbatch", "sbatch job.sbatch") is None
    assert capsys.readouterr().out == (
        "SLURM is installed, but sinfo failed (sinfo: error: Unable to contact slurm controller);"
        " on a cluster with it, this runs:\n$ sbatch job.sbatch\n"
    )


def test_run_where_runs_sbatch_when_a_node_is_idle(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch, "echo idle")
    job = multihost_demo.run_where("sbatch", "sbatch job.sbatch")
    assert job is not None and job.stdout == "submitted\n"


def test_slurm_unavailable_names_the_busy_states(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch, "echo alloc; echo drain")
    assert multihost_demo.slurm_unavailable(settle_s=1) == (
        "SLURM is installed, but no node is idle (sinfo: alloc drain)"
    )


# --- Preemption: a notice saves at the next step, exits 0, and a rerun resumes exactly ---------

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxdist_lessons import hang_lab  # noqa: E402

TRAIN = ["train", "--epochs", "3", "--steps-per-epoch", "4"]


@pytest.fixture(scope="module")
def reference():
    """The 12 losses of an uninterrupted run on 2 devices (the same global batch of 8)."""
    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    losses = multihost_demo.train_digits(3, 4, devices=2)["losses"]
    for s, handler in signals.items():
        signal.signal(s, handler)
    return losses


def preempted_then_resumed(launch, notify, out, checkpoints):
    """Start ``launch`` + the demo, ``notify()`` once epoch 1 is done, then rerun it to the end; both reports."""
    env = hang_lab.job_environment()
    args = [
        "-m",
        "jaxdist_lessons.multihost_demo",
        "--devices",
        "1",
        "--checkpoint-dir",
        str(checkpoints),
        *TRAIN,
    ]
    job = subprocess.Popen(
        [*launch, sys.executable, *args, "--out", str(out / "first"), "--pause", "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if line.startswith("epoch 1: losses"):
                notify(job)
        job.wait(timeout=120)
    finally:
        job.kill()
    rerun = subprocess.run(
        [*launch, sys.executable, *args, "--out", str(out / "second")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    first, second = (
        [
            json.loads((out / run / f"rank{r}.json").read_text())["train"]
            for r in range(2)
        ]
        for run in ("first", "second")
    )
    return job.returncode, "".join(lines), first, rerun, second


def pids_of(path) -> list[int]:
    """Running processes whose command line names ``path`` (ours: other tests may run demos too)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found += [int(pid)] if str(path).encode() in f.read() else []
        except OSError:
            pass
    return found


def check_resumed_exactly(reference, status, stdout, first, rerun, second, name):
    assert status == 0, stdout
    [saved] = [
        int(line.split()[3].rstrip(","))
        for line in stdout.splitlines()
        if line.startswith(f"{name}: saved step")
    ]
    assert 4 <= saved < 12 and first[0]["preempted"] == first[1]["preempted"] == name
    assert rerun.returncode == 0 and "resumed from" in rerun.stdout, rerun.stderr[
        -2000:
    ]
    assert second[0]["first_step"] == saved
    losses = first[0]["losses"] + second[0]["losses"]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


def test_scancel_sigterm_under_srun_saves_and_a_rerun_resumes_exactly(
    tmp_path, reference
):
    reason = multihost_demo.slurm_unavailable()
    if reason and os.environ.get("JAXDIST_REQUIRE_SLURM") == "1":
        pytest.fail(
            f"JAXDIST_REQUIRE_SLURM=1 but {reason}; start one with .ci/slurm-up"
        )
    if reason:
        pytest.skip(reason)
    name = f"jaxdist-preempt-{os.getpid()}"
    launch = ["srun", "--overcommit", "-n", "2", "-J", name]
    result = preempted_then_resumed(
        launch,
        lambda job: subprocess.run(
            ["scancel", "--signal=TERM", "--name", name], check=True
        ),
        tmp_path,
        tmp_path / "ckpt",
    )
    check_resumed_exactly(reference, *result, "SIGTERM")
    assert not pids_of(tmp_path)


def test_run_hides_the_count_gloo_writes_apart(capsys, monkeypatch):
    """Under mpirun --output tag, gloo's "... peer ranks is : 7" can reach the tagger in two
    pieces: the count alone on a tagged line is gloo's too, and is not shown."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    job = multihost_demo.run(
        "printf '[1,1]<stdout>: 7\\n[1,0]<stdout>: step 1 loss 2.0\\n'"
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:-1] == ["[rank 0] step 1 loss 2.0"], printed
    assert printed[-1].endswith("; 1 lines of gloo's connection messages hidden)")
    assert job.returncode == 0
