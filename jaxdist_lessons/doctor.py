"""Check a reader's environment: ``python -m jaxdist_lessons.doctor``.

It prints the installed versions against the ones the book is tested with, the platform,
whether an accelerator build of JAX (CUDA plugin, libtpu) is installed, the devices JAX
reports, and what ``devices.setup()`` would choose for a chapter that needs 1, 2 or 8 devices.
The tested versions live here, once: ``requirements.txt`` pins the same ones, and a test keeps
the two equal.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from collections.abc import Mapping, Sequence

from jaxdist_lessons.tables import Table

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

# Distributions that make JAX use an accelerator, by the platform they bring.
ACCELERATOR_BUILDS: dict[str, str] = {
    "jax-cuda12-plugin": "gpu",
    "jax-cuda13-plugin": "gpu",
    "jax-rocm7-plugin": "gpu",
    "libtpu": "tpu",
}

MINIMUMS = (1, 2, 8)


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution``, or ``None``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def untested(versions: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """The packages whose installed version differs from the tested one: ``{name: installed}``."""
    versions = {name: installed(name) for name in TESTED} if versions is None else versions
    return {
        name: versions.get(name) for name in TESTED if versions.get(name) != TESTED[name]
    }


def version_warning(versions: Mapping[str, str | None] | None = None) -> str | None:
    """One line naming the packages that differ from the tested versions, or ``None``."""
    differ = untested(versions)
    if not differ:
        return None
    found = ", ".join(f"{name} {version or 'missing'}" for name, version in differ.items())
    tested = ", ".join(f"{name} {TESTED[name]}" for name in differ)
    return (
        f"jaxdist: warning: this book is tested with {tested}; found {found}. Most chapters "
        "still run, but printed numbers and error messages may differ."
    )


def accelerator_builds() -> dict[str, str]:
    """The accelerator builds of JAX that are installed: ``{distribution: version}``."""
    found = {name: installed(name) for name in ACCELERATOR_BUILDS}
    return {name: version for name, version in found.items() if version is not None}


def versions_table() -> Table:
    """Installed against tested versions, one row per package."""
    rows = [
        [
            name,
            installed(name) or "missing",
            tested,
            "yes" if installed(name) == tested else "NO",
        ]
        for name, tested in TESTED.items()
    ]
    python = platform.python_version()
    rows.append(
        ["python", python, PYTHON_TESTED, "yes" if python.startswith("3.11") else "NO"]
    )
    return Table(["package", "installed", "tested", "same"], rows, title="Versions")


def choices_table(available: object, requested: int | None) -> Table:
    """What ``setup(min_devices=k)`` would choose on ``available`` for each k in ``MINIMUMS``."""
    from jaxdist_lessons import devices

    rows = []
    for minimum in MINIMUMS:
        try:
            choice = devices.choose(available, requested, minimum)
            rows.append([minimum, choice.platform, choice.count, choice.reason])
        except devices.SetupError as error:
            rows.append([minimum, "-", "-", str(error)])
    return Table(
        ["chapter needs", "platform", "devices", "why"],
        rows,
        title="What setup() would choose",
    )


def report() -> list[Table | str]:
    """Everything the doctor prints: versions, platform, accelerator builds, devices, choices.

    This starts JAX with its default devices, so run it in a fresh process (the command line),
    not in a notebook whose chapter has not called ``setup()`` yet.
    """
    import jax

    from jaxdist_lessons import devices

    builds = accelerator_builds()
    lines: list[Table | str] = [
        versions_table(),
        f"Platform: {platform.system()} {platform.machine()}, Python {sys.version.split()[0]}",
        "Accelerator build of JAX: "
        + (", ".join(f"{k} {v}" for k, v in builds.items()) or "none (CPU only)"),
    ]
    available = devices.current_devices()
    lines.append(
        f"JAX reports: {available.count} {available.platform.upper()} device(s), "
        f"kind {available.device_kind!r} (jax {jax.__version__})"
    )
    if available.platform == "cpu" and builds:
        lines.append(
            "An accelerator build is installed, but JAX found no accelerator: check the driver "
            "(nvidia-smi) and that the plugin's CUDA version matches it."
        )
    requested = devices.requested_num_devices()
    lines.append(choices_table(available, requested))
    warning = version_warning()
    if warning:
        lines.append(warning)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; exit 0 (the doctor informs, it does not judge)."""
    argparse.ArgumentParser(
        prog="python -m jaxdist_lessons.doctor", description=__doc__
    ).parse_args(argv)
    try:
        for item in report():
            print(item, end="\n\n", flush=True)
    except BrokenPipeError:  # piped into `head`, which has read enough: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
