"""The "Plan your run" page's files: the planner's Python, Pyodide to run it, the page's script.

The page (``book/plan_your_run.md``) runs ``jaxdist_lessons.planning`` itself in the reader's
browser, in Pyodide (CPython compiled to WebAssembly), offline from the built book: one source
for the arithmetic. ``ship`` copies into the built book's ``_static/planner/``:

- ``book/_static/planner/`` (the page's script and style);
- Pyodide's runtime from ``node_modules/pyodide`` (``npm ci`` installs the version that
  ``package-lock.json`` pins);
- ``py/``: ``jaxdist_lessons/planning/cli.py`` and the modules it imports (standard library
  only; the recipe's ``jaxdist_lm/model_config.py`` among them), found by reading its
  imports, in their folders.

``tests/test_plan_page.py`` serves what ``ship`` writes, drives the page in headless Chromium
and compares it with the planner run here.
"""

from __future__ import annotations

import ast
import pathlib
import shutil

from sphinx.util import logging

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = "book/plan_your_run"
PAGE_FILES = ROOT / "book" / "_static" / "planner"
PYODIDE = ROOT / "node_modules" / "pyodide"
PYODIDE_FILES = (
    "pyodide.js",
    "pyodide.asm.mjs",
    "pyodide.asm.wasm",
    "python_stdlib.zip",
    "pyodide-lock.json",
)
# The packages the planner imports from: the companion and the recipe (its model_config,
# mesh_spec and run_config).
PACKAGES = ("jaxdist_lessons", "jaxdist_lm")

logger = logging.getLogger(__name__)


def module_level(tree: ast.AST):
    """The nodes a module runs when imported: not those inside its functions, whose imports
    (JAX's, for ``--check``) run only when called, never in the page."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        yield node
        yield from module_level(node)


def planner_modules(name: str = "jaxdist_lessons.planning.cli") -> list[str]:
    """``name`` and every module of the project's packages (the companion and the recipe)
    it imports, directly or not, as paths under the root without ``.py``
    (``jaxdist_lessons/planning/cli``; a package as its ``__init__``)."""
    found, todo = set(), [name]
    while todo:
        module = todo.pop()
        path = module.replace(".", "/")
        if (ROOT / path).is_dir():
            path += "/__init__"
        if path in found:
            continue
        found.add(path)
        if "." in module:  # a package's module: the package's __init__ too
            todo.append(module.rsplit(".", 1)[0])
        package = module if path.endswith("__init__") else module.rsplit(".", 1)[0]
        for node in module_level(ast.parse((ROOT / f"{path}.py").read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:  # relative: from . import x, from .x import y
                base = package.rsplit(".", node.level - 1)[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:  # a module of the package, or a name in one
                candidate = f"{base}.{alias.name}"
                exists = (ROOT / f"{candidate.replace('.', '/')}.py").exists()
                todo.append(candidate if exists else base)
    return sorted(found)


def ship(dest: pathlib.Path) -> list[pathlib.Path]:
    """Copy the page's script, Pyodide and the planner's modules into ``dest``."""
    missing = [f for f in PYODIDE_FILES if not (PYODIDE / f).exists()]
    if missing:
        raise FileNotFoundError(
            f"{PYODIDE} lacks {', '.join(missing)}: run `npm ci` in {ROOT.name}/ "
            "(the Plan your run page runs the planner in Pyodide)"
        )
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(PAGE_FILES, dest)
    (dest / "pyodide").mkdir()
    copied = [shutil.copy2(PYODIDE / f, dest / "pyodide") for f in PYODIDE_FILES]
    for m in planner_modules():
        target = dest / "py" / f"{m}.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        copied.append(shutil.copy2(ROOT / f"{m}.py", target))
    (dest / "py" / "modules.txt").write_text(
        "".join(f"{m}\n" for m in planner_modules())
    )
    return [pathlib.Path(p) for p in copied]


def add_script(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    if pagename == PAGE:
        app.add_js_file("planner/planner.js", defer="defer")
        app.add_css_file("planner/planner.css")


def copy_files(app, exception: Exception | None) -> None:
    if exception is None and app.builder.format == "html":
        try:
            ship(pathlib.Path(app.outdir) / "_static" / "planner")
        except FileNotFoundError as error:
            logger.warning(str(error))


def setup(app):
    app.connect("html-page-context", add_script)
    app.connect("build-finished", copy_files)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
