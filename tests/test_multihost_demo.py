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
