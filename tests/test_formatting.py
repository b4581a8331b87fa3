"""One formatting style beyond what ruff holds (.ci/run runs ruff check and ruff format):
a comment sits above the statement it describes, never off a line of closing brackets, and
the few blocks the formatter must leave alone say why."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a line that starts by closing a bracket and ends with a comment
HANGING = re.compile(r"^\s*[\])}][^#]*\s#")
MOST_SKIPS = 20


def tracked(*patterns: str) -> list[pathlib.Path]:
    names = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    return [ROOT / n for n in names if not (ROOT / n).is_symlink()]


def code_lines() -> list[tuple[str, int, str]]:
    """Every line of the Python files and the chapters' Markdown (the notebooks' pairs)."""
    return [
        (str(path.relative_to(ROOT)), number, line)
        for path in tracked("*.py", "book/*.md")
        if path != pathlib.Path(__file__)  # this file names the pragma it counts
        for number, line in enumerate(path.read_text().splitlines(), 1)
    ]


def test_no_comment_hangs_off_a_closing_bracket():
    hanging = [
        f"{path}:{n}"
        for path, n, line in code_lines()
        if HANGING.match(line) and "# fmt: skip" not in line
    ]
    assert not hanging, hanging


def test_no_value_is_wrapped_in_brackets_to_hold_a_comment():
    """``x = (\n    value  # why\n)`` is the formatter keeping a long trailing comment:
    the comment goes above, and the value on the line of its name."""
    wrapped = []
    for path in tracked("*.py", "book/*.md"):
        lines = path.read_text().splitlines()
        for n in range(len(lines) - 2):
            opens, middle, closes = lines[n : n + 3]
            if (
                opens.endswith("= (")
                and re.search(r"\S\s+#\s", middle)
                and closes.strip() == ")"
            ):
                wrapped.append(f"{path.relative_to(ROOT)}:{n + 1}")
    assert not wrapped, wrapped


def test_few_formatter_skips_and_each_says_why():
    skips = [(p, n, line) for p, n, line in code_lines() if "# fmt: skip" in line]
    assert len(skips) <= MOST_SKIPS, [f"{p}:{n}" for p, n, _ in skips]
    unexplained = [f"{p}:{n}" for p, n, line in skips if "# fmt: skip  # " not in line]
    assert not unexplained, unexplained
