"""Read the text of a compiled XLA program: its instructions, their dtypes and bytes, replica groups.

``jax.jit(f).lower(*args).compile().as_text()`` is the program XLA runs; after SPMD partitioning
it is the program of one device. JAX offers no public API for its instructions, so this module
reads the text: every computation (the ``ENTRY`` one, fusions, loop bodies), every instruction
with its opcode, result shape and attributes, the element types and their sizes in bytes, and the
three ways XLA spells a collective's replica groups. ``comms`` (collective bytes), ``residuals``
(what autodiff saves) and ``profiling`` (which traced ops are collectives) build on it, and
``memory`` takes its dtype sizes from it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterator

import numpy as np

from jaxdist_lessons._checks import positive_int
from jaxdist_lm.hlo_dtypes import BYTES

# Bytes per element, by HLO's name for the type (``pred`` is a bool): the LM recipe's
# table (jaxdist_lm/hlo_dtypes.py), one home for both.
DTYPE_BYTES: dict[str, int] = BYTES

# Other spellings of the same types, as prefixes: numpy's (float32, bfloat16, int8, complex64),
# JAX's short ones (i32, f8_e4m3fn) and the prose's (fp32, fp16).
_PREFIXES = {
    "bfloat": "bf",
    "float": "f",
    "fp": "f",
    "f": "f",
    "complex": "c",
    "uint": "u",
    "int": "s",
    "i": "s",
}

# Opcodes of the collectives XLA emits (each may also come as an async -start/-done pair).
COLLECTIVE_OPCODES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)


def hlo_dtype(name: str) -> str:
    """HLO's name for a dtype (``f32``, ``s32``, ``pred``) from any spelling the book meets.

    HLO's own names, numpy's (``float32``, ``bfloat16``), JAX's short ones (``i32``, ``bool``,
    ``f8_e4m3fn``) and the prose's (``fp32``, ``fp8``: an 8-bit float). ``ValueError`` otherwise.
    """
    if name in DTYPE_BYTES:
        return name
    if name == "bool":
        return "pred"
    if name == "fp8":
        return "f8e4m3fn"
    m = re.fullmatch(r"(bfloat|float|complex|uint|int|fp|f|i)(\d+)_?([a-z0-9]*)", name)
    spelled = m and f"{_PREFIXES[m[1]]}{m[2]}{m[3]}"
    if spelled not in DTYPE_BYTES:
        raise ValueError(
            f"unknown HLO element type {name!r}: add its size to hlo.DTYPE_BYTES"
        )
    return spelled


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype, in any spelling ``hlo_dtype`` reads."""
    return DTYPE_BYTES[hlo_dtype(name)]


# --- Shapes -----------------------------------------------------------------------------------

Shapes = tuple[tuple[str, tuple[int, ...]], ...]

_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*[a-z0-9]*)\[(?P<dims>[\d,]*)\]")


def shapes(shape_text: str) -> Shapes:
    """The arrays of a result shape (one, or a tuple's), as ``(dtype, dims)``; tokens are skipped."""
    found = []
    for m in _ARRAY.finditer(shape_text):
        if m["dtype"] == "token":
            continue
        if m["dtype"] not in DTYPE_BYTES:
            raise ValueError(
                f"unknown HLO element type {m['dtype']!r} in {shape_text!r}: add its size to "
                "hlo.DTYPE_BYTES"
            )
        found.append((m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d)))
    return tuple(found)


def shapes_bytes(arrays: Shapes) -> int:
    """Bytes of every array in ``arrays`` (``shapes``' result) together."""
    return sum(math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims in arrays)


# --- Instructions -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One line of a compiled program: ``name = shape opcode(rest``, in its computation."""

    name: str
    shape: str
    opcode: str
    rest: str
    computation: str
    in_entry: bool


_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+"
    r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)


def instructions(hlo_text: str) -> Iterator[Instruction]:
    """Every instruction of a program's text, in order, each with the computation it belongs to."""
    computation, in_entry = "", False
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line) if not line.startswith(" ") else None
        if header:
            computation, in_entry = header["name"], bool(header["entry"])
            continue
        m = _INSTRUCTION.match(line)
        if m:
            yield Instruction(
                m["name"], m["shape"], m["opcode"], m["rest"], computation, in_entry
            )


def op_counts(hlo_text: str) -> collections.Counter:
    """How many instructions of each opcode (``fusion``, ``dot``, ``all-reduce``...) the text holds, in all computations."""
    return collections.Counter(i.opcode for i in instructions(hlo_text))


def instruction_count(hlo_text: str) -> int:
    """All instructions of an HLO text: the size of the program."""
    return sum(op_counts(hlo_text).values())


def entry_op_counts(hlo_text: str) -> collections.Counter:
    """Opcodes of the entry computation only: what runs at the top level, each fusion counted once."""
    return collections.Counter(i.opcode for i in instructions(hlo_text) if i.in_entry)


def split_async(opcode: str) -> tuple[str, str]:
    """``('all-reduce', '-start')`` for ``all-reduce-start``; ``(opcode, '')`` for a synchronous op."""
    for phase in ("-start", "-done"):
        if opcode.endswith(phase):
            return opcode.removesuffix(phase), phase
    return opcode, ""


