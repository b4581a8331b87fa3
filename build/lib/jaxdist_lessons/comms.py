"""Read the communication out of a compiled program, and what theory says it should be.

``collectives(hlo_text)`` lists every collective in the text of a compiled XLA program
(``jax.jit(f).lower(*args).compile().as_text()``): its kind, dtype, element count, bytes,
replica groups, and whether it runs inside a loop body. After SPMD partitioning the program
is per device, so the bytes are per device too.

Which op names count:
- ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``, ``collective-permute``;
- their asynchronous pairs (``all-reduce-start`` / ``all-reduce-done``, as on GPU) count once,
  at the ``-done`` op, whose shape is the result;
- XLA's combiners merge several collectives into one whose shape is a tuple; its bytes are
  the sum over the tuple.

``bytes`` is the size of the op's *result* on one device: the reduced array for all-reduce,
the gathered array for all-gather, the scattered shard for reduce-scatter. The analytic
companions at the end say how much a ring algorithm sends for each.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.compiled import compile_fn

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+"
    r"(?P<op>" + "|".join(KINDS) + r")(?P<phase>-start|-done)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*[a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_CALLS = re.compile(r"\b(?:body|condition|calls|to_apply)=%?([\w.\-]+)")
_CALL_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program, as one device runs it."""

    kind: str
    dtype: str
    elements: int
    bytes: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    replica_groups: str
    group_size: (
        int | None
    )  # devices per replica group; None where XLA does not say (or for a permute)
    in_loop: bool
    computation: str
    name: str


def _shapes(shape_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    found = []
    for m in _ARRAY.finditer(shape_text):
        if m["dtype"] == "token":
            continue
        if m["dtype"] not in DTYPE_BYTES:
            raise ValueError(
                f"unknown HLO element type {m['dtype']!r} in {shape_text!r}: add its size to "
                "comms.DTYPE_BYTES"
            )
        found.append((m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d)))
    return tuple(found)


def _attribute(rest: str, key: str) -> str:
    """The raw value of ``key=...`` in an instruction's attributes (brackets balanced)."""
    start = rest.find(f"{key}=")
    if start < 0:
        return ""
    text = rest[start + len(key) + 1 :]
    if text.startswith(
        "mesh["
    ):  # mesh['a'=1,'b'=2] {'b'}, optionally with device_ids=(...) before the set
        end = text.find("}", text.find("]"))
        return text[: end + 1] if end >= 0 else text
    depth = 0
    for i, ch in enumerate(text):
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            return text[:i]
    return text


def group_size(replica_groups: str) -> int | None:
    """Devices per group, from any of XLA's three spellings of ``replica_groups``."""
    if replica_groups.startswith("{{"):
        return len(replica_groups[2:].split("}")[0].split(","))
    iota = re.match(r"\[(\d+),(\d+)\]<=", replica_groups)
    if iota:
        return int(iota[2])
    if replica_groups.startswith("mesh["):
        sizes = dict(
            (k, int(v))
            for k, v in re.findall(r"'([^']+)'=(\d+)", replica_groups.split("]")[0])
        )
        axes = re.findall(r"'([^']+)'", replica_groups[replica_groups.rfind("{") :])
        return math.prod(sizes[a] for a in axes)
    return None


def _loop_computations(calls: dict[str, set[str]], bodies: set[str]) -> set[str]:
    inside, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo.extend(calls.get(name, ()))
    return inside


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in a compiled program's text, in program order."""
    computation = ""
    found: list[tuple[str, re.Match]] = []
    starts: dict[
        str, str
    ] = {}  # an async -start op's name -> its attributes (where the groups are)
    calls: dict[str, set[str]] = collections.defaultdict(set)
    bodies: set[str] = set()
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line) if not line.startswith(" ") else None
        if header:
            computation = header["name"]
            continue
        for callee in _CALLS.findall(line):
            calls[computation].add(callee)
        for group in _CALL_LISTS.findall(line):
            calls[computation].update(
                c.strip().lstrip("%") for c in group.split(",") if c.strip()
            )
        bodies.update(re.findall(r"\bbody=%?([\w.\-]+)", line))
        op = _INSTRUCTION.match(line)
        if op and op["phase"] == "-start":
            starts[op["name"]] = op["rest"]
        elif op:
            found.append((computation, op))
    in_loops = _loop_computations(calls, bodies)
    records = []
    for comp, op in found:
        shapes = _shapes(op["shape"])
        elements = sum(math.prod(dims) for _, dims in shapes)
        attributes = op["rest"]
        if op["phase"] == "-done":  # the groups are written on the matching -start op
            attributes = starts.get(
                attributes.split(")")[0].strip().lstrip("%"), attributes
            )
        groups = _attribute(attributes, "replica_groups") or _attribute(
            attributes, "source_target_pairs"
        )
        records.append(
            Collective(
                kind=op["op"],
                dtype=",".join(dict.fromkeys(dtype for dtype, _ in shapes)),
                elements=elements,
                bytes=sum(math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims in shapes),
                shapes=shapes,
                replica_groups=groups,
                group_size=group_size(groups) if op["op"] != "collective-permute" else None,
                in_loop=comp in in_loops,
                computation=comp,
                name=op["name"],
            )
        )
    return records


