"""One home for each mechanism: what the LM recipe (jaxdist_lm) runs is defined there, and
the package imports it (``from jaxdist_lm import ...``) rather than keeping a second copy.

A name the recipe defines at the top of a module and the package defines again is a twin,
unless it is listed below with the reason the two are different things. A new twin fails
this test: load the recipe's, or name the package's for what it is."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "jaxdist_lm"

# name -> why the package's is not the recipe's
DIFFERENT = {
    "main": "each script's entry point",
    "parse_args": "each command's own flags",
    "setup": "devices.setup chooses a chapter's devices; train.setup builds a run",
    "Attention": "the vision transformer's attention (chapter 09), not the LM's",
    "Block": "the chapters' small models' blocks",
    "MLP": "the chapters' small models' MLPs",
    "DTYPES": "convert.py's checkpoint dtypes by name; memory.DTYPES are byte sizes",
    "batches": "chapter 05's image batches; the recipe's are token rows",
    "blocks": "attention.blocks cuts attention into blocks; sharding.blocks shows shards",
    "constrain": "the chapters' models pin their own logical axes",
    "make_train_step": "chapter 09's step under its rule sets; the recipe's step.py",
    "ring_attention": "chapter 12's reference, one block a step; the recipe's is blockwise",
    "train_step": "chapter 05's image classifier's step; the recipe's is the LM's",
}


def recipe_names(tree: ast.Module, in_recipe: bool) -> set[str]:
    """The names a module binds to the recipe's: ``from jaxdist_lm import layout as lm``
    binds ``lm``, ``from jaxdist_lm.model_config import PRESETS`` binds ``PRESETS``,
    ``import jaxdist_lm.layout`` binds ``jaxdist_lm``, and in the recipe's own modules
    ``from . import model_config`` binds ``model_config``; anywhere in the module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            (node.module or "").split(".")[0] == "jaxdist_lm"
            or (in_recipe and node.level > 0)
        ):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {
                a.asname or a.name.split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == "jaxdist_lm"
            }
    return names


def top_level_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    from_recipe = recipe_names(tree, path.is_relative_to(RECIPE))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            used = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            if used & from_recipe:
                continue  # computed from the recipe's own: not a second definition
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def defined(paths) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in paths:
        for name in top_level_names(path):
            out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def test_the_package_defines_nothing_the_recipe_defines():
    recipe = defined(sorted(RECIPE.glob("*.py")))
    package = defined(sorted((ROOT / "jaxdist_lessons").rglob("*.py")))
    twins = {
        name: (recipe[name], package[name])
        for name in set(recipe) & set(package)
        if name not in DIFFERENT
    }
    assert not twins, twins


def test_every_listed_difference_is_still_a_twin():
    recipe = defined(sorted(RECIPE.glob("*.py")))
    package = defined(sorted((ROOT / "jaxdist_lessons").rglob("*.py")))
    assert set(DIFFERENT) <= set(recipe) & set(package)
