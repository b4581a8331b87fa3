"""One home for each mechanism: what the LM recipe (examples/lm) runs is defined there, and
the package loads it (``jaxdist_lessons.recipe``) rather than keeping a second copy.

A name the recipe defines at the top of a module and the package defines again is a twin,
unless it is listed below with the reason the two are different things. A new twin fails
this test: load the recipe's, or name the package's for what it is."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE_MODULES = [p.stem for p in (ROOT / "examples" / "lm").glob("*.py")]

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


def top_level_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            value = ast.unparse(node.value)
            if value.startswith("recipe.module(") or any(
                f"{stem}." in value for stem in RECIPE_MODULES
            ):
                continue  # computed from the recipe's own: not a second definition
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def defined(paths) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in paths:
        if path.is_symlink() or path.relative_to(ROOT).parts[:2] == (
            "jaxdist_lessons",
            "lm",
        ):
            continue
        for name in top_level_names(path):
            out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def test_the_package_defines_nothing_the_recipe_defines():
    recipe = defined(sorted((ROOT / "examples" / "lm").glob("*.py")))
    package = defined(sorted((ROOT / "jaxdist_lessons").rglob("*.py")))
    twins = {
        name: (recipe[name], package[name])
        for name in set(recipe) & set(package)
        if name not in DIFFERENT
    }
    assert not twins, twins


def test_every_listed_difference_is_still_a_twin():
    recipe = defined(sorted((ROOT / "examples" / "lm").glob("*.py")))
    package = defined(sorted((ROOT / "jaxdist_lessons").rglob("*.py")))
    assert set(DIFFERENT) <= set(recipe) & set(package)
