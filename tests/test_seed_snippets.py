"""The appendix's claims about the seed article, held to ``jaxdist_lessons.seed``.

The article's code and our fixes live once, in the appendix's cells
(``book/appendix_seed_errata.md``); ``jaxdist_lessons.seed`` says what each entry's cells must do.
The appendix checks itself as it runs (``pytest`` runs it with the other chapters): a hidden cell
after each failing article cell calls ``seed.check_raised``, and a hidden cell after each fix
asserts its results. Here: that every cell sits where its entry says, that every expected error
is checked by the page, and that the checks can fail. If an upgrade changes a message or breaks
a fix, update the cell and the prose around it in the appendix, and the entry in
``jaxdist_lessons/seed.py``.
"""

from __future__ import annotations

import functools
import pathlib
import re
import sys
from collections.abc import Iterable

import jupytext
import pytest
import yaml

from jaxdist_lessons import seed

ROOT = pathlib.Path(__file__).resolve().parents[1]
APPENDIX = ROOT / "book" / "appendix_seed_errata.md"
PRELUDE_TAG = "seed-prelude"


@functools.cache
def _cells() -> tuple:
    return tuple(jupytext.read(APPENDIX).cells)


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _part(cell) -> tuple[str, str] | None:
    """The (entry key, part) a code cell's ``seed-<key>-<part>`` tag names, if any."""
    for tag in _tags(cell):
        key, _, part = tag.removeprefix("seed-").rpartition("-")
        if tag.startswith("seed-") and part in seed.PARTS:
            return key, part
    return None


def _code_from_prelude() -> list:
    code = [c for c in _cells() if c.cell_type == "code"]
    starts = [i for i, c in enumerate(code) if PRELUDE_TAG in _tags(c)]
    assert len(starts) == 1, f"the appendix needs one cell tagged {PRELUDE_TAG}"
    return code[starts[0] :]


def _tagged(part: str) -> dict[str, str]:
    """Each entry's ``part`` cell source, by key."""
    return {
        found[0]: c.source
        for c in _cells()
        if (found := _part(c)) is not None and found[1] == part
    }


def _is_check(cell) -> bool:
    """A hidden cell (``remove-cell``) that pins the results of the entry above it."""
    return "remove-cell" in _tags(cell) and _part(cell) is None


def _is_exercise(cell) -> bool:
    """A cell of the Exercises section: the checker, or a reader's ``check(k, answer_k)``."""
    return "exercises.checker(" in cell.source or re.search(
        r"^check\(\d", cell.source, re.M
    )


CHECK = re.compile(r'^seed\.check_raised\("([\w-]+)"\)$')


def test_the_page_checks_each_expected_error_right_after_its_article_cell():
    code = _code_from_prelude()
    checked = []
    for cell, after in zip(code, code[1:]):
        found = CHECK.match(after.source.strip())
        if found:
            assert _is_check(after), "a seed.check_raised cell is hidden (remove-cell)"
            assert _part(cell) == (found[1], "article"), (
                f"{found[1]} checks {cell.source}"
            )
            checked.append(found[1])
    every_call = [c for c in _cells() if "check_raised" in c.source]
    assert len(every_call) == len(checked)
    assert checked == [e.key for e in seed.ENTRIES if e.error]


@pytest.fixture
def last_error():
    """sys.last_value as IPython leaves it after a cell raised; restored after the test."""
    saved = {n: getattr(sys, n) for n in ("last_type", "last_value") if hasattr(sys, n)}

    def leave(error: BaseException) -> None:
        sys.last_type, sys.last_value = type(error), error

    yield leave
    for name in ("last_type", "last_value"):
        if hasattr(sys, name):
            delattr(sys, name)
    for name, value in saved.items():
        setattr(sys, name, value)


def test_check_raised_passes_on_the_expected_error_and_clears_it(last_error):
    name, _ = seed.entry("pmap-pmean").error
    assert name == "NameError"
    last_error(NameError("Found an unbound axis name: data"))
    seed.check_raised("pmap-pmean")
    assert not hasattr(sys, "last_value")
    with pytest.raises(
        AssertionError, match="pmap-pmean: the article's code no longer"
    ):
        seed.check_raised("pmap-pmean")  # the same error cannot pass a second check


def test_check_raised_fails_on_another_error_or_message(last_error):
    last_error(ValueError("Found an unbound axis name: data"))
    with pytest.raises(
        AssertionError, match="expected NameError matching .* ValueError"
    ):
        seed.check_raised("pmap-pmean")
    last_error(NameError("something else"))
    with pytest.raises(AssertionError, match="got NameError: something else"):
        seed.check_raised("pmap-pmean")
    with pytest.raises(ValueError, match="gpt3-memory: the entry expects no error"):
        seed.check_raised("gpt3-memory")


