"""Check a reader's environment: ``python -m jaxdist_lessons.doctor``.

It prints the installed versions against the ones the book is tested with, the platform,
whether an accelerator build of JAX (CUDA plugin, libtpu) is installed, the devices JAX
reports, and what ``devices.setup()`` would choose for a chapter that needs 1, 2 or 8 devices.
The tested versions live in ``versions``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence

from jaxdist_lessons import devices
from jaxdist_lessons.tables import Table
from jaxdist_lessons.versions import (
    PYTHON_TESTED,
    TESTED,
    installed,
    version_warning,
)

# Distributions that make JAX use an accelerator, by the platform they bring.
ACCELERATOR_BUILDS: dict[str, str] = {
    "jax-cuda12-plugin": "gpu",
    "jax-cuda13-plugin": "gpu",
    "jax-rocm7-plugin": "gpu",
    "libtpu": "tpu",
}

MINIMUMS = (1, 2, 8)


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
