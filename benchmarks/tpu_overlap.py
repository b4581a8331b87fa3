"""Which collectives the TPU compiler overlaps with matrix products, by mesh axis.

The planner prices tensor parallelism's activation collectives as waited for and FSDP's
as hidden behind the compute (``planning.gpu.priced_transfers``). No TPU slice has timed
them for this book, but the compiled program says what the TPU compiler scheduled. Each
case compiles ``jaxdist_lm/train.py``'s step for a slice that is not here
(``--compile-only --topology``; libtpu in a folder of its own, no TPU), with XLA's dump
of the optimised, scheduled program, and reads that text. For every collective it finds
the mesh axes its replica groups span (``tensor``, ``fsdp``), its bytes (its result's,
as ``comms`` counts them, times the trips of the loop it runs in) and whether it is
asynchronous; and for an asynchronous one, whether compute (a dot or a convolution,
alone, in a fusion or in a loop such as a collective matmul's) is scheduled between its
start and its done.

The TPU compiler spells an asynchronous collective in two ways: a ``-start``/``-done``
pair, or a fusion whose computation ends in a custom call to ``AsyncCollectiveStart``,
then "continuation" fusions (``async_collective_fusion`` computations: the collective's
next part beside a slice of compute), then one ending in ``AsyncCollectiveDone``. They
are linked by the values they pass on (a continuation inside a loop continues one
started outside it). A collective written as synchronous in the scheduled text is
waited for (XLA turns a pair with nothing between into one).

    pip install --target .libtpu -r requirements-libtpu.txt
    python benchmarks/tpu_overlap.py --libtpu .libtpu    # 7 compiles, 2 at a time
    python benchmarks/tpu_overlap.py --libtpu .libtpu --recipe /elsewhere/jaxdist_lm

Writes ``book/data/tpu_overlap.json``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))
import recipe_copy  # noqa: E402
from tpu_flags import OVERLAP, libtpu_meta  # noqa: E402  (MaxText's overlap flags)

from jaxdist_lessons import hlo  # noqa: E402
from jaxdist_lessons.planning import checking  # noqa: E402
from jaxdist_lessons.traffic import KINDS, Transfer, sent_bytes  # noqa: E402
from jaxdist_lm import mesh_spec  # noqa: E402  (the recipe's)

OUT = ROOT / "book" / "data" / "tpu_overlap.json"
RECIPE = ROOT / "jaxdist_lm"
RUN = "--seq-len 2048 --dtype bfloat16 --global-batch 16"
# MaxText's v5p configs add three flags to the overlap flags
# (https://github.com/AI-Hypercomputer/maxtext/blob/main/MaxText/configs/v5p/128b.sh,
# 32b.sh: LIBTPU_INIT_ARGS); its v5e configs do not (v5e/128b.sh).
V5P = [
    *OVERLAP,
    "--xla_tpu_megacore_fusion_allow_ags=false",
    "--xla_enable_async_collective_permute=true",
    "--xla_tpu_enable_ag_backward_pipelining=true",
]
# (name, --model, --topology, --mesh, LIBTPU_INIT_ARGS); the planner's shares are the
# largest model's, with the flags MaxText's published runs used
CASES = [
    ("v5e, tensor", "125m", "v5e:4x4", "fsdp=4,tensor=4", []),
    ("v5e, tensor, MaxText's flags", "125m", "v5e:4x4", "fsdp=4,tensor=4", OVERLAP),
    ("v5e, FSDP alone", "125m", "v5e:4x4", "fsdp=16", []),
    ("v5p, tensor", "125m", "v5p:2x2x4", "fsdp=4,tensor=4", []),
    ("v5p, tensor, MaxText's flags", "125m", "v5p:2x2x4", "fsdp=4,tensor=4", V5P),
    ("v5e, tensor, 8b, MaxText's flags", "8b", "v5e:4x4", "fsdp=4,tensor=4", OVERLAP),
    ("v5p, tensor, 8b, MaxText's flags", "8b", "v5p:2x2x4", "fsdp=4,tensor=4", V5P),
]
MATMULS = ("dot", "convolution")
ASYNC_TARGETS = ("AsyncCollectiveStart", "AsyncCollectiveDone")
# what carries an asynchronous collective's value from its start to its done
CARRIERS = ("get-tuple-element", "bitcast", "tuple", "copy")


@dataclasses.dataclass
class Scheduled:
    """One collective of a scheduled program, as one device runs it."""

    kind: str
    bytes: int  # its result's, times the trips of its loop
    group: int | None  # devices in each group (None for a permute)
    axes: tuple[str, ...]  # the mesh axes its groups span
    asynchronous: bool
    overlapped: bool = False  # compute scheduled between its start and its done
    name: str = ""


def operands(inst: hlo.Instruction) -> list[str]:
    """The names of an instruction's operands."""
    return re.findall(r"%([\w.\-]+)", inst.rest.split(")", 1)[0])


