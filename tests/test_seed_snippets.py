"""The appendix's claims about the seed article, checked on the pinned versions.

Every entry of ``jaxdist_lessons.seed`` runs here in one namespace, in the article's order, as in
``book/appendix_seed_errata.ipynb``: each article snippet must still fail the way the appendix says,
and each fix must still run (the fixes assert their own results). If an upgrade changes a message or
breaks a fix, update the entry in ``jaxdist_lessons/seed.py`` and the prose around it in the appendix.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import traceback

import pytest
import yaml

from jaxdist_lessons import seed

ROOT = pathlib.Path(__file__).resolve().parents[1]
APPENDIX = ROOT / "book" / "appendix_seed_errata.ipynb"


@dataclasses.dataclass
class Outcome:
    article_error: BaseException | None = None
    fix_error: str | None = None  # the traceback, if the given code or the fix failed


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    namespace = seed.new_namespace()
    results = {}
    for entry in seed.ENTRIES:
        outcome = results[entry.key] = Outcome()
        try:
            if entry.given:
                seed.run(entry.given, namespace)
            if entry.article and not entry.shell:
                try:
                    seed.run(entry.article, namespace)
                except Exception as exc:  # the article's own error: what the appendix shows
                    outcome.article_error = exc
            if entry.fix:
                seed.run(entry.fix, namespace)
        except Exception:
            outcome.fix_error = traceback.format_exc()
    return results


@pytest.mark.parametrize("entry", seed.ENTRIES, ids=lambda e: e.key)
def test_article_snippet_fails_as_the_appendix_says(entry, outcomes):
    error = outcomes[entry.key].article_error
    if entry.error is None:
        assert error is None, f"{entry.key} now raises {type(error).__name__}: {error}"
        return
    name, message = entry.error
    assert error is not None, f"{entry.key}: the article's code no longer fails"
    assert type(error).__name__ == name, f"{entry.key}: {type(error).__name__}: {error}"
    assert re.search(message, str(error)), f"{entry.key}: the message changed:\n{error}"


@pytest.mark.parametrize("entry", seed.ENTRIES, ids=lambda e: e.key)
def test_fix_runs_and_checks_itself(entry, outcomes):
    assert outcomes[entry.key].fix_error is None, outcomes[entry.key].fix_error


def test_failing_snippets_have_an_expected_error_and_keys_are_unique():
    keys = [e.key for e in seed.ENTRIES]
    assert len(keys) == len(set(keys))
    for e in seed.ENTRIES:
        if e.verdict == "fails" and not e.shell:
            assert e.error is not None, e.key


def test_entry_rejects_unknown_verdicts_and_chapters():
    with pytest.raises(ValueError, match="verdict 'wrong' is not one of"):
        seed.Entry(
            key="k", section="§1", title="t", verdict="wrong", chapter="01_why_distribute"
        )
    with pytest.raises(ValueError, match="chapter '99_x' is not one of"):
        seed.Entry(key="k", section="§1", title="t", verdict="runs", chapter="99_x")
    with pytest.raises(ValueError, match="only Python article code"):
        seed.Entry(
            key="k",
            section="§1",
            title="t",
            verdict="fails",
            chapter="01_why_distribute",
            error=("ValueError", "x"),
        )
    with pytest.raises(KeyError, match="no seed entry 'nope'"):
        seed.entry("nope")
    assert seed.entry("launcher").shell


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


def test_the_article_leaves_these_names_undefined():
    assert seed.undefined_names(seed.ARTICLE_SNIPPETS) == [
        "ResNet50",
        "batch",
        "batch_size",
        "loss_fn",
        "num_steps",
        "rng",
    ]


def _appendix() -> list[dict]:
    return json.loads(APPENDIX.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]).strip()


def test_appendix_shows_exactly_the_entries_cells_in_order():
    code = [c for c in _appendix() if c["cell_type"] == "code"]
    sources = [_source(c) for c in code]
    expected = [seed.PRELUDE.strip()] + [
        s.strip() for e in seed.ENTRIES for s in e.code_cells
    ]
    start = sources.index(seed.PRELUDE.strip())
    assert sources[start : start + len(expected)] == expected, (
        "regenerate the appendix's cells from seed.ENTRIES"
    )
    tagged = {
        _source(c)
        for c in code
        if "raises-exception" in c.get("metadata", {}).get("tags", [])
    }
    assert tagged == {e.article.strip() for e in seed.ENTRIES if e.error}


def test_appendix_opens_with_the_verdict_table_linking_existing_chapters():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    existing = [pathlib.Path(entry["file"]).name for entry in toc["chapters"]]
    table = seed.verdict_markdown(existing)
    markdown = "\n".join(_source(c) for c in _appendix() if c["cell_type"] == "markdown")
    assert table in markdown, "replace the appendix's table with seed.verdict_markdown(...)"
    for e in seed.ENTRIES:
        assert f"({e.key})=" in markdown, e.key
    for chapter in seed.CHAPTERS:  # each entry's closing sentence points to its chapter
        pointer = f"Chapter: {seed.chapter_link(chapter, existing)}."
        assert markdown.count(pointer) == sum(e.chapter == chapter for e in seed.ENTRIES), (
            pointer
        )
    assert seed.chapter_link("05_resnet50", existing) == "[5. ResNet50](05_resnet50.md)"
    assert seed.chapter_link("05_resnet50", []) == "5. ResNet50 (to come)"
