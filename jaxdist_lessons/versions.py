"""The versions the book is tested with, once: ``requirements.txt`` pins the same ones (a test
keeps the two equal), ``devices.setup`` warns when the installed ones differ, and ``doctor``
prints them side by side.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping

# The versions requirements.txt pins and CI tests (tests/test_doctor.py keeps them equal).
TESTED: dict[str, str] = {
    "jax": "0.10.2",
    "jaxlib": "0.10.2",
    "flax": "0.12.8",
    "optax": "0.2.8",
    "orbax-checkpoint": "0.12.8",
    "tensorflow-datasets": "4.9.10",
}
PYTHON_TESTED = "3.11"


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution``, or ``None``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def untested(versions: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """The packages whose installed version differs from the tested one: ``{name: installed}``."""
    versions = (
        {name: installed(name) for name in TESTED} if versions is None else versions
    )
    return {
        name: versions.get(name)
        for name in TESTED
        if versions.get(name) != TESTED[name]
    }


def version_warning(versions: Mapping[str, str | None] | None = None) -> str | None:
    """One line naming the packages that differ from the tested versions, or ``None``."""
    differ = untested(versions)
    if not differ:
        return None
    found = ", ".join(
        f"{name} {version or 'missing'}" for name, version in differ.items()
    )
    tested = ", ".join(f"{name} {TESTED[name]}" for name in differ)
    return (
        f"jaxdist: warning: this book is tested with {tested}; found {found}. Most chapters "
        "still run, but printed numbers and error messages may differ."
    )