# Entry instructions that do a step's arithmetic (the rest is bookkeeping: parameters, tuples).
COMPUTE_OPCODES = ("fusion", "dot", "convolution", "custom-call")


def schedule_outline(hlo_text: str) -> list[tuple[str, int]]:
    """The entry computation's order of work, as runs: ``[('compute', 3), ('all-reduce-start', 1), ...]``.

    Collectives keep their opcode (with ``-start``/``-done`` when asynchronous), the arithmetic is
    ``'compute'``, bookkeeping is left out. A compiled program's text is scheduled, so this is the order
    in which each device runs its work: what lies between a ``-start`` and its ``-done`` can overlap
    the collective."""
    runs: list[tuple[str, int]] = []
    for inst in instructions(hlo_text):
        if not inst.in_entry:
            continue
        if split_async(inst.opcode)[0] in COLLECTIVE_OPCODES:
            label = inst.opcode
        elif inst.opcode in COMPUTE_OPCODES:
            label = "compute"
        else:
            continue
        if runs and runs[-1][0] == label:
            runs[-1] = (label, runs[-1][1] + 1)
        else:
            runs.append((label, 1))
    return runs


def opcode_of(name: str) -> str:
    """The opcode an instruction's name spells (``all-reduce.3``, ``all-gather-start.1``): XLA
    names instructions after their opcode, with a numeric suffix, and async pairs after both halves."""
    return split_async(re.sub(r"(\.\d+)+$", "", name))[0]


def attribute(rest: str, key: str) -> str:
    """The raw value of ``key=...`` in an instruction's attributes (brackets balanced); ``''`` if absent."""
    start = rest.find(f"{key}=")
    if start < 0:
        return ""
    text = rest[start + len(key) + 1 :]
    # mesh['a'=1,'b'=2] {'b'}, maybe with device_ids=(...) first
    if text.startswith("mesh["):
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


_CALLS = re.compile(r"\b(?:body|condition|calls|to_apply)=%?([\w.\-]+)")
_CALL_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def loop_computations(hlo_text: str) -> set[str]:
    """The computations that run inside a ``while`` body, directly or through what they call."""
    calls: dict[str, set[str]] = collections.defaultdict(set)
    bodies: set[str] = set()
    for i in instructions(hlo_text):
        calls[i.computation].update(_CALLS.findall(i.rest))
        for group in _CALL_LISTS.findall(i.rest):
            calls[i.computation].update(
                c.strip().lstrip("%") for c in group.split(",") if c.strip()
            )
        bodies.update(re.findall(r"\bbody=%?([\w.\-]+)", i.rest))
    inside, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo.extend(calls.get(name, ()))
    return inside


# --- Replica groups ---------------------------------------------------------------------------


def spanned_axes(
    groups: list[list[int]], shape: tuple[int, ...], names: tuple[str, ...]
) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group differ, in ``names``' order:
    device ``i`` of a group sits at position ``i`` of a mesh of ``shape`` flattened in
    row-major order (the ids of a partitioned program's groups are positions in its
    device assignment)."""
    spanned = set()
    for group in groups:
        coords = np.unravel_index(group, shape)
        spanned |= {name for name, row in zip(names, coords) if len(set(row)) > 1}
    return tuple(name for name in names if name in spanned)


def replica_group_lists(
    replica_groups: str, num_devices: int | None = None
) -> list[list[int]]:
    """The device ids of every group, from any of XLA's spellings of ``replica_groups``.

    ``{{0,1},{2,3}}`` lists them; ``[2,4]<=[4,2]T(1,0)`` is an iota (ids ``0..7`` reshaped to
    ``[4,2]``, transposed, then cut into 2 groups of 4); ``mesh['a'=2,'b'=4] {'b'}`` groups the
    devices of a mesh along the named axes (its ids are an iota, or ``device_ids=(...)``),
    or along a sub-axis: ``{'b':(2)2}`` is the part of size 2 of ``b`` that comes after a
    major part of size 2 (Shardy's notation,
    https://github.com/openxla/shardy/blob/main/docs/sharding_representation.md).
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
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh["axes"])}
        over = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", mesh["over"])
        if {name for name, _, _ in over} <= set(sizes):
            # An axis named as a sub-axis 'a':(pre)size splits into (pre, size, rest),
            # major to minor; the group runs along the named parts.
            cut = {name: (int(pre), int(size)) for name, pre, size in over if size}
            dims, at = [], {}
            for name, n in sizes.items():
                pre, size = cut.get(name, (1, n))
                at[name] = len(dims) + 1
                dims += [pre, size, n // (pre * size)]
            ids = _mesh_device_ids(mesh["ids"], tuple(sizes.values())).reshape(dims)
            axes = [at[name] for name, _, _ in over]
            rest = [i for i in range(len(dims)) if i not in axes]
            size = math.prod(dims[i] for i in axes)
            return ids.transpose(rest + axes).reshape(-1, size).tolist()
    raise ValueError(f"cannot read replica groups {replica_groups!r}")


def group_size(replica_groups: str) -> int | None:
    """Devices per group; ``None`` where XLA does not say (``{}``) or spells it in a way not read here."""
    try:
        return len(replica_group_lists(replica_groups)[0])
    except ValueError:
        return None


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
