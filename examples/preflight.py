"""Before a GPU job starts: is this node what the job needs? One command, one report.

    python examples/preflight.py                       # this node
    srun --ntasks-per-node=1 python examples/preflight.py --expect-gpus 8

It prints, and checks where it can:

- the GPUs (``nvidia-smi``): kind, memory and driver, and the driver against the
  installed JAX CUDA wheel's needs (JAX's installation guide: a driver >= 525 for CUDA
  12 and >= 580 for CUDA 13, on Linux, https://docs.jax.dev/en/latest/installation.html);
- the CUDA version the driver supports, and the CUDA, cuDNN and NCCL wheels pip
  installed (the NCCL that JAX's CUDA plugin loads);
- the links between the GPUs (``nvidia-smi topo -m``): NVLink between every pair, or
  not;
- the InfiniBand adapters (``/sys/class/infiniband``) and their ports' state;
- the XLA, JAX, NCCL and CUDA variables set;
- known traps: ``LD_LIBRARY_PATH`` set beside pip's CUDA libraries (it can shadow them,
  the installation guide warns); a SLURM task that sees a single GPU while others share
  its node (under srun JAX gives task i the GPU numbered SLURM_LOCALID among those it
  sees, so every task must see them all; --gpus-per-task=1 breaks that,
  https://github.com/jax-ml/jax/issues/28194, as examples/slurm/gpu.sbatch says);
  and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` above what the processes sharing a GPU can
  each have (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).

It exits 1 when a check fails (a driver too old, fewer GPUs than --expect-gpus, an
InfiniBand port down), 0 otherwise; warnings do not fail it. Without a GPU it says so
and exits 0. Standard library only: it runs before (and without) JAX.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping

# The driver each JAX CUDA wheel needs on Linux (JAX's installation guide).
DRIVER_NEEDED = {"jax-cuda12-plugin": 525, "jax-cuda13-plugin": 580}
# pip's CUDA libraries that JAX's CUDA wheels bring.
CUDA_WHEELS = (
    "nvidia-cuda-runtime-cu12",
    "nvidia-cudnn-cu12",
    "nvidia-nccl-cu12",
    "nvidia-cuda-runtime",
    "nvidia-cudnn-cu13",
    "nvidia-nccl-cu13",
)
VARIABLES = re.compile(r"^(XLA_|JAX_|NCCL_|CUDA_|TF_CPP_|SLURM_GPUS|SLURM_NTASKS_PER)")
IB = pathlib.Path("/sys/class/infiniband")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of the report: "ok", "WARN" or "FAIL", what was checked, and found."""

    level: str
    what: str
    detail: str


@dataclasses.dataclass(frozen=True)
class Node:
    """What the checks read, gathered by ``gather`` (or given by a test)."""

    smi: str | None  # nvidia-smi --query-gpu=name,memory.total,driver_version ...
    smi_header: str | None  # plain nvidia-smi: its header names the CUDA version
    topo: str | None  # nvidia-smi topo -m
    wheels: Mapping[str, str]  # distribution -> version
    environ: Mapping[str, str]
    infiniband: list[tuple[str, str, str]]  # (adapter, port, state)


def gpus(smi: str) -> list[dict]:
    """The lines of ``nvidia-smi --query-gpu=name,memory.total,driver_version
    --format=csv,noheader``: one dict per GPU (name, memory in MiB, driver)."""
    out = []
    for line in smi.strip().splitlines():
        name, memory, driver = (part.strip() for part in line.split(","))
        out.append(
            {"name": name, "memory_mib": int(memory.split()[0]), "driver": driver}
        )
    return out


def cuda_version(header: str | None) -> str | None:
    """The CUDA version the driver supports, from ``nvidia-smi``'s header."""
    found = re.search(r"CUDA Version:\s*([\d.]+)", header or "")
    return found.group(1) if found else None


