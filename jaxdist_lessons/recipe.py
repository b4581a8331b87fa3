"""The LM recipe's own modules (``examples/lm``), loaded by path: one home for what the recipe
runs. The package reads the recipe; ``examples/`` never imports the package and runs alone.

``jaxdist_lessons/lm`` is a link to ``examples/lm``, and a wheel of the package holds its files
(``package-data`` in ``pyproject.toml``), so the chapters find the recipe on Colab too. The
recipe's modules import each other by bare name (``import model_config``), as a reader's copy
of the folder does: their folder goes on ``sys.path`` once.
"""

from __future__ import annotations

import importlib
import pathlib
import sys
from types import ModuleType

DIR = pathlib.Path(__file__).resolve().parent / "lm"


def module(name: str) -> ModuleType:
    """The recipe's module ``name`` (``"layout"`` for ``examples/lm/layout.py``)."""
    if not (DIR / f"{name}.py").exists():
        found = sorted(p.stem for p in DIR.glob("*.py"))
        raise ModuleNotFoundError(f"the recipe has no module {name!r}; it has {found}")
    if str(DIR) not in sys.path:
        sys.path.insert(0, str(DIR))
    return importlib.import_module(name)
