"""Count, per chapter, the visible code cells that hand the lesson's mechanics to the package.

Issue 25 asks that in every numbered chapter from 2 on, at most a third of the visible code
cells hand the mechanics (meshes, shardings, steps, strategies, loops, data, pipelines) to
`jaxdist_lessons`. Reading the compiled program, arithmetic, models, error display, figures
and exercises do not count: those are what the package is for.

A visible code cell is a `{code-cell}` without the `remove-cell` or `remove-input` tag; the
install cell and the `devices.setup` cell, which every chapter shares, are not counted. A cell
counts as "handing the mechanics" when it calls into a mechanics module of the package
(`module.name` or a name imported from one), even when the page also shows that function with
`{literalinclude}`: a reader who copies the cell still calls a package they will not install
(issue 43). The page writes the JAX, Flax, Optax, Orbax and Grain calls; a hidden cell holds
them equal to the package's tested version.

    python .ci/mechanics_count.py            # the table
    python .ci/mechanics_count.py --check    # exit 1 where a chapter is over a third
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

BOOK = Path(__file__).resolve().parent.parent / "book"

# The modules whose calls do a lesson's mechanics for the reader.
MECHANICS = {
    "accumulate",
    "benchmark",
    "data",
    "experts",
    "gradients",
    "mesh",
    "mesh_lib",
    "multihost",
    "multihost_demo",
    "oom",
    "partitioning",
    "pipeline",
    "precision",
    "profiling",
    "recompiles",
    "sequence",
    "sharding",
    "train",
    "zero",
}

# Calls into those modules that are arithmetic, tables or schedules, not mechanics: what a
# strategy should cost, how idle a schedule is. They count like `memory` and `costmodel`.
ARITHMETIC = re.compile(
    r"^(expected_\w+|\w*bytes\w*|\w*_fraction|\w*_schedule|in_flight|causal_work|capacity"
    r"|placement_rows|PLACEMENT_HEADERS|comparison_table|describe|ShardingError)$"
)

# The install cell and the setup cell, the same in every chapter.
SHARED = re.compile(r"^# On Colab or Kaggle, install|^info = devices\.setup\(", re.M)
CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.S | re.M)
TAGS = re.compile(r"^:tags:\s*\[(.*?)\]", re.M)
FROM_IMPORT = re.compile(
    r"from jaxdist_lessons\.(\w+)(?:\.\w+)* import \(?([\w\s,]+)\)?", re.M
)
IMPORT_MODULES = re.compile(r"from jaxdist_lessons import \(?([\w\s,]+)\)?", re.M)
IMPORT_AS = re.compile(r"from jaxdist_lessons import (\w+) as (\w+)")


def visible_cells(text: str) -> list[str]:
    cells = []
    for body in CELL.findall(text):
        tags = TAGS.search(body)
        hidden = tags and re.search(r"remove-(cell|input)", tags.group(1))
        if not hidden:
            cells.append(body)
    return cells


def mechanics_names(text: str) -> tuple[set[str], set[str]]:
    """(module aliases, bare names) that refer to the package's mechanics in a page."""
    modules, names = set(), set()
    for group in IMPORT_MODULES.findall(text):
        for name in re.split(r"[\s,]+", group.strip()):
            if name in MECHANICS:
                modules.add(name)
    for module, alias in IMPORT_AS.findall(text):
        if module in MECHANICS:
            modules.add(alias)
    for module, group in FROM_IMPORT.findall(text):
        if module in MECHANICS:
            names.update(n for n in re.split(r"[\s,]+", group.strip()) if n)
    return modules, names


def hands_mechanics(
    cell: str,
    modules: set[str],
    names: set[str],
) -> bool:
    code = "\n".join(
        line for line in cell.splitlines() if not line.lstrip().startswith(("#", ":"))
    )
    code = re.sub(r"^\s*(from|import) [^\n]*$", "", code, flags=re.M)
    for module in modules:
        # Not a path: `examples/train.py`, `jaxdist_lm/train.py` and `-m jaxdist_lm.train`
        # are no call into the `train` module.
        for attr in re.findall(rf"(?<![\w./]){re.escape(module)}\.(\w+)", code):
            if not ARITHMETIC.match(attr):
                return True
    for name in names - {"run", "run_where"}:
        if not ARITHMETIC.match(name) and re.search(
            rf"(?<![\w.]){re.escape(name)}\s*\(", code
        ):
            return True
    # multihost_demo.run starts a command: mechanics when it runs the package's own demo, the
    # reader's code when it runs a script from examples/.
    return bool(re.search(r"\brun(_where)?\([^)]*jaxdist_lessons", code, re.S))


def count(path: Path) -> tuple[int, int]:
    text = path.read_text()
    modules, names = mechanics_names(text)
    cells = [c for c in visible_cells(text) if not SHARED.search(c)]
    return sum(hands_mechanics(c, modules, names) for c in cells), len(cells)


def chapters() -> list[Path]:
    return sorted(p for p in BOOK.glob("[0-9][0-9]_*.md") if int(p.name[:2]) >= 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail above a third")
    args = parser.parse_args()
    over = []
    print(f"{'chapter':32} mechanics / visible")
    for path in chapters():
        k, n = count(path)
        flag = " over" if 3 * k > n else ""
        print(f"{path.stem:32} {k:3d} / {n:3d}{flag}")
        if flag:
            over.append(path.stem)
    if args.check and over:
        print("over a third:", ", ".join(over), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
