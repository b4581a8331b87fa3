"""The Chinese edition: its config never drifts from the English one, the links between the
editions, and how much of the current English text its catalogs translate."""

from __future__ import annotations

import io
import pathlib
import re
import sys

import yaml
from babel.messages.catalog import Catalog
from babel.messages.pofile import read_po, write_po
from by_path import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCALE = ROOT / "locale" / "zh_CN" / "LC_MESSAGES"
zh_catalogs = load("zh_catalogs", ".ci/zh_catalogs.py")
sys.path.insert(0, str(ROOT / "_ext"))
import editions  # noqa: E402

# The keys _config.zh.yml may change, and what they must be there.
ZH_ONLY = {
    ("title",): None,  # any title, in Chinese
    ("sphinx", "config", "language"): "zh_CN",
    ("sphinx", "config", "locale_dirs"): ["locale/"],
    ("sphinx", "config", "gettext_compact"): False,
}


def without(config: dict, keys) -> dict:
    config = yaml.safe_load(yaml.safe_dump(config))  # a deep copy
    for key in keys:
        *parents, last = key
        node = config
        for part in parents:
            node = node[part]
        node.pop(last, None)
    return config


def test_the_chinese_config_is_the_english_one_with_only_its_own_keys():
    english = yaml.safe_load((ROOT / "_config.yml").read_text())
    chinese = yaml.safe_load((ROOT / "_config.zh.yml").read_text())
    assert without(chinese, ZH_ONLY) == without(english, ZH_ONLY)
    for key, value in ZH_ONLY.items():
        node = chinese
        for part in key:
            node = node[part]
        if value is not None:
            assert node == value, key
    assert any("\u4e00" <= char <= "\u9fff" for char in chinese["title"])
    # Both editions read and write the same jupyter-cache, so the Chinese build executes nothing.
    assert (
        chinese["execute"]["cache"]
        == english["execute"]["cache"]
        == "_build/.jupyter_cache"
    )


def test_each_edition_links_to_the_same_page_in_the_other():
    # English at the root, Chinese under zh/: from book/03_sharding.html (in either edition),
    # the other edition's page is one folder up, then into zh/ or out of it.
    assert (
        editions.other_edition_uri("en", "book/03_sharding")
        == "zh/book/03_sharding.html"
    )
    assert (
        editions.other_edition_uri("zh_CN", "book/03_sharding")
        == "../book/03_sharding.html"
    )
    assert editions.other_edition_uri(None, "search") == "zh/search.html"


def test_a_translated_numbered_title_escapes_its_dot():
    """Sphinx parses each translation as MyST Markdown, and a title's translation must parse as a
    title: "3. 分片" is an ordered list there, so Sphinx silently keeps the English "3. Sharding".
    Written "3\\\\. 分片" in the .po file (the Markdown "3\\. 分片"), it shows as "3. 分片"."""
    numbered = re.compile(r"^\d+\. ")
    wrong = []
    for po in sorted(LOCALE.rglob("*.po")):
        with po.open("rb") as handle:
            for message in read_po(handle):
                if (
                    message.id
                    and numbered.match(message.id)
                    and numbered.match(message.string)
                ):
                    wrong.append(f"{po.name}: {message.string!r}")
    assert wrong == []


# --- coverage of the current English text by the Chinese catalogs ---------------------------


def messages(pot_dir: pathlib.Path) -> dict[str, set[str]]:
    """Every message of every template under ``pot_dir``, by page (``book/03_sharding``)."""
    found = {}
    for pot in sorted(pot_dir.rglob("*.pot")):
        with pot.open("rb") as handle:
            catalog = read_po(handle)
        found[pot.relative_to(pot_dir).with_suffix("").as_posix()] = {
            m.id for m in catalog if m.id
        }
    return found


def translated(locale_dir: pathlib.Path) -> dict[str, set[str]]:
    """The messages each page's catalog translates: a non-empty translation, not fuzzy."""
    found = {}
    for po in sorted(locale_dir.rglob("*.po")):
        with po.open("rb") as handle:
            catalog = read_po(handle)
        page = po.relative_to(locale_dir).with_suffix("").as_posix()
        found[page] = {m.id for m in catalog if m.id and m.string and not m.fuzzy}
    return found


def coverage(
    pot_dir: pathlib.Path, locale_dir: pathlib.Path = LOCALE
) -> tuple[float, dict]:
    """The share of the current messages that have a translation, and the count missing per page.

    A message whose English changed since it was translated is a new message (its translation
    is then stale: Sphinx shows the English), so it counts as missing until the catalogs are
    updated and a translator checks it.
    """
    current, done = messages(pot_dir), translated(locale_dir)
    total = sum(len(ids) for ids in current.values())
    missing = {page: len(ids - done.get(page, set())) for page, ids in current.items()}
    return (1 - sum(missing.values()) / total if total else 1.0), missing


def write_catalog(
    path: pathlib.Path, entries: dict[str, str], fuzzy: set[str] = frozenset()
):
    catalog = Catalog(locale="zh_CN")
    for msgid, msgstr in entries.items():
        catalog.add(msgid, msgstr, flags=("fuzzy",) if msgid in fuzzy else ())
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    write_po(buffer, catalog)
    path.write_bytes(buffer.getvalue())


def tiny_book(
    tmp_path, english: dict[str, str], chinese: dict[str, str], fuzzy=frozenset()
):
    pot, po = tmp_path / "pot", tmp_path / "locale"
    write_catalog(pot / "book" / "01_a.pot", dict.fromkeys(english, ""))
    write_catalog(po / "book" / "01_a.po", chinese, fuzzy)
    return pot, po