def test_failing_snippets_have_an_expected_error_and_keys_are_unique():
    keys = [e.key for e in seed.ENTRIES]
    assert len(keys) == len(set(keys))
    for e in seed.ENTRIES:
        if e.verdict == "fails" and not e.shell:
            assert e.error is not None, e.key


def test_entry_rejects_unknown_verdicts_chapters_and_cells():
    with pytest.raises(ValueError, match="verdict 'wrong' is not one of"):
        seed.Entry("k", "§1", "t", "wrong", "01_why_distribute")
    with pytest.raises(ValueError, match="chapter '99_x' is not one of"):
        seed.Entry("k", "§1", "t", "runs", "99_x")
    with pytest.raises(ValueError, match="only Python article code"):
        seed.Entry(
            "k", "§1", "t", "fails", "01_why_distribute", error=("ValueError", "x")
        )
    with pytest.raises(ValueError, match="are not drawn from"):
        seed.Entry("k", "§1", "t", "runs", "01_why_distribute", ("fix", "article"))
    with pytest.raises(ValueError, match="a shell command is shown"):
        seed.Entry("k", "§1", "t", "fails", "setup", ("article",), shell=True)
    with pytest.raises(KeyError, match="no seed entry 'nope'"):
        seed.entry("nope")
    with pytest.raises(KeyError, match="has no 'given' cell"):
        seed.entry("launcher").tag("given")
    assert seed.entry("launcher").shell
    assert seed.entry("pjit").tag("article") == "seed-pjit-article"


def test_undefined_names_reads_in_order_and_lets_functions_bind_late():
    snippets = [
        "x = y + 1",
        "def f(a):\n    return a + z + w",
        "w = 2",
        "for i in range(3):\n    q = i",
        "g = lambda t: t + k",
    ]
    assert seed.undefined_names(snippets) == ["k", "y", "z"]
    assert seed.undefined_names(["b = f(b)"], assumed={"f"}) == ["b"]
    assert seed.undefined_names(
        ["[u for u in range(2)]", "with open(f) as h:\n    h.read()"]
    ) == ["f"]


def test_article_code_takes_the_marked_cells_and_drops_given_lines():
    sources = [
        "x = 1",
        f"{seed.ARTICLE_MARK}§9\ny = f(x)\nf(y)  {seed.GIVEN_MARK}: a call",
        "# §9's advice, applied by us\nz = 2",
    ]
    assert seed.article_code(sources) == [f"{seed.ARTICLE_MARK}§9\ny = f(x)"]


def _article_sources() -> list[str]:
    """The article cells of the entries that run the article's own code, in page order."""
    own = {e.key for e in seed.ENTRIES if not e.applied}
    return [source for key, source in _tagged("article").items() if key in own]


def test_the_article_cells_are_marked_and_leave_these_names_undefined():
    every_code_cell = [c.source for c in _cells() if c.cell_type == "code"]
    assert seed.article_code(every_code_cell) == seed.article_code(_article_sources())
    assert len(seed.article_code(every_code_cell)) == sum(
        "article" in e.cells and not e.applied for e in seed.ENTRIES
    )
    assert seed.undefined_names(seed.article_code(_article_sources())) == [
        "ResNet50",
        "batch",
        "batch_size",
        "loss_fn",
        "num_steps",
        "rng",
    ]


def test_every_entry_has_its_cells_under_its_heading_in_order():
    # keys in page order; (key, part) of each tagged cell in order
    entries, parts = (
        [],
        [],
    )
    current = None
    for cell in _cells():
        if cell.cell_type == "markdown":
            for e in seed.ENTRIES:
                if f"({e.key})=" in cell.source:
                    current = e.key
                    entries.append(e.key)
        elif (found := _part(cell)) is not None:
            assert found[0] == current, f"{found} sits under the heading of {current}"
            parts.append(found)
    assert entries == [e.key for e in seed.ENTRIES]
    assert parts == [(e.key, p) for e in seed.ENTRIES for p in e.cells]
    shown = [c for c in _code_from_prelude()[1:] if "hide-cell" not in _tags(c)]
    assert [
        _part(c) for c in shown if not _is_check(c) and not _is_exercise(c)
    ] == parts
    assert not _is_check(shown[0]), "a hidden check follows the entry it pins"
    tagged = {_part(c) for c in _cells() if "raises-exception" in _tags(c)}
    assert tagged == {(e.key, "article") for e in seed.ENTRIES if e.error}


