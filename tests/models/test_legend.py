"""One legend for shape suffixes (``x_BTD``), written in ``jaxdist_lessons.models``'s
docstring: every suffixed name in the package, the example scripts and the chapters' code
uses only its letters, and the recipe (which never imports the package) copies its lines."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import jaxdist_lessons.models

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / "jaxdist_lm" / "model.py"

# A lowercase name, "_", then 2 to 7 capitals: x_BTD, w_in_EDF, images_BHWC. All-caps
# constants (XLA_FLAGS) do not start lowercase, so they never match.
SUFFIXED = re.compile(r"\b[a-z][a-z0-9_]*_([A-Z]{2,7})\b")
NOT_SHAPES = {"zh_CN"}  # a locale, not an array
ENTRY = re.compile(r"^    ([A-Z](?:, [A-Z])*)  (\S.*)$")
CONTINUED = re.compile(r"^       (\S.*)$")
# A letter defined inside an entry's text: "X  ...;  L  experts".
INNER = re.compile(r";\s+([A-Z])\s")
CODE_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def legend_entries(docstring: str) -> dict[str, str]:
    """The legend's entries, ``{"B": "batch (examples in a batch)", "H, W": ...}``."""
    entries: dict[str, str] = {}
    key = None
    for line in docstring.splitlines():
        if match := ENTRY.match(line):
            key = match.group(1)
            entries[key] = match.group(2)
        elif key and (match := CONTINUED.match(line)):
            entries[key] += " " + match.group(1)
        else:
            key = None
    return entries


def legend_letters(entries: dict[str, str]) -> set[str]:
    """Every letter the legend defines."""
    letters = set()
    for key, text in entries.items():
        letters.update(key.split(", "))
        letters.update(INNER.findall(text))
    return letters


def bad_names(source: str, letters: set[str]) -> set[str]:
    """Suffixed names in ``source`` with a letter the legend does not define."""
    return {
        match.group(0)
        for match in SUFFIXED.finditer(source)
        if match.group(0) not in NOT_SHAPES and set(match.group(1)) - letters
    }


# Names from older legends made only of letters this one still has, but with another
# meaning (K was a head's width, C a capacity, H a head's width, I an image's channels):
# the letter check cannot see them, so they are listed here.
RETIRED = {
    "q_BTKGH",
    "k_BSKH",
    "x_BTH",
    "position_TH",
    "q_BTNK",
    "k_BTJK",
    "out_BTNK",
    "w_DNK",
    "w_NKD",
    "angles_TK",
    "images_BHWI",
    "image_HWI",
    "dispatch_TEC",
    "combine_TEC",
    "slot_RTC",
    "x_ECD",
    "y_ECD",
    "x_XLCD",
    "buffer_ECD",
    "dispatch_BGTEC",
    "combine_BGTEC",
    "x_EBGCD",
    "h_EBGCF",
}


def retired_names(source: str) -> set[str]:
    """Names in ``source`` that an older legend spelled."""
    return {match.group(0) for match in SUFFIXED.finditer(source)} & RETIRED


def sources() -> list[tuple[str, str]]:
    """(where, code) for every Python file of the package, the recipe and the examples,
    and every chapter's code cells."""
    found = [
        (str(path.relative_to(ROOT)), path.read_text())
        for folder in ("jaxdist_lessons", "jaxdist_lm", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]
    for page in sorted((ROOT / "book").glob("*.md")):
        cells = CODE_CELL.findall(page.read_text())
        found.append((str(page.relative_to(ROOT)), "\n".join(cells)))
    return found


PACKAGE = legend_entries(jaxdist_lessons.models.__doc__)
LETTERS = legend_letters(PACKAGE)


def test_the_legend_gives_each_letter_one_meaning() -> None:
    keys = [letter for key in PACKAGE for letter in key.split(", ")]
    assert len(keys) == len(set(keys))
    assert sorted(LETTERS) == sorted("BTSDNKQAFVOEMRGXLUYHWCP")
    assert PACKAGE["K"].startswith("key/value heads")  # as in STYLE.md, item 4
    assert PACKAGE["A"] == "width of one attention head"
    assert PACKAGE["H, W, C"].endswith("colour channels (images only)")
    assert PACKAGE["T"].endswith("or a routing group's tokens")  # a continued line


def test_the_scanner_finds_a_planted_bad_name() -> None:
    planted = 'x_BTD = 1\nlogits_BZ = x_BTD\nos.environ["XLA_FLAGS"]\nlang = "zh_CN"\n'
    assert bad_names(planted, LETTERS) == {"logits_BZ"}
    assert bad_names("w_in_EDF, images_BHWC, choice_RTE, x_XLMD", LETTERS) == set()
    assert bad_names("q_BTNH", LETTERS - {"H"}) == {"q_BTNH"}
    assert retired_names("x_BTD, dispatch_TEC, images_BHWC, q_BTKGH") == {
        "dispatch_TEC",
        "q_BTKGH",
    }


def test_the_scan_sees_the_package_pages_and_recipe() -> None:
    scanned = dict(sources())
    assert "x_BTD" in scanned["jaxdist_lm/model.py"]
    assert "choice_RTE" in scanned["book/13_experts.md"]
    assert "jaxdist_lessons/experts.py" in scanned


@pytest.mark.parametrize("where, code", sources(), ids=lambda x: x[:40])
def test_every_suffix_uses_the_legend(where: str, code: str) -> None:
    assert bad_names(code, LETTERS) == set(), f"{where}: letters outside the legend"
    assert retired_names(code) == set(), f"{where}: names from an older legend"


def test_the_recipe_copies_the_legend_lines_it_uses() -> None:
    recipe = legend_entries(
        ast.get_docstring(ast.parse(RECIPE.read_text()), clean=False)
    )
    assert {"B", "T", "D", "N", "K", "Q", "A", "E", "M", "R", "G"} <= recipe.keys()
    for key, text in recipe.items():
        assert text == PACKAGE[key], f"the recipe's {key!r} differs from the package's"
    used = {
        letter
        for match in SUFFIXED.finditer(RECIPE.read_text())
        for letter in match.group(1)
    }
    assert used <= legend_letters(recipe)
