"""Scripts that are not modules of the package (``.ci/``, ``benchmarks/``, ``book/conftest.py``),
imported by their path for their tests."""

import importlib.machinery
import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name: str, relative: str) -> ModuleType:
    """The script at ``relative`` (to the repository's root), imported as ``name``;
    one without ``.py`` (``.ci/sweep_counts``) too."""
    loader = importlib.machinery.SourceFileLoader(name, str(ROOT / relative))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where a dataclass looks its module up
    spec.loader.exec_module(module)
    return module