def _entry_markdown() -> dict[str, str]:
    """The Markdown of each entry: from its label to the next entry's, or to the page's end."""
    text = APPENDIX.read_text()
    starts = [text.index(f"\n({e.key})=\n") for e in seed.ENTRIES]
    ends = [*starts[1:], text.index("\n## What we learned")]
    return {e.key: text[a:b] for e, a, b in zip(seed.ENTRIES, starts, ends)}


def test_every_entry_has_its_anchor_heading_verdict_and_article_code():
    for e in seed.ENTRIES:
        block = _entry_markdown()[e.key]
        assert block.startswith(f"\n({e.key})=\n### {e.section}: {e.title}\n"), e.key
        assert f"**Verdict: {e.verdict}" in block, e.key
        if e.shell:  # the command is shown as the article wrote it, not run
            assert "```bash\n" in block, e.key
        if "article" in e.cells and not e.applied:
            assert _tagged("article")[e.key].startswith(
                f"{seed.ARTICLE_MARK}{e.section}\n"
            )


def test_the_verdicts_this_page_gives():
    assert seed.counts() == {
        "runs": 3,
        "fails": 12,
        "misleading": 8,
        "false": 4,
        "unverified": 1,
    }
    assert seed.entry("check-jax-versions").verdict == "misleading"
    assert seed.entry("check-jax-versions").chapter == "08_multi_host"
    assert seed.entry("pip-cuda11").chapter == "setup"


def chapter_link(chapter: str, existing: Iterable[str]) -> str:
    """A Markdown link to ``chapter`` if its notebook is in ``existing``, else its title."""
    title = seed.CHAPTERS[chapter]
    return (
        f"[{title}]({chapter}.md)" if chapter in set(existing) else f"{title} (to come)"
    )


def verdict_markdown(existing: Iterable[str]) -> str:
    """The appendix's opening table: section, snippet or claim, verdict, where the book fixes it."""
    existing = set(existing)
    rows = [
        "| § | snippet or claim | verdict | where the book fixes it |",
        "|---|---|---|---|",
    ]
    for e in seed.ENTRIES:
        rows.append(
            f"| {e.section} | [{e.title}](#{e.key}) | **{e.verdict}** | "
            f"{chapter_link(e.chapter, existing)} |"
        )
    return "\n".join(rows)


def test_appendix_opens_with_the_verdict_table_linking_existing_chapters():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    existing = [pathlib.Path(entry["file"]).name for entry in toc["chapters"]]
    table = verdict_markdown(existing)
    markdown = "\n".join(c.source for c in _cells() if c.cell_type == "markdown")
    assert table in markdown, (
        "replace the appendix's table with this file's verdict_markdown(...)"
    )
    for e in seed.ENTRIES:
        assert f"({e.key})=" in markdown, e.key
    for chapter in seed.CHAPTERS:  # each entry's closing sentence points to its chapter
        pointer = f"Chapter: {chapter_link(chapter, existing)}."
        assert markdown.count(pointer) == sum(
            e.chapter == chapter for e in seed.ENTRIES
        ), pointer
    assert chapter_link("05_resnet50", existing) == "[5. ResNet50](05_resnet50.md)"
    assert chapter_link("setup", existing) == "[Setting up](setup.md)"
    assert chapter_link("05_resnet50", []) == "5. ResNet50 (to come)"
    for chapter in seed.CHAPTERS:  # every page the appendix links to exists
        assert (ROOT / "book" / f"{chapter}.md").exists(), chapter


def test_other_pages_link_to_entries_by_label_and_reuse_no_entry_label():
    """Sphinx labels are global: ``[text](#<key>)`` reaches an entry from any page.

    ``[text](appendix_seed_errata.md#<key>)`` would not: MyST resolves ``page.md#id`` only
    against heading slugs, and the book's build treats the warning as an error.
    """
    keys = {e.key for e in seed.ENTRIES}
    for page in sorted((ROOT / "book").glob("*.md")):
        text = page.read_text()
        if page != APPENDIX:
            labels = set(re.findall(r"^\(([^)\s]+)\)=$", text, re.M))
            assert not labels & keys, (
                f"{page.name} reuses the appendix's labels {labels & keys}"
            )
        for anchor in re.findall(r"\]\(appendix_seed_errata\.md#([^)]+)\)", text):
            raise AssertionError(
                f"{page.name}: write [text](#{anchor}), not ...md#{anchor}"
            )