def test_a_fully_translated_catalog_covers_everything(tmp_path):
    pot, po = tiny_book(
        tmp_path, {"Mesh": "", "Sharding": ""}, {"Mesh": "网格", "Sharding": "分片"}
    )
    assert coverage(pot, po) == (1.0, {"book/01_a": 0})


def test_a_fuzzy_or_empty_translation_counts_as_missing(tmp_path):
    english = dict.fromkeys(["Mesh", "Sharding", "Replica", "Host"], "")
    chinese = {"Mesh": "网格", "Sharding": "分片", "Replica": "副本", "Host": ""}
    pot, po = tiny_book(tmp_path, english, chinese, fuzzy={"Replica"})
    assert coverage(pot, po) == (0.5, {"book/01_a": 2})


def test_an_english_edit_makes_its_translation_stale(tmp_path):
    pot, po = tiny_book(
        tmp_path,
        {"A mesh of 8 devices.": "", "Sharding": ""},
        {"A mesh of 4 devices.": "4 个设备的网格。", "Sharding": "分片"},
    )
    assert coverage(pot, po) == (0.5, {"book/01_a": 1})


def test_a_page_with_no_catalog_counts_as_untranslated(tmp_path):
    pot, po = tiny_book(tmp_path, {"Mesh": ""}, {"Mesh": "网格"})
    write_catalog(pot / "book" / "02_b.pot", {"Host": "", "Process": "", "Replica": ""})
    assert coverage(pot, po) == (0.25, {"book/01_a": 0, "book/02_b": 3})


def test_every_page_of_the_book_has_its_catalog(tmp_path):
    """The templates, regenerated from the current chapters (no execution: a few seconds), name
    the same pages as the table of contents, and each has its catalog under locale/zh_CN. (An
    English edit does not fail this test: its message is new and untranslated, which only lowers
    the coverage; python .ci/zh_catalogs.py brings it into the catalogs.)"""
    pot = zh_catalogs.build_templates(tmp_path / "gettext")
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = {toc["root"]} | {chapter["file"] for chapter in toc["chapters"]}
    assert set(messages(pot)) == pages
    assert {page for page in pages if not (LOCALE / f"{page}.po").exists()} == set()
    share, missing = coverage(pot)
    assert 0.0 <= share <= 1.0 and set(missing) == pages


def _punct(ch: str) -> bool:
    import unicodedata

    return unicodedata.category(ch)[0] in "PS"


def unclosed_bold(text: str) -> list[str]:
    """The ``**`` that CommonMark will not read as bold in ``text``: a closing ``**`` after
    punctuation and before a letter (``**归约（X）**阶段``), or an opening one after a letter and
    before punctuation (``的**（X）**``). Chinese has no spaces to end such a run, so the asterisks
    show literally, and Sphinx does not warn."""
    found = []
    marks = [m.start() for m in re.finditer(r"\*\*", text)]
    for k, at in enumerate(marks):
        before = text[at - 1] if at > 0 else " "
        after = text[at + 2] if at + 2 < len(text) else " "
        letter = lambda ch: not ch.isspace() and not _punct(ch)
        if k % 2 and _punct(before) and letter(after):
            found.append(text[max(0, at - 12) : at + 6])
        if not k % 2 and letter(before) and _punct(after):
            found.append(text[max(0, at - 6) : at + 12])
    return found


def test_unclosed_bold_finds_what_commonmark_leaves_literal():
    assert unclosed_bold("**归约分散（reduce-scatter）**阶段")
    assert unclosed_bold("我们的**（注意）**说明")
    assert not unclosed_bold("**归约分散**（reduce-scatter）阶段")
    assert not unclosed_bold("**Auto** 轴，**答案**（点击显示）")


def test_no_translation_has_bold_that_would_show_its_asterisks():
    bad = {}
    for po in sorted(LOCALE.glob("book/*.po")):
        with po.open("rb") as f:
            for message in read_po(f):
                if message.id and message.string and unclosed_bold(message.string):
                    bad.setdefault(po.stem, []).extend(unclosed_bold(message.string))
    assert not bad, bad


def test_translations_are_carried_to_a_page_that_took_the_same_english(tmp_path):
    folder = tmp_path / "locale" / "zh_CN" / "LC_MESSAGES" / "book"
    folder.mkdir(parents=True)
    old, new = Catalog(locale="zh_CN"), Catalog(locale="zh_CN")
    old.add("A pipeline.", "流水线。")
    old.obsolete["Moved away."] = old.get("A pipeline.").__class__(
        "Moved away.", "移走了。"
    )
    new.add("A pipeline.", "")
    new.add("Moved away.", "旧译", flags=["fuzzy"])
    new.add("Untranslated anywhere.", "")
    for name, catalog in (("old", old), ("new", new)):
        with (folder / f"{name}.po").open("wb") as f:
            write_po(f, catalog)
    assert zh_catalogs.carry_translations(tmp_path) == 2
    with (folder / "new.po").open("rb") as f:
        carried = {m.id: (m.string, m.fuzzy) for m in read_po(f) if m.id}
    assert carried == {
        "A pipeline.": ("流水线。", False),
        "Moved away.": ("移走了。", False),
        "Untranslated anywhere.": ("", False),
    }


def test_the_chinese_edition_covers_95_percent(tmp_path):
    """At least 95% of the current English messages have a non-empty, non-fuzzy translation. An
    English edit leaves its old translation behind (a different msgid): it counts as missing
    until python .ci/zh_catalogs.py and a translator bring it up to date."""
    share, missing = coverage(zh_catalogs.build_templates(tmp_path / "gettext"))
    behind = {page: count for page, count in missing.items() if count}
    assert share >= 0.95, (
        f"{share:.1%} translated; untranslated messages per page: {behind}"
    )
