"""What a collective sends, as arithmetic: ring algorithms, ``Transfer`` records, seconds on a link.

Standard library only (no JAX, no NumPy), so that the planner (``planning``) also runs in the
browser, in the "Plan your run" page's Pyodide. ``comms`` reads the same collectives out of
compiled programs and ``costmodel`` predicts them; both import what is here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxdist_lessons import hardware
from jaxdist_lessons._checks import positive_int

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


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


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective as ``comms`` reports it: kind, bytes of its result on one device, devices in its group."""

    kind: str
    bytes: float
    group_size: int | None
    what: str = ""
    axes: tuple[str, ...] = ()  # the mesh axes its groups span, where known
    # how many collectives carry ``bytes`` between them (a step's per-layer gathers): each
    # pays its ring's latency (the planner's ``timing.latency_seconds``)
    calls: int = 1


def ring_steps(transfer: Transfer) -> int:
    """Steps of the ring a collective runs, each a message to the next device: ``N - 1``
    for a gather, a reduce-scatter or an all-to-all, ``2 (N - 1)`` for an all-reduce (the
    two of them), one for a permute."""
    g = transfer.group_size
    if transfer.kind == "collective-permute" or g is None:
        return 1
    return (2 if transfer.kind == "all-reduce" else 1) * (g - 1)


def sent_bytes(transfer: Transfer) -> float:
    """Bytes one device sends for a collective, with ring algorithms (``ring_*`` above)."""
    g, b = transfer.group_size, transfer.bytes
    if transfer.kind not in KINDS:
        raise ValueError(
            f"unknown collective kind {transfer.kind!r}; allowed: {', '.join(KINDS)}"
        )
    if transfer.kind == "collective-permute" or g is None:
        return b  # a permute sends its whole buffer once
    if transfer.kind == "all-reduce":
        return ring_all_reduce_bytes(b, g)
    if transfer.kind == "all-gather":
        return ring_all_gather_bytes(b, g)
    # its result is one shard of the reduced array
    if transfer.kind == "reduce-scatter":
        return ring_reduce_scatter_bytes(b * g, g)
    # all-to-all: each device keeps 1/g of its buffer and sends the rest
    return (g - 1) / g * b


def comm_seconds(transfers: Iterable[Transfer], hw: hardware.Chip) -> float:
    """Seconds to send every transfer at the interconnect's bandwidth, one after another."""
    return sum(sent_bytes(t) for t in transfers) / hw.link_bytes_per_s
