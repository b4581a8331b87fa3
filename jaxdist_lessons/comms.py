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
companions (``ring_*``, from ``traffic``) say how much a ring algorithm sends for each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxdist_lessons import hlo
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.compiled import compile_fn

# The ring arithmetic lives in traffic.py (JAX-free, for the planner page); comms re-exports it.
from jaxdist_lessons.traffic import KINDS
from jaxdist_lessons.traffic import (
    ring_all_gather_bytes as ring_all_gather_bytes,
)
from jaxdist_lessons.traffic import (
    ring_all_reduce_bytes as ring_all_reduce_bytes,
)
from jaxdist_lessons.traffic import (
    ring_reduce_scatter_bytes as ring_reduce_scatter_bytes,
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program, as one device runs it."""

    kind: str
    dtype: str
    elements: int
    bytes: int
    shapes: hlo.Shapes
    replica_groups: str
    # devices per replica group; None where XLA does not say (or for a permute)
    group_size: int | None
    in_loop: bool
    computation: str
    name: str


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in a compiled program's text, in program order."""
    in_loops = hlo.loop_computations(hlo_text)
    # an async -start op's name -> its attributes (the groups)
    starts: dict[str, str] = {}
    records = []
    for op in hlo.instructions(hlo_text):
        kind, phase = hlo.split_async(op.opcode)
        if kind not in KINDS:
            continue
        if phase == "-start":
            starts[op.name] = op.rest
            continue
        attributes = op.rest
        if phase == "-done":  # the groups are written on the matching -start op
            attributes = starts.get(
                attributes.split(")")[0].strip().lstrip("%"), attributes
            )
        groups = hlo.attribute(attributes, "replica_groups") or hlo.attribute(
            attributes, "source_target_pairs"
        )
        arrays = hlo.shapes(op.shape)
        records.append(
            Collective(
                kind=kind,
                dtype=",".join(dict.fromkeys(dtype for dtype, _ in arrays)),
                elements=sum(math.prod(dims) for _, dims in arrays),
                bytes=hlo.shapes_bytes(arrays),
                shapes=arrays,
                replica_groups=groups,
                group_size=hlo.group_size(groups)
                if kind != "collective-permute"
                else None,
                in_loop=op.computation in in_loops,
                computation=op.computation,
                name=op.name,
            )
        )
    return records


def _check_kind(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(
            f"unknown collective kind {kind!r}; allowed: {', '.join(KINDS)}"
        )


def total_bytes(hlo_text: str, kind: str | None = None) -> int:
    """Bytes of all collectives in the program (per device), or of one ``kind``."""
    _check_kind(kind)
    return sum(c.bytes for c in collectives(hlo_text) if kind is None or c.kind == kind)


def bytes_by_kind(hlo_text: str) -> dict[str, int]:
    """Bytes per device of each kind of collective in the program (the ``bytes`` of ``summary``)."""
    return {kind: row["bytes"] for kind, row in summary(hlo_text).items()}


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