def _check_kind(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; allowed: {', '.join(KINDS)}")


def total_bytes(hlo_text: str, kind: str | None = None) -> int:
    """Bytes of all collectives in the program (per device), or of one ``kind``."""
    _check_kind(kind)
    return sum(c.bytes for c in collectives(hlo_text) if kind is None or c.kind == kind)


def summary(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per kind: how many ops, how many inside loop bodies, and their bytes."""
    out: dict[str, dict[str, int]] = {}
    for c in collectives(hlo_text):
        row = out.setdefault(c.kind, {"count": 0, "in_loop": 0, "bytes": 0})
        row["count"] += 1
        row["in_loop"] += int(c.in_loop)
        row["bytes"] += c.bytes
    return out


def compiled_text(fn: Any, *args: Any, **kwargs: Any) -> str:
    """The compiled program's text for these arguments (``fn`` is jitted if it is not already)."""
    return compile_fn(fn, *args, **kwargs).as_text()


# --- What theory says -------------------------------------------------------------------------


def tree_bytes(tree: Any) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) in a tree."""
    return sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def data_parallel_bytes(params: Any) -> int:
    """What a data-parallel step must all-reduce: one gradient per parameter, so the parameters' bytes."""
    return tree_bytes(params)


def ring_all_reduce_bytes(nbytes: float, num_devices: int) -> float:
    """Bytes each device sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N`` of it.

    A reduce-scatter (N-1 steps of 1/N) then an all-gather (N-1 steps of 1/N).
    """
    positive_int("num_devices", num_devices)
    return 2 * (num_devices - 1) / num_devices * nbytes


def ring_all_gather_bytes(full_bytes: float, num_devices: int) -> float:
    """Bytes each device sends to gather an array of ``full_bytes`` around a ring: ``(N-1)/N`` of it."""
    positive_int("num_devices", num_devices)
    return (num_devices - 1) / num_devices * full_bytes


def ring_reduce_scatter_bytes(full_bytes: float, num_devices: int) -> float:
    """Bytes each device sends to reduce-scatter an array of ``full_bytes`` around a ring: ``(N-1)/N``."""
    return ring_all_gather_bytes(full_bytes, num_devices)


def ring_all_reduce_schedule(
    num_devices: int,
) -> dict[str, list[list[tuple[int, int, int]]]]:
    """Who sends which chunk to whom in a ring all-reduce: ``{phase: [[(src, dst, chunk), ...] per step]}``.

    The data is cut into N chunks. In the reduce-scatter phase, at step ``s`` device ``i`` sends
    chunk ``(i - s) mod N`` to device ``i + 1``, which adds it to its own; after N-1 steps device
    ``i`` holds the full sum of chunk ``(i + 1) mod N``. In the all-gather phase the finished chunks
    travel on around the ring, N-1 more steps. Every step moves 1/N of the data per device.
    """
    positive_int("num_devices", num_devices)
    n = num_devices
    return {
        "reduce-scatter": [
            [(i, (i + 1) % n, (i - s) % n) for i in range(n)] for s in range(n - 1)
        ],
        "all-gather": [
            [(i, (i + 1) % n, (i + 1 - s) % n) for i in range(n)] for s in range(n - 1)
        ],
    }


def table_rows(records: Iterable[Collective]) -> list[list[Any]]:
    """Rows for ``tables.Table``: kind, dtype, shapes, bytes, group size, in a loop."""
    return [
        [
            c.kind,
            c.dtype,
            " ".join(f"{d}{list(s)}" for d, s in c.shapes),
            c.bytes,
            c.group_size,
            "yes" if c.in_loop else "no",
        ]
        for c in records
    ]


TABLE_HEADERS = ["kind", "dtype", "shapes", "bytes", "group size", "in a loop"]


def replica_group_lists(
    replica_groups: str, num_devices: int | None = None
) -> list[list[int]]:
    """The device ids of every group, from any of XLA's spellings of ``replica_groups``.

    ``{{0,1},{2,3}}`` lists them; ``[2,4]<=[4,2]T(1,0)`` is an iota (ids ``0..7`` reshaped to
    ``[4,2]``, transposed, then cut into 2 groups of 4); ``mesh['a'=2,'b'=4] {'b'}`` groups the
    devices of a mesh along the named axes (its ids are an iota, or ``device_ids=(...)``).
    ``{}`` is one group of all ``num_devices`` devices.
    """
    text = replica_groups.strip()
    if text == "{}":
        if num_devices is None:
            raise ValueError(
                "replica_groups={} means one group of every device: pass num_devices"
            )
        return [list(range(positive_int("num_devices", num_devices)))]
    if text.startswith("{{"):
        return [
            [int(i) for i in group.split(",")]
            for group in re.findall(r"\{([\d,\s]+)\}", text)
        ]
    iota = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        ids = _iota([int(d) for d in iota[3].split(",")], iota[4])
        return ids.reshape(int(iota[1]), int(iota[2])).tolist()
    mesh = re.fullmatch(
        r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*\{(?P<over>[^}]*)\}",
        text,
    )
    if mesh and ":" not in mesh["over"]:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh["axes"])}
        names, shape = list(sizes), tuple(sizes.values())
        over = re.findall(r"'([^']+)'", mesh["over"])
        if set(over) <= set(names):
            ids = _mesh_device_ids(mesh["ids"], shape)
            axes = [names.index(a) for a in over]
            rest = [i for i in range(len(names)) if i not in axes]
            size = math.prod(sizes[a] for a in over)
            return ids.transpose(rest + axes).reshape(-1, size).tolist()
    raise ValueError(f"cannot read replica groups {replica_groups!r}")


def _iota(reshape_dims: list[int], transpose: str | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    return ids.transpose([int(p) for p in transpose.split(",")]) if transpose else ids


def _mesh_device_ids(spelled: str | None, shape: tuple[int, ...]) -> np.ndarray:
    """The device id at each mesh position: ``0..N-1`` in order, an iota ``[4,16]T(1,0)``, or a list ``0,2,1,3``."""
    if not spelled:
        return np.arange(math.prod(shape)).reshape(shape)
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spelled)
    if iota:
        return _iota([int(d) for d in iota[1].split(",")], iota[2]).reshape(shape)
    return np.array([int(i) for i in spelled.split(",")]).reshape(shape)