def links(topo: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo -m``'s matrix between GPUs: {(i, j): "NV18", "SYS", ...}."""
    lines = [x for x in topo.splitlines() if x.strip()]
    head = next(
        x for x in lines if re.search(r"\bGPU0\b", x) and not x.startswith("GPU")
    )
    columns = [c for c in head.split() if re.fullmatch(r"GPU\d+", c)]
    out = {}
    for line in lines:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        i = int(cells[0][3:])
        for j, value in zip((int(c[3:]) for c in columns), cells[1:]):
            if i != j:
                out[(i, j)] = value
    return out


def infiniband(root: pathlib.Path = IB) -> list[tuple[str, str, str]]:
    """Each InfiniBand adapter's ports and their state ("4: ACTIVE") from sysfs."""
    out = []
    for port in sorted(root.glob("*/ports/*")):
        state = (
            (port / "state").read_text().strip() if (port / "state").exists() else "?"
        )
        out.append((port.parent.parent.name, port.name, state))
    return out


def check(node: Node, expect_gpus: int | None = None) -> list[Finding]:
    """Every check, in the report's order."""
    if node.smi is None:
        return [
            Finding("ok", "GPUs", "no nvidia-smi: no NVIDIA GPU here, nothing to check")
        ]
    found, env = gpus(node.smi), node.environ
    out = [
        Finding(
            "ok",
            f"GPU {i}",
            f"{g['name']}, {g['memory_mib']:,} MiB, driver {g['driver']}",
        )
        for i, g in enumerate(found)
    ]
    if expect_gpus is not None and len(found) != expect_gpus:
        out.append(
            Finding(
                "FAIL",
                "GPU count",
                f"{len(found)} visible, expected "
                f"{expect_gpus} (CUDA_VISIBLE_DEVICES="
                f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')})",
            )
        )
    major = int(found[0]["driver"].split(".")[0]) if found else 0
    for plugin, needed in DRIVER_NEEDED.items():
        if plugin in node.wheels:
            level = "ok" if major >= needed else "FAIL"
            out.append(
                Finding(
                    level,
                    "driver",
                    f"{found[0]['driver']}; {plugin} "
                    f"{node.wheels[plugin]} needs >= {needed}",
                )
            )
    if not any(p in node.wheels for p in DRIVER_NEEDED):
        out.append(
            Finding(
                "WARN",
                "JAX CUDA wheel",
                'none installed: JAX will not use the GPUs (pip install "jax[cuda13]")',
            )
        )
    cuda = cuda_version(node.smi_header)
    libraries = ", ".join(
        f"{w} {v}" for w, v in node.wheels.items() if w in CUDA_WHEELS
    )
    out.append(
        Finding(
            "ok",
            "CUDA",
            f"driver supports CUDA {cuda or '?'}; pip: {libraries or 'no CUDA wheels'}",
        )
    )
    out += topology(node.topo, len(found))
    out += [
        Finding(
            "ok" if s.endswith("ACTIVE") else "FAIL", "InfiniBand", f"{a} port {p}: {s}"
        )
        for a, p, s in node.infiniband
    ]
    if not node.infiniband:
        out.append(
            Finding(
                "WARN",
                "InfiniBand",
                "no adapter: across nodes NCCL uses sockets (TCP), far slower",
            )
        )
    out += traps(env, node.wheels, len(found))
    out += [
        Finding("ok", "variable", f"{k}={v}")
        for k, v in sorted(env.items())
        if VARIABLES.match(k)
    ]
    return out


def topology(topo: str | None, count: int) -> list[Finding]:
    """NVLink between every pair of GPUs, or which pairs lack it."""
    if topo is None or count < 2:
        return []
    pairs = links(topo)
    slow = sorted(
        f"GPU{i}-GPU{j} {v}"
        for (i, j), v in pairs.items()
        if i < j and not v.startswith("NV")
    )
    if slow:
        return [Finding("WARN", "links", f"no NVLink between {', '.join(slow)}")]
    kinds = sorted({v for v in pairs.values()})
    return [
        Finding(
            "ok", "links", f"NVLink between every pair of GPUs ({', '.join(kinds)})"
        )
    ]


def traps(
    environ: Mapping[str, str], wheels: Mapping[str, str], count: int
) -> list[Finding]:
    """The settings that break or slow a JAX job on GPUs though everything starts."""
    out = []
    shadow = [
        d
        for d in environ.get("LD_LIBRARY_PATH", "").split(":")
        if re.search(r"cuda|nvidia|nccl|cudnn", d, re.I)
    ]
    if shadow and any(w in wheels for w in CUDA_WHEELS):
        out.append(
            Finding(
                "WARN",
                "LD_LIBRARY_PATH",
                f"{':'.join(shadow)} can shadow pip's CUDA libraries: unset it for JAX",
            )
        )
    per_task = environ.get("SLURM_GPUS_PER_TASK")
    tasks = environ.get("SLURM_NTASKS_PER_NODE") or environ.get(
        "OMPI_COMM_WORLD_LOCAL_SIZE"
    )
    sharing = int((tasks or "1").split("(")[0])  # SLURM writes "8" or "8(x2)"
    if per_task == "1" and sharing > 1:
        out.append(
            Finding(
                "WARN",
                "SLURM",
                f"--gpus-per-task=1 with {sharing} tasks a node: JAX gives task i "
                "the GPU numbered SLURM_LOCALID among those it sees, and each sees "
                "one (jax-ml/jax#28194); ask --gpus-per-node so that every task "
                "sees them all",
            )
        )
    fraction = environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    per_gpu = -(-sharing // count) if count and per_task is None else 1  # ceil
    if fraction and float(fraction) * per_gpu > 1:
        out.append(
            Finding(
                "WARN",
                "memory",
                f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} "
                f"for each of {per_gpu} processes on a GPU: more than the "
                "GPU has",
            )
        )
    return out


def gather(environ: Mapping[str, str] | None = None) -> Node:
    """Read this node: nvidia-smi (if any), pip's wheels, the variables, sysfs."""
    environ = dict(os.environ if environ is None else environ)

    def command(*argv: str) -> str | None:
        if shutil.which(argv[0]) is None:
            return None
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return done.stdout if done.returncode == 0 else None

    query = "--query-gpu=name,memory.total,driver_version"
    wheels = {}
    for name in (*DRIVER_NEEDED, *CUDA_WHEELS, "jax", "jaxlib"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            wheels[name] = importlib.metadata.version(name)
    return Node(
        command("nvidia-smi", query, "--format=csv,noheader"),
        command("nvidia-smi"),
        command("nvidia-smi", "topo", "-m"),
        wheels,
        environ,
        infiniband(),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect-gpus", type=int, help="the GPUs this node must have")
    args = parser.parse_args(argv)
    findings = check(gather(), args.expect_gpus)
    width = max(len(f.what) for f in findings)
    for f in findings:
        print(f"{f.level:<4}  {f.what:<{width}}  {f.detail}")
    failed = [f for f in findings if f.level == "FAIL"]
    print(
        f"preflight {'FAILED' if failed else 'passed'}: {len(failed)} failed, "
        f"{sum(f.level == 'WARN' for f in findings)} warnings"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
