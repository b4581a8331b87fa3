#!/usr/bin/env python3
"""Check the built HTML book, page by page: every figure a chapter makes is in its page, the
numbered chapters each have at least one, no page shows stderr noise or the path of the
repository it was built in (a traceback's file names, a command typed with an absolute path),
and no line of code is wider than the page's code column.

Usage: python .ci/check_html.py [--code-only] [BUILD_HTML_DIR]   (default: _build/html)

``--code-only`` runs the code-width check alone, which a build that executes nothing (its
pages have no outputs, so no figures) is enough for.

A chapter's figures are its ``plots.show(...)`` calls (each displays one PNG; see
``jaxdist_lessons.plots.show``). The code is every block that shows code, cell inputs and
the sources that ``{literalinclude}`` or a fenced block puts in a page, not a cell's output
(which may scroll); a line over CODE_WIDTH (ruff's line length, the width a code cell shows
whole at the theme's default width) is reported with where it comes from: the chapter's
line, or the included file's line and function. Exits 1 and lists the problems if any.
"""

from __future__ import annotations

import ast
import html.parser
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
# The columns a code block shows without a sideways scroll: pyproject.toml's line-length.
CODE_WIDTH = 88
# A literalinclude in a chapter: the file (relative to the chapter) and its options.
INCLUDE = re.compile(r"```\{literalinclude\}\s+(\S+)\n((?::[^\n]*\n)*)")


class CodeBlocks(html.parser.HTMLParser):
    """The text of each code block of a page (a ``<pre>`` in a ``highlight-*`` div), leaving
    out the cells' outputs (inside a ``cell_output`` div)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.divs: list[str] = []  # the class attribute of each open <div>
        self.blocks: list[str] = []
        self.inside: list[str] | None = None  # the text of the <pre> being read

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "div":
            self.divs.append(dict(attrs).get("class") or "")
        elif tag == "pre" and self.inside is None and len(self.divs) > 1:
            # Pygments' <div class="highlight"> inside <div class="highlight-LANG ...">
            highlighted = self.divs[-1].split()[:1] == ["highlight"]
            language = any(c.startswith("highlight-") for c in self.divs[-2].split())
            in_output = any("cell_output" in d.split() for d in self.divs)
            if highlighted and language and not in_output:
                self.inside = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self.divs:
            self.divs.pop()
        elif tag == "pre" and self.inside is not None:
            self.blocks.append("".join(self.inside))
            self.inside = None

    def handle_data(self, data: str) -> None:
        if self.inside is not None:
            self.inside.append(data)


def code_blocks(html_text: str) -> list[str]:
    """The code a page shows, one string per block."""
    parser = CodeBlocks()
    parser.feed(html_text)
    parser.close()
    return parser.blocks


def definitions(source: str) -> dict[str, tuple[int, int]]:
    """The first and last line of each function and class of a Python file, by qualified
    name (``Class.method``)."""
    spans = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                spans[name] = (start, child.end_lineno or child.lineno)
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return spans


def source_of(line: str, chapter: pathlib.Path) -> str:
    """Where a line of a page's code comes from: the chapter's line, or an included file's
    line and the function or class that holds it; empty if none holds it."""
    text = chapter.read_text()
    for number, each in enumerate(text.splitlines(), 1):
        if each.rstrip() == line:
            return f"{chapter.name}:{number}"
    root = chapter.parent.parent
    for path, options in INCLUDE.findall(text):
        included = (chapter.parent / path).resolve()
        if not included.is_file():
            continue
        source = included.read_text()
        spans = definitions(source) if included.suffix == ".py" else {}
        shown_object = re.search(r":pyobject:\s*(\S+)", options)
        first, last = (
            spans.get(shown_object.group(1), (1, 10**9)) if shown_object else (1, 10**9)
        )
        for number, each in enumerate(source.splitlines(), 1):
            if first <= number <= last and each.strip() == line.strip():
                shown = (
                    included.relative_to(root)
                    if included.is_relative_to(root)
                    else included
                )
                holders = [n for n, (a, b) in spans.items() if a <= number <= b]
                where = f" ({max(holders, key=len)})" if holders else ""
                return f"{shown}:{number}{where}"
    return ""


def long_code_lines(
    html_text: str, chapter: pathlib.Path, width: int = CODE_WIDTH
) -> list[str]:
    """Each line of the page's code wider than ``width``: its block, line, length and
    source."""
    found = []
    for block_number, block in enumerate(code_blocks(html_text), 1):
        for line_number, line in enumerate(block.rstrip("\n").split("\n"), 1):
            line = line.rstrip()
            if len(line) > width:
                source = source_of(line, chapter)
                found.append(
                    f"code block {block_number}, line {line_number}: {len(line)} "
                    f"columns (over {width})"
                    + (f", from {source}" if source else "")
                    + f": {line.strip()[:60]}"
                )
    return found


def figures_made(chapter: pathlib.Path) -> int:
    """How many figures the chapter's code displays (its ``plots.show(`` calls)."""
    return sum(
        cell.count("plots.show(") for cell in CODE_CELL.findall(chapter.read_text())
    )


def problems(
    html_dir: pathlib.Path,
    book_dir: pathlib.Path = ROOT / "book",
    code_only: bool = False,
) -> list[str]:
    """Everything wrong with the built pages of the chapters in ``book_dir`` (with
    ``code_only``, only their code's width)."""
    found = []
    for chapter in sorted(book_dir.glob("*.md")):
        page = html_dir / "book" / f"{chapter.stem}.html"
        if not page.exists():
            found.append(f"{page}: missing")
            continue
        html = page.read_text()
        if code_only:
            found += [f"{page.name}: {line}" for line in long_code_lines(html, chapter)]
            continue
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
        found += [f"{page.name}: {line}" for line in long_code_lines(html, chapter)]
    return found


INCLUDED = re.compile(r"from (?!\S+\.md:)(\S+):(\d+)(?: \(([^)]+)\))?: ")


def included_summary(found: list[str]) -> list[str]:
    """The long lines that come from included files, once each, grouped by file: they are
    fixed in the file, not in the page."""
    by_file: dict[str, dict[str, dict[int, None]]] = {}
    for problem in found:
        match = INCLUDED.search(problem)
        if match:
            path, line, holder = match.groups()
            holders = by_file.setdefault(path, {})
            holders.setdefault(holder or "", {})[int(line)] = None
    return [
        f"{path}: "
        + "; ".join(
            f"{holder} " * bool(holder)
            + f"line{'s' * (len(lines) > 1)} {', '.join(map(str, sorted(lines)))}"
            for holder, lines in holders.items()
        )
        for path, holders in sorted(by_file.items())
    ]


def main(argv: list[str]) -> int:
    code_only = "--code-only" in argv
    paths = [a for a in argv[1:] if a != "--code-only"]
    html_dir = pathlib.Path(paths[0] if paths else ROOT / "_build" / "html")
    found = problems(html_dir, code_only=code_only)
    for problem in found:
        print(f"check_html: {problem}")
    summary = included_summary(found)
    if summary:
        print(
            f"check_html: code over {CODE_WIDTH} columns that pages include, "
            "to fix in its file:"
        )
        for each in summary:
            print(f"check_html:   {each}")
    if not found:
        print(
            f"check_html: every chapter page in {html_dir} has its figures, "
            f"no noise and no code over {CODE_WIDTH} columns"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
