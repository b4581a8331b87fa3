"""Pipeline schedules as tables: which operation each device runs at each tick.

GPipe (arXiv:1811.06965), 1F1B (arXiv:2006.09503) and interleaved 1F1B
(arXiv:2104.04473), in Python and NumPy only: the book's package loads this same file.
"""

from typing import NamedTuple

import numpy as np


# S x v stages, device d holding stages d, d + S, ...; M micro-batches. An operation, F
# (one micro-batch's forward through one stage) or B (its backward), takes one tick.
class Op(NamedTuple):
    """One slot of a schedule: ``kind`` 'F' or 'B', of ``micro`` through ``stage``."""

    kind: str
    micro: int
    stage: int


# table[tick][device]
Timetable = list[list[Op | None]]
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def simulate(orders: list[list[Op]], num_stages: int) -> Timetable:
    """Run each device's ``orders`` in turn, each op as soon as its input is ready."""
    # A forward needs the previous stage's forward; a backward the next stage's
    # backward and its own forward.
    # op -> the tick it ran
    done: dict[tuple[str, int, int], int] = {}
    last = num_stages - 1
    position = [0] * len(orders)
    table: Timetable = []
    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        tick, row = len(table), []
        for d, order in enumerate(orders):
            op = order[position[d]] if position[d] < len(order) else None
            if op is not None:
                k, m, s = op
                need = [("F", m, s - 1)] if k == "F" and s > 0 else []
                if k == "B":
                    need = [("F", m, s)] + ([("B", m, s + 1)] if s < last else [])
                if not all(done.get(n, tick) < tick for n in need):
                    op = None
            row.append(op)
        for d, op in enumerate(row):
            if op is not None:
                done[tuple(op)] = tick
                position[d] += 1
        table.append(row)
        if len(table) > 4 * sum(map(len, orders)) + 8:
            raise RuntimeError("schedule deadlocked")
    return table


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Timetable:
    """GPipe: every device runs all its forwards, then all its backwards."""
    _positive("num_stages", num_stages)
    micro = range(_positive("num_microbatches", num_microbatches))
    orders = [
        [Op("F", m, d) for m in micro] + [Op("B", m, d) for m in micro]
        for d in range(num_stages)
    ]
    return simulate(orders, num_stages)


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Timetable:
    """1F1B: ``S - 1 - d`` warm-up forwards on device ``d``, then forward, backward."""
    S = _positive("num_stages", num_stages)
    M = _positive("num_microbatches", num_microbatches)
    orders = []
    for d in range(S):
        warmup = min(S - 1 - d, M)
        order = [Op("F", m, d) for m in range(warmup)]
        for i in range(M - warmup):
            order += [Op("F", warmup + i, d), Op("B", i, d)]
        order += [Op("B", m, d) for m in range(M - warmup, M)]
        orders.append(order)
    return simulate(orders, S)


def interleaved_schedule(
    num_stages: int, num_microbatches: int, virtual: int
) -> Timetable:
    """Megatron's interleaved 1F1B: device ``d`` holds stages ``d, d + S, ...``; ``M``
    a multiple of ``S``."""
    S = _positive("num_stages", num_stages)
    M = _positive("num_microbatches", num_microbatches)
    v = _positive("virtual", virtual)
    if M % S:
        raise ValueError(
            f"interleaved 1F1B needs microbatches ({M}) in groups of the stages ({S})"
        )

    def nth(d: int, i: int, kind: str) -> Op:
        # The i-th forward: micro-batches in groups of S through chunk 0, then 1, ...
        group, rest = divmod(i, S * v)
        chunk, m = divmod(rest, S)
        if kind == "B":
            chunk = v - 1 - chunk
        return Op(kind, group * S + m, chunk * S + d)

    orders = []
    for d in range(S):
        total = M * v
        warmup = min((S - d - 1) * 2 + (v - 1) * S, total)
        order = [nth(d, i, "F") for i in range(warmup)]
        for i in range(total - warmup):
            order += [nth(d, warmup + i, "F"), nth(d, i, "B")]
        order += [nth(d, i, "B") for i in range(total - warmup, total)]
        orders.append(order)
    return simulate(orders, S * v)


def schedule(name: str, num_stages: int, num_microbatches: int, virtual: int = 1):
    """The table of ``name`` (one of SCHEDULES); ``virtual`` is interleaved's alone."""
    if name == "interleaved":
        return interleaved_schedule(num_stages, num_microbatches, virtual)
    if virtual != 1:
        raise ValueError(f"{name} runs one stage per device: virtual must be 1")
    if name == "gpipe":
        return gpipe_schedule(num_stages, num_microbatches)
    if name == "1f1b":
        return one_f_one_b_schedule(num_stages, num_microbatches)
    raise ValueError(f"schedule {name!r}: expected one of {SCHEDULES}")


def idle_fraction(table: Timetable) -> float:
    """The share of (tick, device) slots in a schedule with nothing to do."""
    slots = [slot for row in table for slot in row]
    return sum(slot is None for slot in slots) / len(slots)


def in_flight(table: Timetable) -> list[int]:
    """Per device, the most forwards whose backward has not run yet, at once."""
    peaks = []
    for d in range(len(table[0])):
        live = peak = 0
        for row in table:
            if row[d] is not None:
                live += 1 if row[d].kind == "F" else -1
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


def slot_tables(table: Timetable) -> tuple[dict[str, np.ndarray], int, int]:
    """A schedule as integer arrays ``[tick, device]`` a compiled loop can index, and
    the two pool sizes: the most inputs, and the most gradients, a device holds at once.
    """
    S = len(table[0])
    last = max(op.stage for row in table for op in row if op)
    # kind: 0 idle, 1 F, 2 B; chunk: c for stage c S + d; slot and gslot: the input
    # and gradient slots an op reads; recv_f and recv_b: 1 + the slot an arrival
    # fills, 0 for none.
    names = ("kind", "micro", "chunk", "slot", "gslot", "recv_f", "recv_b")
    a = {k: np.zeros((len(table), S), np.int32) for k in names}
    # per device: (micro, stage) -> slot
    held_x: list[dict] = [{} for _ in range(S)]
    held_g: list[dict] = [{} for _ in range(S)]
    pools = [1, 1]

    def take(held: dict, key: tuple[int, int]) -> int:
        held[key] = min(set(range(len(held) + 1)) - set(held.values()))
        return held[key]

    for t, row in enumerate(table):
        # This tick's ops read (and free) their slots...
        for d, op in enumerate(row):
            if op is None:
                continue
            key = (op.micro, op.stage)
            a["kind"][t, d], a["micro"][t, d] = (1 if op.kind == "F" else 2), op.micro
            a["chunk"][t, d] = op.stage // S
            if op.kind == "F":
                a["slot"][t, d] = held_x[d][key] if op.stage else take(held_x[d], key)
            else:
                a["slot"][t, d] = held_x[d].pop(key)
                a["gslot"][t, d] = held_g[d].pop(key) if op.stage < last else 0
        # ...then what they sent arrives, into free slots.
        for op in row:
            if op and op.kind == "F" and op.stage < last:
                to = (op.stage + 1) % S
                a["recv_f"][t, to] = take(held_x[to], (op.micro, op.stage + 1)) + 1
            if op and op.kind == "B" and op.stage > 0:
                to = (op.stage - 1) % S
                a["recv_b"][t, to] = take(held_g[to], (op.micro, op.stage - 1)) + 1
        pools[0] = max(pools[0], *map(len, held_x))
        pools[1] = max(pools[1], *map(len, held_g))
    return a, pools[0], pools[1]
