"""How long each page of the book takes to read and run: an estimate from its words and code cells.

The preface prints one row per page of the table of contents. The estimate is deliberately plain:
``WORDS_PER_MINUTE`` words of prose a minute, and ``MINUTES_PER_CELL`` for each code cell a reader
sees (reading the code and its output, and running it), rounded up to 5 minutes. Cells tagged
``remove-cell`` are hidden in the built book and not counted.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

from jaxdist_lessons.tables import Table

WORDS_PER_MINUTE = 200  # an assumption: careful reading of technical prose
MINUTES_PER_CELL = 1.0  # an assumption: read a cell and its output, and run it

_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_TOC_FILE = re.compile(r"^\s*(?:-\s*)?(?:root|file):\s*(\S+)\s*$", re.M)


@dataclasses.dataclass(frozen=True)
class PageSize:
    """A page's title, its words of prose and the code cells a reader sees."""

    name: str
    title: str
    words: int
    code_cells: int

    @property
    def minutes(self) -> int:
        """The estimated time to read and run the page, rounded up to 5 minutes."""
        return estimate_minutes(self.words, self.code_cells)


def estimate_minutes(words: int, code_cells: int) -> int:
    """``words / WORDS_PER_MINUTE + code_cells * MINUTES_PER_CELL``, rounded up to a multiple of 5."""
    raw = words / WORDS_PER_MINUTE + code_cells * MINUTES_PER_CELL
    return max(5, 5 * math.ceil(raw / 5))


def page_size(path: pathlib.Path) -> PageSize:
    """Words and visible code cells of one MyST Markdown page (its front matter left out)."""
    text = pathlib.Path(path).read_text()
    if text.startswith("---\n"):
        text = text.split("\n---\n", 1)[1]
    cells = _CELL.findall(text)
    visible = [c for c in cells if "remove-cell" not in c.split("\n", 1)[0]]
    prose = _CELL.sub("", text)
    title = next(
        (line[2:].strip() for line in prose.splitlines() if line.startswith("# ")),
        pathlib.Path(path).stem,
    )
    return PageSize(pathlib.Path(path).stem, title, len(prose.split()), len(visible))


def toc_pages(root: pathlib.Path) -> list[str]:
    """The pages of ``_toc.yml`` in ``root``, in order, as paths without suffix (``book/01_why_distribute``)."""
    return _TOC_FILE.findall((pathlib.Path(root) / "_toc.yml").read_text())


def book_sizes(root: pathlib.Path) -> list[PageSize]:
    """``page_size`` of every page in the table of contents, in its order."""
    return [page_size(pathlib.Path(root) / f"{page}.md") for page in toc_pages(root)]


def reading_table(sizes: list[PageSize], title: str = "") -> Table:
    """One row per page: title, words, visible code cells and the estimated minutes."""
    return Table(
        ["page", "words", "code cells", "about (minutes)"],
        [[s.title, s.words, s.code_cells, s.minutes] for s in sizes],
        title=title,
    )
