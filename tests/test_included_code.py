"""Code that the book's pages include from ``.py`` files fits the page's 88 columns."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
WIDTH = 88
INCLUDE = re.compile(r"```\{literalinclude\}\s+(\S+\.py)\n((?::[^\n]*\n)*)")


def options(block: str) -> dict[str, str]:
    """The directive's ``:name: value`` options."""
    found = {}
    for line in block.splitlines():
        match = re.match(r":([\w-]+):\s*(.*)", line)
        if match:
            found[match.group(1)] = match.group(2).strip().strip("\"'")
    return found


def object_span(source: str, dotted: str) -> tuple[int, int]:
    """First and last line of ``dotted`` (``name`` or ``Class.name``) in ``source``,
    decorators included, as Sphinx's ``:pyobject:`` takes it."""
    body = ast.parse(source).body
    node = None
    for part in dotted.split("."):
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        node = next(n for n in body if isinstance(n, defs) and n.name == part)
        body = node.body
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return first, node.end_lineno


def line_ranges(spec: str, count: int) -> list[int]:
    """The 1-based line numbers a ``:lines:`` option (``1,3,5-10,20-``) picks."""
    picked = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            start, _, end = part.partition("-")
            picked += range(int(start or 1), int(end or count) + 1)
        else:
            picked.append(int(part))
    return picked


def included_lines(path: pathlib.Path, opts: dict[str, str]) -> list[tuple[int, str]]:
    """The (line number, text) pairs Sphinx's ``literalinclude`` shows of ``path``."""
    lines = list(enumerate(path.read_text().splitlines(), 1))
    if "pyobject" in opts:
        first, last = object_span(path.read_text(), opts["pyobject"])
        lines = lines[first - 1 : last]
    if "lines" in opts:
        keep = set(line_ranges(opts["lines"], len(lines)))
        lines = [pair for index, pair in enumerate(lines, 1) if index in keep]
    for option, after in (("start-at", False), ("start-after", True)):
        if option in opts:
            index = next(i for i, (_, t) in enumerate(lines) if opts[option] in t)
            lines = lines[index + after :]
    for option, at in (("end-at", True), ("end-before", False)):
        if option in opts:
            index = next(i for i, (_, t) in enumerate(lines) if opts[option] in t)
            lines = lines[: index + at]
    return lines


def includes() -> list[tuple[str, str, str, dict[str, str]]]:
    """Every ``literalinclude`` of a ``.py`` file in the book's pages: the page, the
    included file (relative to the repository), what it shows, and the options."""
    found = []
    for page in sorted(BOOK.glob("*.md")):
        for path, block in INCLUDE.findall(page.read_text()):
            opts = options(block)
            shown = (page.parent / path).resolve().relative_to(ROOT).as_posix()
            what = opts.get("pyobject") or (
                f"{opts.get('start-at') or opts.get('start-after') or 'start'}"
                f"..{opts.get('end-at') or opts.get('end-before') or 'end'}"
            )
            found.append((page.name, shown, what, opts))
    return found


INCLUDES = includes()


def test_the_pages_include_code() -> None:
    """The scan finds the pages' includes (a changed directive syntax would hide them)."""
    assert len(INCLUDES) > 50
    assert any(what == "jit_data_parallel_step" for _, _, what, _ in INCLUDES)


@pytest.mark.parametrize(
    ("page", "shown", "what", "opts"),
    INCLUDES,
    ids=[f"{page}:{shown}:{what}" for page, shown, what, _ in INCLUDES],
)
def test_included_code_fits(page: str, shown: str, what: str, opts: dict) -> None:
    """No line a page includes is wider than the page's code column."""
    long = [
        f"{page} includes {shown}:{number} ({what}): {len(text)} columns: "
        f"{text.strip()[:50]}"
        for number, text in included_lines(ROOT / shown, opts)
        if len(text.rstrip()) > WIDTH
    ]
    assert not long, "\n".join(long)


def test_line_picking() -> None:
    """``:lines:`` and the start/end options pick what Sphinx picks."""
    assert line_ranges("1,3-4,6-", 7) == [1, 3, 4, 6, 7]
    source = (
        "@decorator\ndef f():\n    pass\n\n\nclass C:\n    def g(self):\n        pass\n"
    )
    assert object_span(source, "f") == (1, 3)
    assert object_span(source, "C.g") == (7, 8)
