"""One way in to the LM recipe: the package ``jaxdist_lm`` (the folder jaxdist_lm/ at the
repository's root, installed with the project and shipped in its wheel).

Its modules import each other relatively and nothing of the book's package, so a reader's
copy of the folder runs under any name; the book's package imports it by its name,
``jaxdist_lm``, and nothing else: no links to its files, no ``sys.path`` entries, no
loading by path. Each of its files is then one module, whoever imported it first."""

import ast
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "jaxdist_lm"
PACKAGE = ROOT / "jaxdist_lessons"
STEMS = {p.stem for p in RECIPE.glob("*.py")} - {"__init__"}


def imports(path: pathlib.Path):
    """Every import statement of ``path``'s module, anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def absolute_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names, absolute ones only (a relative import
    names none)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module] if node.level == 0 and node.module else []


def test_the_recipe_has_its_files_and_no_folder_links_to_them():
    assert {"train", "model", "model_config", "run_config", "mesh_spec"} <= STEMS
    linked = []
    for top in ("jaxdist_lessons", "jaxdist_lm", "tests", "benchmarks", "book"):
        for folder, dirs, files in os.walk(ROOT / top):
            linked += [
                str((pathlib.Path(folder) / name).relative_to(ROOT))
                for name in dirs + files
                if (pathlib.Path(folder) / name).is_symlink()
            ]
    assert linked == [], linked


def test_the_recipe_imports_itself_relatively_and_nothing_of_the_package():
    """A reader copies jaxdist_lm/ alone, and may rename it: no module of it imports
    jaxdist_lessons, names jaxdist_lm, or imports a sibling by its bare name."""
    modules = sorted(RECIPE.glob("*.py"))
    assert len(modules) > len(STEMS)  # __init__.py too
    for path in modules:
        for node in imports(path):
            for name in absolute_names(node):
                top = name.split(".")[0]
                where = f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                assert top not in ("jaxdist_lessons", "jaxdist_lm"), where
                assert top not in STEMS, where
        assert "sys.path" not in path.read_text(), path


def test_the_package_imports_the_recipe_by_its_name_only():
    """Every import of the recipe's modules in jaxdist_lessons/ is spelled
    ``jaxdist_lm...``: no bare name of one of its modules, no ``sys.path`` (in code or in
    a program it runs), no loading of a file by its path, and ``import_module`` only for
    the package's own modules."""
    found = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in absolute_names(node):
                    assert name.split(".")[0] not in STEMS, f"{where}: {name}"
                    found += name.split(".")[0] == "jaxdist_lm"
            elif isinstance(node, ast.Attribute):
                assert ast.unparse(node) != "sys.path", where
                assert node.attr != "spec_from_file_location", where
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "sys.path" not in node.value, where
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                "import_module"
            ):
                name = ast.unparse(node.args[0])
                own = name.startswith("'jaxdist_lessons.") or "{__package__}" in name
                assert own, f"{where}: import_module({name})"
    assert found >= 10  # the planner, hlo, sequence, ... import it


def test_each_recipe_file_is_one_module():
    """After the package's importers of the recipe and the recipe's train.py, each file of
    jaxdist_lm/ is in sys.modules once, under its name in the package ``jaxdist_lm``."""
    import jaxdist_lessons.hlo
    import jaxdist_lessons.planning.layouts
    import jaxdist_lessons.sequence  # noqa: F401
    import jaxdist_lm.train  # noqa: F401

    by_file: dict[pathlib.Path, list[str]] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and pathlib.Path(file).resolve().is_relative_to(RECIPE):
            by_file.setdefault(pathlib.Path(file).resolve(), []).append(name)
    assert {RECIPE / f"{s}.py" for s in ("train", "model_config", "mesh_spec")} <= set(
        by_file
    )
    for file, names in by_file.items():
        expected = (
            "jaxdist_lm" if file.name == "__init__.py" else f"jaxdist_lm.{file.stem}"
        )
        assert names == [expected], (file, names)


def test_a_copy_under_another_name_runs(tmp_path):
    """jaxdist_lm/ copied to myrecipe/ runs as ``python -m myrecipe.train``, where neither
    jaxdist_lm nor jaxdist_lessons can be imported (a folder of each name that raises
    shadows the installed ones)."""
    shutil.copytree(
        RECIPE, tmp_path / "myrecipe", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("jaxdist_lm", "jaxdist_lessons"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('the copy imported {name}')\n"
        )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "myrecipe.train", "--help"],
        cwd=tmp_path,
        env={**env, "PYTHONNOUSERSITE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:") and "--mesh" in done.stdout
