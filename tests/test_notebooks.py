"""Book hygiene: chapters kept as text and in sync with their notebooks, stored clean, set up
first, listed in the TOC, and in the house style.

Each chapter is a jupytext pair: ``book/NAME.md`` (MyST Markdown, the source) and
``book/NAME.ipynb`` (what nbmake, Colab and Kaggle run). Every mesh a chapter makes
(``jax.make_mesh``, ``Mesh``) states its axis_types=.

(Running the notebooks is nbmake's job: `pytest` collects book/*.ipynb too.)
"""

import json
import pathlib
import re

import jupytext
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
# Reference pages with no code (the glossary) are plain MyST pages, not notebooks.
PAGES = ("glossary",)
SOURCES = sorted(p for p in (ROOT / "book").glob("*.md") if p.stem not in PAGES)


def code_cells(path: pathlib.Path) -> list[dict]:
    return [
        c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"
    ]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for entry in toc.get("chapters", []) + [
        c for part in toc.get("parts", []) for c in part["chapters"]
    ]:
        files.append(entry["file"])
    return files


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {
        "00_preface.ipynb",
        "01_why_distribute.ipynb",
    }


def cell_key(cell: dict) -> tuple[str, str, tuple[str, ...]]:
    """What must agree between the two files of a pair: each cell's type, text and tags."""
    text = (
        "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    )
    return (
        cell["cell_type"],
        text.strip(),
        tuple(cell.get("metadata", {}).get("tags", [])),
    )


def test_every_chapter_is_a_text_and_notebook_pair():
    assert [p.stem for p in SOURCES] == [p.stem for p in NOTEBOOKS]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_pair_in_sync(path):
    text = [cell_key(c) for c in jupytext.read(path)["cells"]]
    notebook = [
        cell_key(c) for c in json.loads(path.with_suffix(".ipynb").read_text())["cells"]
    ]
    assert text == notebook, (
        f"{path.name} and {path.stem}.ipynb differ: edit the .md, then run "
        f"`jupytext --sync book/{path.name}` (the pre-commit hook does this)"
    )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_text_source_is_paired_myst(path):
    metadata = jupytext.read(path)["metadata"]
    assert metadata["jupytext"]["formats"] == "ipynb,md:myst"
    assert metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    for cell in code_cells(path):
        assert cell["outputs"] == [] and cell["execution_count"] is None, (
            f"{path.name} is stored with outputs; clear them (the book build executes notebooks)"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_comes_right_after_the_install_cell_and_declares_the_minimum(path):
    # The first code cell installs the package on Colab or Kaggle (tests/test_colab.py).
    second = source(code_cells(path)[1])
    assert "from jaxdist_lessons import devices" in second
    assert re.search(r"devices\.setup\(min_devices=\d+\)", second), second


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_house_style_outside_intentional_errors(path):
    for cell in code_cells(path):
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        src = source(cell)
        if (
            re.search(r"jax\.make_mesh\(|\bMesh\(", src)
            and "without axis_types=" not in src
        ):
            assert "axis_types=" in src, (
                f"{path.name}: every mesh we make passes axis_types=\n{src}"
            )
        assert "jax.pjit" not in src and "jax.experimental.shard_map" not in src, src


def test_toc_lists_every_notebook_and_nothing_else():
    listed = toc_files()
    assert sorted(listed) == sorted(
        [f"book/{p.stem}" for p in NOTEBOOKS] + [f"book/{p}" for p in PAGES]
    )


def test_numbered_chapters_follow_one_another_in_the_toc():
    """A chapter's file starts with its number: 00, 01, 02, ... in the order the book
    lists them, none repeated, none skipped (pages without a number sit between)."""
    numbers = [
        int(name.split("/")[-1][:2])
        for name in toc_files()
        if name.split("/")[-1][:2].isdigit()
    ]
    assert numbers == list(range(len(numbers)))


def test_pages_are_plain_markdown_without_code():
    for name in PAGES:
        text = (ROOT / "book" / f"{name}.md").read_text()
        assert not text.startswith("---") and "{code-cell}" not in text, name
        assert not (ROOT / "book" / f"{name}.ipynb").exists(), name


def test_chapters_end_with_what_we_learned_and_hidden_answers():
    # The numbered chapters teach; the preface, the setup page and the reference pages do not.
    for path in NOTEBOOKS:
        if not re.match(r"(0[1-9]|[1-9][0-9])_", path.name):
            continue
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join(source(c) for c in cells if c["cell_type"] == "markdown")
        assert "## What we learned" in text and "## Exercises" in text, path.name
        assert any(
            "hide-cell" in c.get("metadata", {}).get("tags", []) for c in cells
        ), path.name


def test_book_config_executes_every_notebook_and_excludes_the_rest():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["execute"]["execute_notebooks"] == "cache"
    # the book is built from the .md sources
    assert "book/*.ipynb" in config["exclude_patterns"]
    assert config["execute"]["allow_errors"] is False
    assert config["execute"]["timeout"] > 0
    for pattern in [".venv/*", "_build/*", "tests/*", "jaxdist_lessons/*"]:
        assert pattern in config["exclude_patterns"]
    # No public home yet: no button may point to a repository that does not exist.
    assert "repository" not in config
    assert not any(
        config["html"][b] for b in ("use_repository_button", "use_issues_button")
    )
    assert not any(
        config["launch_buttons"].get(k) for k in ("colab_url", "binderhub_url")
    )
    assert {"dollarmath", "colon_fence"} <= set(
        config["parse"]["myst_enable_extensions"]
    )


# What a reader scrolls through: every code cell the HTML shows, folded ones included. The
# appendix is exempt: it holds the article's snippet and our fix for each of its 30 claims.
PAGE_LINES, CELL_LINES = 400, 40


def shown_lines(cell: dict) -> int:
    if {"remove-cell", "remove-input"} & set(cell.get("metadata", {}).get("tags", [])):
        return 0
    return len(source(cell).strip().splitlines())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_page_shows_at_most_400_lines_of_code_and_40_in_a_cell(path):
    lines = [shown_lines(c) for c in code_cells(path)]
    assert max(lines, default=0) <= CELL_LINES, (path.name, max(lines))
    if path.stem != "appendix_seed_errata":
        assert sum(lines) <= PAGE_LINES, (path.name, sum(lines))
