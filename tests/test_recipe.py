"""jaxdist_lessons.recipe: the LM recipe's modules, loaded from the package's link to
examples/lm (the wheel's copy on Colab)."""

import pathlib

import pytest

from jaxdist_lessons import recipe

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_recipes_module_is_the_file_in_examples():
    layout = recipe.module("layout")
    assert pathlib.Path(layout.__file__).resolve() == ROOT / "examples/lm/layout.py"
    assert layout.zigzag(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_an_unknown_module_is_named_with_the_real_ones():
    with pytest.raises(
        ModuleNotFoundError, match=r"no module 'layouts'; it has \[.*'layout'"
    ):
        recipe.module("layouts")