def called(inst: hlo.Instruction) -> str:
    """The computation a fusion calls."""
    found = re.search(r"\bcalls=%?([\w.\-]+)", inst.rest)
    return found[1] if found else ""


def callees(inst: hlo.Instruction) -> list[str]:
    """Every computation an instruction runs: a fusion's, a loop's body and condition,
    a call's, a conditional's branches."""
    found = re.findall(r"\b(?:calls|body|condition|to_apply)=%?([\w.\-]+)", inst.rest)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", inst.rest):
        found += [c.strip().lstrip("%") for c in group.split(",")]
    return found


def group_axes(groups: list[list[int]], sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group differ: device ``i`` sits at
    position ``i`` of the mesh, flattened in ``mesh_spec.AXES`` order (the ids of a
    partitioned program's groups are positions in its device assignment)."""
    shape = tuple(sizes[a] for a in mesh_spec.AXES)
    return hlo.spanned_axes(groups, shape, mesh_spec.AXES)


def collective_groups(
    inst: hlo.Instruction, sizes: dict[str, int]
) -> tuple[int | None, tuple[str, ...]]:
    """A collective's devices per group (None for a permute) and the mesh axes its
    replica groups (or a permute's pairs) span."""
    pairs = hlo.attribute(inst.rest, "source_target_pairs")
    spelled = pairs or hlo.attribute(inst.rest, "replica_groups")
    groups = hlo.replica_group_lists(spelled, int(np.prod(list(sizes.values()))))
    return (None if pairs else len(groups[0])), group_axes(groups, sizes)


def trip_count(
    loop: hlo.Instruction,
    condition: list[hlo.Instruction],
    caller: dict[str, hlo.Instruction],
) -> int:
    """A loop's trips: its condition compares a counter (an element of the loop's
    tuple) less-than a constant N, and the tuple the loop starts from holds the
    counter's first value (0, or 1 where the compiler peeled the first trip into the
    code before it; followed through copies): N less that. 1 where the condition
    is another."""
    named = {i.name: i for i in condition}
    for i in condition:
        ops = [named.get(o) for o in operands(i)]
        if i.opcode != "compare" or "direction=LT" not in i.rest or None in ops:
            continue
        counter, bound = ops
        if counter.opcode == "get-tuple-element" and bound.opcode == "constant":
            index = int(re.search(r"index=(\d+)", counter.rest)[1])
            first = caller.get(operands(loop)[0])
            tupled = first is not None and first.opcode == "tuple"
            value = caller.get(operands(first)[index]) if tupled else None
            while value is not None and value.opcode in ("copy", "bitcast"):
                value = caller.get(operands(value)[0])
            start = constant(value) if value and value.opcode == "constant" else 0
            return constant(bound) - start
    return 1


def constant(inst: hlo.Instruction) -> int:
    """A scalar constant's value."""
    return int(re.match(r"(-?\d+)\)", inst.rest)[1])


def schedules(
    computations: dict[str, list[hlo.Instruction]],
) -> dict[str, int]:
    """The computations that run as schedules (the entry, loop bodies, what they call
    outside fusions), each with the trips it runs a step."""
    [entry] = [c for c, body in computations.items() if body and body[0].in_entry]
    trips, todo = {entry: 1}, [entry]
    while todo:
        name = todo.pop()
        for inst in computations[name]:
            inner = []
            if inst.opcode == "while":
                cond = re.search(r"\bcondition=%?([\w.\-]+)", inst.rest)[1]
                body = re.search(r"\bbody=%?([\w.\-]+)", inst.rest)[1]
                caller = {i.name: i for i in computations[name]}
                n = trip_count(inst, computations[cond], caller)
                inner = [(body, trips[name] * n)]
            elif inst.opcode in ("call", "conditional"):
                found = re.findall(r"\bto_apply=%?([\w.\-]+)", inst.rest)
                for group in re.findall(r"branch_computations=\{([^}]*)\}", inst.rest):
                    found += [c.strip().lstrip("%") for c in group.split(",")]
                inner = [(c, trips[name]) for c in found]
            for child, n in inner:
                if child not in trips:
                    trips[child] = n
                    todo.append(child)
    return trips


def classify(hlo_text: str, sizes: dict[str, int]) -> list[Scheduled]:
    """Every collective of a scheduled program's text: its kind, bytes a step, mesh
    axes, whether asynchronous, whether compute is scheduled while it is in flight."""
    computations: dict[str, list[hlo.Instruction]] = collections.defaultdict(list)
    for inst in hlo.instructions(hlo_text):
        computations[inst.computation].append(inst)
    calls = {
        c: {callee for i in body for callee in callees(i)}
        for c, body in computations.items()
    }

    @functools.cache
    def matmuls(name: str) -> bool:
        """Whether a computation, or one it runs, holds a dot or a convolution."""
        body = computations.get(name, [])
        return any(i.opcode in MATMULS for i in body) or any(
            matmuls(c) for c in calls.get(name, ())
        )

    def role(name: str) -> str:
        body = computations.get(name, [])
        targets = {m for i in body for m in ASYNC_TARGETS if f'"{m}"' in i.rest}
        if targets:
            return "start" if "AsyncCollectiveStart" in targets else "done"
        return "continuation" if name.startswith("async_collective_fusion") else ""

    found: list[Scheduled] = []

    def record(inst: hlo.Instruction, asynchronous: bool, trips: int) -> int:
        nbytes = hlo.shapes_bytes(hlo.shapes(inst.shape)) * trips
        group, axes = collective_groups(inst, sizes)
        kind = hlo.split_async(inst.opcode)[0]
        found.append(Scheduled(kind, nbytes, group, axes, asynchronous, name=inst.name))
        return len(found) - 1

    for name, trips in schedules(computations).items():
        carried: dict[str, set[int]] = {}  # a value -> the collectives it carries
        in_flight: set[int] = set()
        for inst in computations[name]:
            kind, phase = hlo.split_async(inst.opcode)
            mine = set().union(*(carried.get(o, set()) for o in operands(inst)))
            inner = called(inst) if inst.opcode == "fusion" else ""
            part = role(inner) if inner else ""
            # (a continuation fusion is compute beside its collective; a loop of
            # matmuls, such as a collective matmul's, is compute too)
            compute = inst.opcode in MATMULS or any(map(matmuls, callees(inst)))
            if compute:
                for k in in_flight:
                    found[k].overlapped = True
            if kind in KINDS and phase == "":
                record(inst, False, trips)
            elif kind in KINDS and phase == "-start":
                carried[inst.name] = {record(inst, True, trips)}
                in_flight |= carried[inst.name]
            elif part == "start":
                ops = [i for i in computations[inner] if i.opcode in KINDS]
                carried[inst.name] = {record(i, True, trips) for i in ops}
                in_flight |= carried[inst.name]
            elif phase == "-done" or part == "done":
                in_flight -= mine
                for k in mine if phase else ():  # a -start's shape holds its operands
                    found[k].bytes = hlo.shapes_bytes(hlo.shapes(inst.shape)) * trips
            elif part == "continuation" and not mine:
                pass  # in a loop: its collective started (and is counted) outside
            elif mine and (inst.opcode in CARRIERS or part == "continuation"):
                carried[inst.name] = mine
            elif inner.startswith("all-reduce-scatter"):  # a reduce-scatter's shard
                [i] = [i for i in computations[inner] if i.opcode in KINDS]
                k = record(i, False, trips)
                found[k].kind = "reduce-scatter"
                found[k].bytes = hlo.shapes_bytes(hlo.shapes(inst.shape)) * trips
            elif inner:  # a collective fused into plain work: waited for
                for i in computations[inner]:
                    if i.opcode in KINDS:
                        record(i, False, trips)
    return found


def by_axis(found: list[Scheduled]) -> dict[str, dict]:
    """Per set of mesh axes ("fsdp", "tensor", "fsdp,tensor"; "none" for groups of one
    device), a step's collectives: their result bytes in all, asynchronous and
    overlapped by compute; the bytes a device sends for them with ring algorithms
    (``traffic.sent_bytes``, what the planner prices) in all and overlapped, also by
    kind; and how many there are in the program's text."""
    out: dict[str, dict] = {}
    for c in found:
        row = out.setdefault(
            ",".join(c.axes) or "none",
            dict.fromkeys(
                ["bytes", "async", "overlapped", "sent", "sent_overlapped"], 0
            )
            | {"count": 0, "kinds": {}},
        )
        sent = round(sent_bytes(Transfer(c.kind, c.bytes, c.group)))
        kind = row["kinds"].setdefault(c.kind, {"sent": 0, "sent_overlapped": 0})
        for sums, key, value in [
            (row, "bytes", c.bytes),
            (row, "async", c.bytes * c.asynchronous),
            (row, "overlapped", c.bytes * c.overlapped),
            (row, "sent", sent),
            (row, "sent_overlapped", sent * c.overlapped),
            (row, "count", 1),
            (kind, "sent", sent),
            (kind, "sent_overlapped", sent * c.overlapped),
        ]:
            sums[key] += value
    for row in out.values():
        row["kinds"] = dict(sorted(row["kinds"].items()))
    return dict(sorted(out.items()))


def compile_case(
    recipe: str, libtpu: str, model: str, topology: str, mesh: str, flags: list[str]
) -> tuple[str, float]:
    """The scheduled text of the recipe's step compiled for ``topology``; seconds."""
    env = checking.compile_environment(libtpu)
    env["LIBTPU_INIT_ARGS"] = " ".join(flags)
    # libtpu locks /tmp/libtpu_lockfile while it runs, unless told another may run too
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    with tempfile.TemporaryDirectory() as dump:
        env["XLA_FLAGS"] = (
            f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
            "--xla_dump_hlo_module_re=jit_train_step"
        )
        argv = [*RUN.split(), "--model", model, "--compile-only"]
        argv += ["--mesh", mesh, "--topology", topology]
        cwd, prefix = recipe_copy.locate(recipe)
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", f"{prefix}train", *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
        )
        seconds = time.perf_counter() - start
        if done.returncode:
            raise SystemExit(f"{topology} {mesh}: {done.stderr.strip()[-400:]}")
        [text] = pathlib.Path(dump).glob("*jit_train_step*.after_optimizations.txt")
        return text.read_text(), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libtpu", metavar="DIR", help="a folder holding libtpu")
    parser.add_argument(
        "--recipe",
        default=str(RECIPE),
        help="the recipe's folder to compile (a copy of jaxdist_lm/, or its train.py)",
    )
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--jobs", type=int, default=2, help="compiles at once (each uses one core)"
    )
    args = parser.parse_args()
    if not args.libtpu:
        parser.error(
            "--libtpu DIR: pip install --target DIR -r requirements-libtpu.txt"
        )

    libtpu = str(pathlib.Path(args.libtpu).resolve())
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        compiled = pool.map(
            lambda case: compile_case(args.recipe, libtpu, *case[1:]), CASES
        )
    rows = []
    for (name, model, topology, mesh, flags), (text, seconds) in zip(CASES, compiled):
        sizes = mesh_spec.parse(mesh)
        axes = by_axis(classify(text, sizes))
        # the same hash: the flags changed nothing (the text names the recipe's
        # source lines, so compare within one run)
        digest = hashlib.sha256(text.encode()).hexdigest()
        rows.append(
            {"name": name, "model": model, "topology": topology, "mesh": mesh}
            | {"flags": flags}
            | {"compile_seconds": round(seconds, 1), "program_sha256": digest}
            | {"axes": axes}
        )
        print(f"{name} ({seconds:.0f} s)", flush=True)
        for axis, row in axes.items():
            share = row["sent_overlapped"] / row["sent"] if row["sent"] else 0.0
            print(
                f"  {axis:12} {row['bytes'] / 1e6:9.1f} MB, async "
                f"{row['async'] / 1e6:9.1f}, overlapped {row['overlapped'] / 1e6:9.1f}"
                f"; of the bytes sent, {share:.0%} overlapped"
            )
    meta = libtpu_meta(libtpu, RUN, "python benchmarks/tpu_overlap.py --libtpu DIR")
    pathlib.Path(args.out).write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
