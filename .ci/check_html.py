#!/usr/bin/env python3
"""Check the built HTML book, page by page: every figure a chapter makes is in its page, the
numbered chapters each have at least one, and no page shows stderr noise or the path of the
repository it was built in (a traceback's file names, a command typed with an absolute path).

Usage: python .ci/check_html.py [BUILD_HTML_DIR]   (default: _build/html)

A chapter's figures are its ``plots.show(...)`` calls (each displays one PNG; see
``jaxdist_lessons.plots.show``). Exits 1 and lists the problems if any.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What must never reach a page: stderr outputs, terminal colour codes, tqdm's widget warning,
# TFDS's preparation bars.
NOISE = {
    "a stderr output": re.compile(r'class="[^"]*\bstderr\b'),
    "an ANSI escape code": re.compile(r"\x1b\[|&#27;\[|&#x1b;\["),
    "tqdm's IProgress warning": re.compile(r"IProgress not found"),
    "a TFDS preparation message": re.compile(
        r"Dl Completed|Generating splits|Downloading and preparing"
    ),
}
CODE_CELL = re.compile(r"```\{code-cell\}\n(.*?)```", re.S)
IMAGE = re.compile(r'<img[^>]+src="[^"]+\.png"')


def figures_made(chapter: pathlib.Path) -> int:
    """How many figures the chapter's code displays (its ``plots.show(`` calls)."""
    return sum(
        cell.count("plots.show(") for cell in CODE_CELL.findall(chapter.read_text())
    )


def problems(
    html_dir: pathlib.Path, book_dir: pathlib.Path = ROOT / "book"
) -> list[str]:
    """Everything wrong with the built pages of the chapters in ``book_dir``."""
    found = []
    for chapter in sorted(book_dir.glob("*.md")):
        page = html_dir / "book" / f"{chapter.stem}.html"
        if not page.exists():
            found.append(f"{page}: missing")
            continue
        html = page.read_text()
        expected, images = figures_made(chapter), len(IMAGE.findall(html))
        if re.match(r"(0[1-9]|[1-9][0-9])_", chapter.name) and expected == 0:
            found.append(f"{chapter.name}: a numbered chapter with no figure")
        if images < expected:
            found.append(
                f"{page.name}: {images} images for {expected} figures the chapter makes"
            )
        machine = str(book_dir.resolve().parent)
        if machine in html:
            found.append(f"{page.name}: the build machine's path {machine}")
        found += [
            f"{page.name}: {what}"
            for what, pattern in NOISE.items()
            if pattern.search(html)
        ]
    return found


def main(argv: list[str]) -> int:
    html_dir = pathlib.Path(argv[1] if len(argv) > 1 else ROOT / "_build" / "html")
    found = problems(html_dir)
    for problem in found:
        print(f"check_html: {problem}")
    if not found:
        print(
            f"check_html: every chapter page in {html_dir} has its figures and no noise"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
