""".ci/tpu_chapters: every chapter executed without a Jupyter kernel, for the TPU machine."""

import json
import pathlib
import subprocess
import sys

import nbformat
from by_path import load

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_chapter_runs_through_ipythons_shell_and_is_recorded(tmp_path):
    """The preface, as the TPU machine runs it: its own process, no kernel, a JSON row."""
    out = tmp_path / "chapters.json"
    done = subprocess.run(
        [sys.executable, ".ci/tpu_chapters", "--chapters", "00_preface"]
        + ["--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    [row] = record["chapters"]
    assert (row["chapter"], row["status"], row["message"]) == ("00_preface", "ran", "")
    assert row["cells"] > 0 and row["setup"].startswith("jaxdist: ")
    assert record["jax"] == "0.10.2" and record["device_kind"] == "cpu"
    assert done.stdout.splitlines()[-1] == "1 chapters: 0 failed"

    # --update: the preface again, into a table that holds an earlier run's rows
    earlier = {"chapter": "setup", "status": "ran", "message": "", "seconds": 1.0}
    record["chapters"] = [{**row, "status": "FAILED"}, earlier]
    record |= {"date": "2026-01-01", "machine": "the TPU machine"}
    out.write_text(json.dumps(record))
    subprocess.run(
        [sys.executable, ".ci/tpu_chapters", "--chapters", "00_preface"]
        + ["--json", str(out), "--update"],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=True,
    )
    updated = json.loads(out.read_text())
    assert [r["chapter"] for r in updated["chapters"]] == ["00_preface", "setup"]
    assert updated["chapters"][0]["status"] == "ran"
    assert updated["chapters"][1] == {"date": "2026-01-01", **earlier}
    assert updated["machine"] == "the TPU machine"


def test_cells_run_with_history_as_in_a_kernel(tmp_path, monkeypatch):
    """The appendix reads the cells run so far from IPython's ``In``, as under a kernel."""
    tpu_chapters = load("tpu_chapters", ".ci/tpu_chapters")
    cells = [
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("assert In[1] == 'x = 1', In"),
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "history.ipynb")
    monkeypatch.chdir(tmp_path)  # run_one moves into the book's folder
    monkeypatch.setattr(tpu_chapters, "BOOK", tmp_path)
    row = tpu_chapters.run_one("history")
    assert (row["status"], row["message"], row["cells"]) == ("ran", "", 2)
