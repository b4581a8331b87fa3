"""Where a copy of the LM recipe is imported from: the benchmarks that compare another copy
(``--recipe``: a checkout from before a change, say) with this one.

``recipe`` is the copy's folder, or its train.py. A package (``jaxdist_lm``, or a copy under
another name) is imported from the folder above it, its modules as ``NAME.train``; a copy from
before the recipe became a package (``examples/lm``, no ``__init__.py``), whose modules import
each other by bare name, from its own folder, its modules as ``train``. Either way
``python -m {prefix}train`` run in that folder runs it.
"""

from __future__ import annotations

import pathlib


def locate(recipe: str) -> tuple[pathlib.Path, str]:
    """The folder to import the copy at ``recipe`` from, and its modules' prefix."""
    path = pathlib.Path(recipe).resolve()
    folder = path.parent if path.suffix == ".py" else path
    if (folder / "__init__.py").exists():
        return folder.parent, f"{folder.name}."
    return folder, ""
