""".ci/sweep_counts: its choice of chapters and counts, its verdict on an error, its table."""

import io

import pytest
from by_path import ROOT, load

sweep = load("sweep_counts", ".ci/sweep_counts")
Outcome = sweep.Outcome


def test_the_book_s_chapters_in_the_table_of_contents_order():
    chapters = sweep.book_chapters()
    assert chapters[0] == "00_preface"
    assert chapters.index("03_sharding") < chapters.index("12_long_sequences")
    assert "glossary" not in chapters  # plain Markdown: nothing to execute
    assert all((ROOT / "book" / f"{c}.ipynb").is_file() for c in chapters)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("1-16", list(range(1, 17))), ("3", [3]), ("1,2, 5-7,2", [1, 2, 5, 6, 7])],
)
def test_counts(text, counts):
    assert sweep.parse_counts(text) == counts


@pytest.mark.parametrize("text", ["0-3", "5-2", "x", "", "1-"])
def test_bad_counts(text):
    with pytest.raises(ValueError):
        sweep.parse_counts(text)


def test_chapters_by_name_or_prefix_in_the_book_s_order():
    known = ["00_preface", "03_sharding", "12_long_sequences", "13_experts"]
    assert sweep.choose_chapters(None, known) == known
    chosen = sweep.choose_chapters("12_long_sequences,03", known)
    assert chosen == ["03_sharding", "12_long_sequences"]
    with pytest.raises(ValueError, match="matches 12_long_sequences, 13_experts"):
        sweep.choose_chapters("1", known)
    with pytest.raises(ValueError, match="matches none"):
        sweep.choose_chapters("99", known)


def test_only_the_setup_cell_s_setup_error_is_a_clean_stop():
    setup = "from jaxdist_lessons import devices\n\ninfo = devices.setup(min_devices=2)"
    assert sweep.classify("SetupError", "needs at least 2", setup) == sweep.STOPPED
    assert sweep.classify("SetupError", "too late", "mesh = make()") == sweep.FAILED
    assert sweep.classify("AssertionError", "", setup) == sweep.FAILED


def test_the_first_line_of_a_message_and_the_cell_it_came_from():
    assert sweep.first_line("\n  AssertionError: ('ring', 1, 2)\nmore") == (
        "AssertionError: ('ring', 1, 2)"
    )
    assert len(sweep.first_line("x" * 500)) == sweep.MESSAGE_CHARS
    assert sweep.cell_start("%xmode Minimal\n# hidden\nassert x == 1") == (
        "assert x == 1"
    )
    long = sweep.cell_start("y = " + "1 + " * 40)
    assert len(long) == 48 and long.endswith("...")


OUTCOMES = [
    Outcome("03_sharding", 1, sweep.STOPPED, "SetupError: needs at least 2"),
    Outcome("03_sharding", 2, sweep.FAILED, "AssertionError: (code cell 6: for row)"),
    Outcome("12_long_sequences", 1, sweep.STOPPED),
    Outcome("12_long_sequences", 2, sweep.RAN),
]


def test_the_table_marks_each_run_and_lists_each_failure():
    chapters, counts = ["03_sharding", "12_long_sequences"], [1, 2, 3]
    text = sweep.text_table(OUTCOMES, chapters, counts)
    lines = text.splitlines()
    assert lines[0].split() == ["chapter", "1", "2", "3"]
    assert lines[1].split() == ["03_sharding", "stop", "FAIL"]  # 3: not run
    assert lines[2].split() == ["12_long_sequences", "stop", "ran"]
    assert "4 runs: 1 ran, 2 clean stops, 1 failed" in text
    assert lines[-1] == (
        "FAILED 03_sharding at 2: AssertionError: (code cell 6: for row)"
    )


def test_the_markdown_table():
    md = sweep.markdown_table(
        OUTCOMES, ["03_sharding", "12_long_sequences"], [1, 2], "H"
    )
    lines = md.splitlines()
    assert lines[:5] == [
        "H",
        "",
        "| chapter | 1 | 2 |",
        "|---|:-:|:-:|",
        "| `03_sharding` | stop | FAIL |",
    ]
    assert lines[-1] == "- `03_sharding` at 2: `AssertionError: (code cell 6: for row)`"


def test_a_run_that_hangs_is_killed_and_counts_as_failed(tmp_path, monkeypatch):
    """The runner's process group is killed at the timeout: here a sleep stands in for it."""
    # the sweep runs `executable script --one ...`
    monkeypatch.setattr(sweep.sys, "executable", str(tmp_path / "hang.sh"))
    (tmp_path / "hang.sh").write_text("#!/bin/sh\nsleep 60\n")
    (tmp_path / "hang.sh").chmod(0o755)
    runs = sweep.Sweep(timeout=1, default_level=True, log=io.StringIO())
    outcome = runs.run("03_sharding", 2, tmp_path)
    assert outcome.status == sweep.FAILED
    assert outcome.message == "killed at the timeout (1 s)"


def test_a_failed_run_keeps_its_notebook_with_the_outputs(tmp_path, monkeypatch):
    """--keep-failed: the run's notebook, executed up to the failing cell, with what each
    cell printed, as CHAPTER-COUNT.ipynb; the outcome names the cell."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("print('before the failure')"),
        nbformat.v4.new_code_cell("assert 1 + 1 == 3, 'the hidden check'"),
    ]
    path = tmp_path / "07_troubleshooting.ipynb"
    nbformat.write(nb, path)
    monkeypatch.setenv("JAXDIST_NUM_DEVICES", "5")
    result, keep = tmp_path / "result.json", tmp_path / "failed"
    sweep.run_one(path, result, timeout=60, keep=keep)
    outcome = sweep.json.loads(result.read_text())
    assert outcome == {
        "status": sweep.FAILED,
        "message": "AssertionError: the hidden check (code cell 2: assert 1 + 1 == 3, "
        "'the hidden check')",
    }
    kept = nbformat.read(keep / "07_troubleshooting-5.ipynb", as_version=4)
    assert kept.cells[0].outputs[0]["text"] == "before the failure\n"
    assert kept.cells[1].outputs[0]["ename"] == "AssertionError"


def test_each_run_compiles_as_pytest_compiles_the_chapters(monkeypatch):
    """conftest.py's flags beside the reader's own, or none under --default-level."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    fast = ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
    env = sweep.run_environment("05_resnet50", 3, default_level=False)
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", *fast]
    assert env["JAXDIST_NUM_DEVICES"] == "3" and env["JAX_PLATFORMS"] == "cpu"
    env = sweep.run_environment("05_resnet50", 3, default_level=True)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
