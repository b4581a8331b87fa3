"""Check a reader's environment: ``python -m jaxdist_lessons.doctor``.

It prints the installed versions against the ones the book is tested with, the platform,
whether an accelerator build of JAX (CUDA plugin, libtpu) is installed, the devices JAX
reports, the chip (its memory and dense bfloat16 peak, from ``hardware.CHIPS``), what
``devices.setup()`` would choose for each chapter, and what is missing for the chapters that
start jobs of several processes. The tested versions live in ``versions``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import sys
from collections.abc import Sequence

from jaxdist_lessons import devices, hardware
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

# Each page of the book, in its order, and the fewest devices its setup() asks for
# (tests/test_doctor.py reads them from the book's setup cells).
CHAPTER_MIN_DEVICES: dict[str, int] = {
    "00_preface": 1,
    "setup": 1,
    "01_why_distribute": 1,
    "pytorch": 1,
    "02_device_mesh": 1,
    "03_sharding": 2,
    "04_gradients": 2,
    "05_resnet50": 1,
    "06_performance": 2,
    "07_troubleshooting": 2,
    "08_multi_host": 2,
    "gpu_clusters": 2,
    "tpus": 2,
    "09_flax_partitioning": 4,
    "10_language_model": 2,
    "11_pipelines_mesh_shape": 4,
    "12_long_sequences": 2,
    "13_experts": 2,
    "decision_guide": 4,
    "plan_your_run": 1,
    "cheatsheet": 1,
    "appendix_seed_errata": 2,
}


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


def chip_line(available: devices.DeviceInfo, bytes_limit: int | None) -> str:
    """The accelerator JAX found: its memory (what JAX may use, and the datasheet's) and its
    dense bfloat16 peak, or why there is none."""
    if available.platform == "cpu":
        return "Chip: none (CPU devices; the chapters simulate as many as they need)"
    chip = hardware.chip_for_kind(available.device_kind)
    usable = (
        f"{bytes_limit / 1e9:.1f} GB ({bytes_limit / 2**30:.1f} GiB) usable by JAX"
        if bytes_limit
        else ""
    )
    if chip is None:
        return (
            f"Chip: {available.device_kind!r} is not in hardware.CHIPS"
            + (f" ({usable})" if usable else "")
            + ": give its peak to the benchmarks with --peak-tflops"
        )
    sheet = f"{chip.memory:g} {chip.memory_unit} on the datasheet"
    memory = f"{usable}, {sheet}" if usable else sheet
    return (
        f"Chip: {chip.name} ({available.device_kind!r}), {memory}; "
        f"dense bfloat16 peak {chip.peak_bf16_flops / 1e12:g} TFLOP/s"
    )


def chapters_table(available: devices.DeviceInfo, requested: int | None) -> Table:
    """What ``setup()`` would choose on ``available`` for each page of the book."""
    rows = []
    for chapter, minimum in CHAPTER_MIN_DEVICES.items():
        try:
            choice = devices.choose(available, requested, minimum)
            kind = "simulated CPU" if choice.simulated else choice.platform.upper()
            rows.append([chapter, minimum, f"{choice.count} {kind}"])
        except devices.SetupError as error:
            rows.append([chapter, minimum, f"stops: {str(error).splitlines()[0]}"])
    return Table(
        ["chapter", "needs", "will use"], rows, title="What each chapter will use"
    )


def loopback_socket() -> str | None:
    """``None`` if a TCP socket opens on the loopback, else the error."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen()
    except OSError as error:
        return str(error)
    return None


def missing(socket_error: str | None = None) -> list[str]:
    """What the book's chapters need that this machine lacks: tested packages, ``mpirun``,
    and a TCP socket on the loopback (every multi-process job and every Jupyter kernel
    talks over one). ``socket_error`` defaults to trying one."""
    found = [
        f"package {name} {v}" for name, v in TESTED.items() if installed(name) is None
    ]
    if shutil.which("mpirun") is None:
        found.append(
            "mpirun (Open MPI): chapter 08_multi_host's jobs and the recipe's mpirun runs "
            "(chapters 10 to 13) start with it"
        )
    error = loopback_socket() if socket_error is None else socket_error
    if error:
        found.append(
            f"a TCP socket on the loopback ({error}): jax.distributed's jobs (chapters 07, "
            "08, 10 to 13, gpu_clusters) and Jupyter kernels need one"
        )
    return found


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
    device = jax.devices()[0]
    stats = device.memory_stats() if available.platform != "cpu" else None
    lines.append(chip_line(available, (stats or {}).get("bytes_limit")))
    requested = devices.requested_num_devices()
    lines.append(choices_table(available, requested))
    lines.append(chapters_table(available, requested))
    gaps = missing()
    lines.append("Missing: " + ("nothing" if not gaps else "\n- " + "\n- ".join(gaps)))
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
