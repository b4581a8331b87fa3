"""--compile-only: one step compiled for real sizes, nothing allocated; the memory XLA
assigns each device and the bytes of every collective in the compiled program.
"""

import collections
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import schedules
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layout import BATCH, RULES

SIZES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per collective kind in a compiled program, loops times their trip counts,
    a conditional its costliest branch (an upper bound: a pipeline's loop runs a
    forward or a backward or nothing each tick, and is counted as a backward each).

    All-gather: its output; the others: their operand (here, its output too). On a ring
    of n devices each device sends (n-1)/n of that, or 2(n-1)/n for an all-reduce.
    """
    kinds = (
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "all-to-all",
        "collective-permute",
    )
    sizes = SIZES
    own, calls, name = collections.defaultdict(collections.Counter), {}, None
    choices = collections.defaultdict(list)  # computation -> its conditionals' branches
    for line in hlo_text.splitlines():
        if header := re.match(r"(?:ENTRY )?%(\S+) .*\{$", line):
            name = header.group(1)
            calls[name], entry = [], name if line.startswith("ENTRY") else None
            if entry:
                root = name
        elif match := re.match(r"\s*\S+ = (.+?) ([a-z-]+?)(?:-start)?\(", line):
            shape, opcode = match.groups()
            if opcode in kinds:
                own[name][opcode] += sum(
                    sizes[t]
                    * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                    for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape)
                    if t in sizes
                )
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            for callee in re.findall(r"(?:body|calls|to_apply)=%([\w.-]+)", line):
                calls[name].append(
                    (callee, int(trips.group(1)) if trips and opcode == "while" else 1)
                )
            if branches := re.search(r"branch_computations=\{([^}]*)\}", line):
                choices[name].append(re.findall(r"%([\w.-]+)", branches[1]))

    def total(computation: str) -> collections.Counter:
        counts = collections.Counter(own[computation])
        for callee, times in calls.get(computation, []):
            for kind, size in total(callee).items():
                counts[kind] += times * size
        for branches in choices.get(computation, []):
            counts.update(max((total(b) for b in branches), key=lambda c: c.total()))
        return counts

    return dict(total(root))


def host_argument_bytes(hlo_text: str) -> int:
    """The bytes of a compiled program's arguments placed in host memory: those whose
    layout in its entry_computation_layout names memory space 5 (``{1,0:S(5)}``), the
    host's. XLA:CPU keeps the placement in the program, but its memory_analysis()
    counts them as device arguments (on a CPU both are the same memory)."""
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo_text)
    if layout is None:
        return 0
    return sum(
        SIZES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        for dtype, dims, space in re.findall(
            r"(\w+)\[([\d,]*)\]\{[^}]*?(:S\(5\))?\}", layout.group(1)
        )
        if space
    )


def lower_step(step, shapes, args, mesh) -> jax.stages.Lowered:
    """The step lowered for the state's shapes and a global batch of tokens' shapes."""
    tokens = jax.ShapeDtypeStruct(
        (args.global_batch, args.seq_len + 1),
        jnp.int32,
        sharding=NamedSharding(mesh, P(BATCH)),
    )
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        return step.lower(shapes, tokens)


def compile_only(step, shapes, args, mesh) -> None:
    """Compile one step for the requested sizes, allocating nothing; print its costs."""
    start = time.perf_counter()
    compiled = lower_step(step, shapes, args, mesh).compile()
    memory = compiled.memory_analysis()
    arguments, temporaries = memory.argument_size_in_bytes, memory.temp_size_in_bytes
    # Donated arguments are reused for the outputs: only the rest is new memory.
    outputs = memory.output_size_in_bytes - memory.alias_size_in_bytes
    sent = collective_bytes(compiled.as_text())
    seconds, platform = time.perf_counter() - start, jax.devices()[0].platform
    print(
        f"compiled {args.model_config or args.model} on {dict(mesh.shape)} "
        f"in {seconds:.1f} s "
        f"({platform}; XLA:CPU's buffer assignment differs from a GPU's)"
    )
    total = arguments + temporaries + outputs
    print(
        f"per device: arguments {arguments / 1e9:.3f} GB, "
        f"temporaries {temporaries / 1e9:.3f} GB, total {total / 1e9:.3f} GB; "
        "collectives "
        + ", ".join(f"{kind} {size} B" for kind, size in sorted(sent.items())),
        flush=True,
    )
    host = host_argument_bytes(compiled.as_text())
    if host:  # --offload optimizer
        print(
            f"in host memory (the program's memory space 5): arguments "
            f"{host / 1e9:.3f} GB, moved to the device and back each step; "
            f"on the device: arguments {(arguments - host) / 1e9:.3f} GB"
        )
    stages, micro = mesh.shape["pipeline"], args.grad_accum
    if stages > 1:
        print(bubble_line(args.schedule, stages, micro, args.virtual_stages))


def bubble_line(name: str, stages: int, micro: int, virtual: int) -> str:
    """The schedule's idle share, counted on its table (a forward and a backward one
    tick each), next to the formula (P - 1) / (V M + P - 1)."""
    virtual = virtual if name == "interleaved" else 1
    table = schedules.schedule(name, stages, micro, virtual)
    formula = (stages - 1) / (virtual * micro + stages - 1)
    cut = f"{stages} stages" if virtual == 1 else f"{stages} x {virtual} stages"
    return (
        f"pipeline: {name}, {cut} x {micro} micro-batches; idle "
        f"{schedules.idle_fraction(table):.1%} of the table's ticks, "
        f"(P - 1) / (V M + P - 1) = {formula:.1%}; at most "
        f"{max(schedules.in_flight(table))} stage inputs kept per device"
    )
