"""Profile a jitted step: capture a ``jax.profiler`` trace, read it back, and split compute from collectives.

Chapter 07_troubleshooting uses it. ``jax.profiler.trace(log_dir)`` writes, under
``log_dir/plugins/profile/<run>/``, a ``<host>.xplane.pb`` (the XSpace protobuf that
TensorBoard's profile plugin and XProf read) and a ``<host>.trace.json.gz`` (the Chrome
trace-event format that Perfetto opens). The JSON needs only the standard library to read:
every operation XLA ran is an event with ``args.hlo_op``, ``args.hlo_module`` and the
``args.device_ordinal`` it ran on. ``read_xplane`` reads the same events from the protobuf
with ``jax.profiler.ProfileData``, which ships with jax.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import gzip
import io
import json
import math
import pathlib
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist_lessons import comms, hlo
from jaxdist_lessons._checks import positive_int


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One HLO operation that ran on one device: when, for how long (microseconds), and of what kind."""

    op: str  # the HLO instruction, e.g. 'all-reduce.3' or 'dot.1'
    module: str  # the compiled program, e.g. 'jit_train_step'
    device: int
    start_us: float
    duration_us: float

    @property
    def kind(self) -> str:
        """``'collective'`` for communication between devices, ``'compute'`` for everything else."""
        return "collective" if op_kind(self.op) == "collective" else "compute"


def op_kind(op: str) -> str:
    """``'collective'`` if the HLO op ``op`` (e.g. ``'all-reduce.1'``, ``'all-gather-start'``) is one, else ``'compute'``."""
    return "collective" if hlo.opcode_of(op) in hlo.COLLECTIVE_OPCODES else "compute"


def capture(
    fn: Callable, *args: Any, steps: int = 3, log_dir: str | None = None
) -> pathlib.Path:
    """Run ``fn(*args)`` once to compile, then ``steps`` times under
    ``jax.profiler.trace``; the trace directory.

    Each step is wrapped in a ``StepTraceAnnotation`` so that viewers can mark the
    steps.
    """
    positive_int("steps", steps)
    log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="jaxdist-trace-"))
    # compile outside the trace: we profile steady-state steps
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(str(log_dir)):
        for step in range(steps):
            with jax.profiler.StepTraceAnnotation("step", step_num=step):
                jax.block_until_ready(fn(*args))
    return log_dir


def trace_files(log_dir: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """The newest run's files under ``log_dir``: ``{'trace.json.gz': ..., 'xplane.pb': ...}``, those it has."""
    runs = sorted(pathlib.Path(log_dir).glob("plugins/profile/*/"))
    if not runs:
        raise FileNotFoundError(
            f"no profile under {log_dir}: expected plugins/profile/<run>/ written by "
            "jax.profiler.trace(log_dir)"
        )
    files = {}
    for suffix in ("trace.json.gz", "xplane.pb"):
        found = sorted(runs[-1].glob(f"*.{suffix}"))
        if found:
            files[suffix] = found[0]
    return files


def trace_file(log_dir: str | pathlib.Path, suffix: str) -> pathlib.Path:
    """The newest run's ``*.{suffix}`` under ``log_dir``, or a ``FileNotFoundError`` saying what is there."""
    files = trace_files(log_dir)
    if suffix not in files:
        found = ", ".join(p.name for p in files.values()) or "neither"
        raise FileNotFoundError(
            f"the newest profile under {log_dir} has no *.{suffix} (it has {found})"
        )
    return files[suffix]


def read_trace(path: str | pathlib.Path) -> list[OpEvent]:
    """The HLO operations in a ``*.trace.json.gz`` (or a profile directory), in start order."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = trace_file(path, "trace.json.gz")
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = []
    for e in trace.get("traceEvents", []):
        args = e.get("args", {})
        # Complete events ('X') with an hlo_op are XLA running an instruction; the rest are host-side.
        if (
            e.get("ph") == "X"
            and "hlo_op" in args
            and not e["name"].startswith("end: ")
        ):
            events.append(
                OpEvent(
                    op=args["hlo_op"],
                    module=args.get("hlo_module", ""),
                    device=int(args.get("device_ordinal", -1)),
                    start_us=float(e["ts"]),
                    duration_us=float(e.get("dur", 0.0)),
                )
            )
    return sorted(events, key=lambda e: e.start_us)


def read_xplane(path: str | pathlib.Path) -> list[OpEvent]:
    """The same operations read from the ``*.xplane.pb`` (or a profile directory) with ``jax.profiler.ProfileData``."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = trace_file(path, "xplane.pb")
    events = []
    for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" in stats:
                    events.append(
                        OpEvent(
                            op=stats["hlo_op"],
                            module=stats.get("hlo_module", ""),
                            device=int(stats.get("device_ordinal", -1)),
                            start_us=e.start_ns / 1e3,
                            duration_us=e.duration_ns / 1e3,
                        )
                    )
    return sorted(events, key=lambda e: e.start_us)


def op_table(events: Iterable[OpEvent]) -> list[list[Any]]:
    """Rows ``[program, op, kind, runs, total ms, mean us, share of time]``, longest first, summed over devices."""
    totals: dict[tuple[str, str], float] = collections.defaultdict(float)
    runs: collections.Counter = collections.Counter()
    for e in events:
        totals[e.module, e.op] += e.duration_us
        runs[e.module, e.op] += 1
    everything = sum(totals.values()) or 1.0
    return [
        [
            module,
            op,
            op_kind(op),
            runs[module, op],
            total / 1e3,
            total / runs[module, op],
            f"{total / everything:.1%}",
        ]
        for (module, op), total in sorted(totals.items(), key=lambda kv: -kv[1])
    ]


OP_TABLE_HEADERS = ["program", "HLO op", "kind", "runs", "total ms", "mean us", "share"]


def time_by_kind(events: Iterable[OpEvent]) -> dict[str, float]:
    """Microseconds spent in compute and in collectives, summed over devices."""
    totals = {"compute": 0.0, "collective": 0.0}
    for e in events:
        totals[e.kind] += e.duration_us
    return totals


def collective_axes(
    hlo_text: str, mesh: jax.sharding.Mesh
) -> dict[str, tuple[str, str]]:
    """Each collective of a compiled program by its HLO name (``'all-gather.3'``, or
    ``'psum.7'`` where ``jax.shard_map`` named it; an async pair's ``-start`` and ``-done``
    too): its kind, and the mesh axes its groups span (``'fsdp'``, ``'data+fsdp'``), read
    from its replica groups or a permute's pairs. The groups number the devices in the
    mesh's order (the program's device assignment), not by their ids: the two differ
    for a mesh over a reordered list of devices, such as a TPU slice's."""
    out = {}
    for c in comms.collectives(hlo_text):
        groups = hlo.replica_group_lists(c.replica_groups, mesh.size)
        spanned = hlo.spanned_axes(groups, mesh.devices.shape, mesh.axis_names)
        axes = "+".join(spanned) or "none"
        out[c.name] = (c.kind, axes)
        # An async pair's two ops, one collective: all-gather-start.3, all-gather-done.3
        base = re.sub(rf"^{c.kind}-(start|done)", c.kind, c.name)
        for phase in ("-start", "-done"):
            out[base.replace(c.kind, c.kind + phase, 1)] = (c.kind, axes)
    return out


def collective_bytes_by_axis(
    hlo_text: str, mesh: jax.sharding.Mesh
) -> dict[str, dict[str, int]]:
    """Bytes per device and step of each collective kind, by the mesh axes its groups span
    (``{'fsdp': {'all-gather': ...}, 'data+fsdp': {'all-reduce': ...}}``): the recipe's
    count (``jaxdist_lm/compiled.py``'s ``collective_bytes``, loops times their trip
    counts) of the program with only the collectives on those axes left in it. Across
    TPU slices, the sends to the Megascale runtime ("dcn-all-reduce"), which name no
    groups: under the mesh axes along which the slice changes."""
    axes = collective_axes(hlo_text, mesh)
    from jaxdist_lm.compiled import collective_bytes as count

    out = {}
    for spanned in sorted({axis for _, axis in axes.values()}):
        elsewhere = {name for name, (_, axis) in axes.items() if axis != spanned}
        kinds = count(_renamed(hlo_text, elsewhere)).items()
        out[spanned] = {k: v for k, v in kinds if not k.startswith("dcn-")}
    if dcn := {k: v for k, v in count(hlo_text).items() if k.startswith("dcn-")}:
        out.setdefault(slice_axes(mesh), {}).update(dcn)
    return out


def slice_axes(mesh: jax.sharding.Mesh) -> str:
    """The mesh axes along which the devices' TPU slice changes, "+"-joined (the
    recipe's `data`; "none" on one slice)."""
    slices = np.vectorize(lambda d: getattr(d, "slice_index", 0))(mesh.devices)
    changes = [
        axis
        for k, axis in enumerate(mesh.axis_names)
        if (np.diff(slices, axis=k) != 0).any()
    ]
    return "+".join(changes) or "none"


def _renamed(hlo_text: str, names: set[str]) -> str:
    """The program with the instructions called ``names`` given an opcode no collective
    has (``all-gather-elsewhere``), so that counting passes over them."""
    lines = hlo_text.splitlines()
    for i, line in enumerate(lines):
        found = re.match(r"\s*(?:ROOT\s+)?%?([^\s=]+) = .*? ([a-z][a-z0-9-]*)\(", line)
        if found and found[1] in names:
            lines[i] = line[: found.end(2)] + "-elsewhere" + line[found.end(2) :]
    return "\n".join(lines)


def _overlap_us(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    """Microseconds of [start, end) covered by the sorted, disjoint ``busy`` intervals
    (from the last one that starts at or before ``start``: a trace holds thousands)."""
    i, covered = max(bisect.bisect_right(busy, (start, math.inf)) - 1, 0), 0.0
    while i < len(busy) and busy[i][0] < end:
        a, b = busy[i]
        covered += max(0.0, min(end, b) - max(start, a))
        i += 1
    return covered


def time_by_axis(
    events: Iterable[OpEvent], collectives: dict[str, tuple[str, str]]
) -> dict[str, dict]:
    """Compute time and, per mesh axis (``collective_axes``), the collectives' time and
    their exposed time, the part during which the same device computed nothing (all in
    microseconds, summed over devices), and which collectives ran (``{kind: names}``).
    An operation is a collective when the compiled program says so."""
    events = list(events)
    is_collective = lambda e: e.op in collectives or e.kind == "collective"
    busy: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in sorted(events, key=lambda e: e.start_us):
        if is_collective(e):
            continue
        spans, end = busy[e.device], e.start_us + e.duration_us
        if spans and e.start_us <= spans[-1][1]:  # merge into one busy interval
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((e.start_us, end))
    out: dict[str, dict] = {"compute": {"time_us": 0.0}}
    for e in events:
        if not is_collective(e):
            out["compute"]["time_us"] += e.duration_us
            continue
        kind, axis = collectives.get(e.op, (hlo.opcode_of(e.op), "unknown"))
        row = out.setdefault(axis, {"time_us": 0.0, "exposed_us": 0.0, "ops": {}})
        end = e.start_us + e.duration_us
        row["time_us"] += e.duration_us
        row["exposed_us"] += e.duration_us - _overlap_us(
            e.start_us, end, busy[e.device]
        )
        row["ops"].setdefault(kind, set()).add(e.op)
    return out


def recipe_program(flags: Sequence[str]) -> tuple[str, jax.sharding.Mesh]:
    """The compiled text of ``jaxdist_lm/train.py``'s step for ``flags`` (what
    ``--compile-only`` compiles, on this process's devices) and its mesh: the program a
    ``--profile`` trace of the same flags ran."""
    from jaxdist_lm import compiled, train

    run = train.parse_args([*flags, "--compile-only"])
    with contextlib.redirect_stdout(io.StringIO()):  # setup's once-only notes
        mesh, _, _, step, shapes, _ = train.setup(run)
    return compiled.lower_step(step, shapes, run, mesh).compile().as_text(), mesh


def recipe_time_by_axis(flags: Sequence[str], trace_dir: str | pathlib.Path) -> dict:
    """``time_by_axis`` of the recipe's step in the trace under ``trace_dir`` (one
    process's, ``--profile DIR`` writes ``DIR/process_0``), as JSON: per axis its
    milliseconds, exposed milliseconds and collectives counted by kind."""
    text, mesh = recipe_program(flags)
    events = [e for e in read_trace(trace_dir) if e.module == "jit_train_step"]
    by_axis = time_by_axis(events, collective_axes(text, mesh))
    return {
        axis: {
            "ms": row["time_us"] / 1e3,
            "exposed_ms": row.get("exposed_us", 0.0) / 1e3,
            "collectives": {kind: len(ops) for kind, ops in row.get("ops", {}).items()},
        }
        for axis, row in by_axis.items()
    }


def perfetto_instructions(log_dir: str | pathlib.Path) -> str:
    """How to open this trace in Perfetto and in TensorBoard, with its real paths."""
    return (
        f"Perfetto: open https://ui.perfetto.dev, choose 'Open trace file' and pick\n"
        f"    {trace_file(log_dir, 'trace.json.gz')}\n"
        "  (or call jax.profiler.trace(log_dir, create_perfetto_link=True), which serves the trace and\n"
        "  waits until you open the link it prints).\n"
        f"TensorBoard: pip install tensorboard xprof, then\n"
        f"    tensorboard --logdir {log_dir}\n"
        "  and open the Profile tab; it reads the .xplane.pb file."
    )
