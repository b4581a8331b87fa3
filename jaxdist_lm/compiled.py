"""--compile-only: one step compiled for real sizes, nothing allocated; the memory XLA
assigns each device and the bytes of every collective in the compiled program.
"""

import collections
import dataclasses
import math
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import mesh_spec, schedules
from . import model as model_lib
from .hlo_dtypes import BYTES
from .layout import BATCH, RULES
from .run_config import RunConfig

# A computation's first line (its name), and an instruction's: its name, its shape, its
# opcode (an async op's "-start" apart).
COMPUTATION = r"(?:ENTRY )?%(\S+) .*\{$"
INSTRUCTION = r"\s*(?:ROOT )?%?([\w.-]+) = (.+?) ([a-z-]+?)(-start)?\("


def loop_trips(hlo_text: str) -> dict[str, int]:
    """Each while loop's trip count, by the loop's name."""
    # XLA:CPU writes the count in the loop's backend_config; the TPU compiler does not,
    # and the loop's condition (i < N) and the counter's first value give it: N - first,
    # since the TPU compiler may peel a loop's first trip and start the counter at 1.
    scalars, firsts, bounds, trips = {}, {}, {}, {}
    constants, name = collections.defaultdict(list), None
    for line in hlo_text.splitlines():
        if header := re.match(COMPUTATION, line):
            name = header[1]
        elif found := re.match(
            r"\s*(?:ROOT )?%([\w.-]+) = (.+?) ([a-z-]+)\((.*)", line
        ):
            target, shape, opcode, rest = found.groups()
            operand = re.match(r"%([\w.-]+)", rest)
            if opcode == "constant" and shape.startswith("s32[]"):
                scalars[target] = int(re.match(r"-?\d+", rest)[0])
                constants[name].append(scalars[target])
            elif opcode == "copy" and operand and operand[1] in scalars:
                scalars[target] = scalars[operand[1]]
            elif opcode == "tuple" and operand:
                firsts[target] = operand[1]
            elif opcode == "compare" and "direction=LT" in rest:
                if len(constants[name]) == 1:
                    bounds[name] = constants[name][0]
            elif opcode == "while":
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                condition = re.search(r"condition=%([\w.-]+)", rest)[1]
                first = scalars.get(firsts.get(operand and operand[1]), 0)
                counted = bounds.get(condition, first + 1) - first
                if not known and counted < 1:
                    raise ValueError(f"{target}: {counted} trips, from its condition")
                trips[target] = int(known[1]) if known else counted
    return trips


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per collective kind in a compiled program, loops times their trip counts,
    a conditional its costliest branch (an upper bound for a pipeline's ticks)."""
    # All-gather and reduce-scatter count their output, the others their operand; on
    # a ring of n devices each sends (n-1)/n of that, or 2(n-1)/n of an all-reduce's.
    kinds = (
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "all-to-all",
        "collective-permute",
    )
    own, calls, name = collections.defaultdict(collections.Counter), {}, None
    # computation -> its conditionals' branches
    choices = collections.defaultdict(list)
    trips, echoes, scattering = loop_trips(hlo_text), set(), set()
    for line in hlo_text.splitlines():
        if header := re.match(COMPUTATION, line):
            name = header.group(1)
            calls[name], entry = [], name if line.startswith("ENTRY") else None
            if entry:
                root = name
        elif match := re.match(INSTRUCTION, line):
            target, shape, opcode, start = match.groups()
            # Across TPU slices the program sends to the Megascale runtime, over the
            # data-center network: "dcn-all-reduce", counted by its operand.
            dcn = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
            if opcode == "send" and dcn:
                opcode = "dcn-" + dcn[1].lower().replace("_", "-")
            # The TPU compiler's reduce-scatter is an all-reduce, then each device's
            # slice of its result: counted as a reduce-scatter, by that slice.
            if name.startswith("all-reduce-scatter"):
                if opcode == "all-reduce":
                    scattering.add(name)
                    continue
                if line.lstrip().startswith("ROOT") and name in scattering:
                    opcode = "reduce-scatter"
            if opcode in kinds or opcode.startswith("dcn-"):
                tensors = re.findall(r"(\w+)\[([\d,]*)\]", shape)
                # A send's shape is (operand, u32[], token[]); an async start's
                # (operand, output, ...), of which the output counts.
                if opcode.startswith("dcn-"):
                    tensors = tensors[:1]
                elif start and shape.startswith("(") and opcode != "all-reduce":
                    tensors = tensors[1:2]
                own[name][opcode] += sum(
                    BYTES[t]
                    * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                    for t, dims in tensors
                    if t in BYTES
                )
            trip = trips.get(target, 1) if opcode == "while" else 1
            for callee in re.findall(r"(?:body|calls|to_apply)=%([\w.-]+)", line):
                calls[name].append((callee, trip))
            # The TPU compiler writes an async collective three times: in the fusion
            # that starts it (counted), in those that overlap it with compute and in
            # the one that waits for it (echoes, not counted).
            if "AsyncCollectiveDone" in line or name.startswith("async_collective"):
                echoes.add(name)
            if branches := re.search(r"branch_computations=\{([^}]*)\}", line):
                choices[name].append(re.findall(r"%([\w.-]+)", branches[1]))

    def total(computation: str) -> collections.Counter:
        counts = collections.Counter({} if computation in echoes else own[computation])
        for callee, times in calls.get(computation, []):
            for kind, size in total(callee).items():
                counts[kind] += times * size
        for branches in choices.get(computation, []):
            counts.update(max((total(b) for b in branches), key=lambda c: c.total()))
        return counts

    return dict(total(root))


def host_argument_bytes(hlo_text: str) -> int:
    """The bytes of a compiled program's arguments in host memory: memory space 5
    (``{1,0:S(5)}``) in its entry_computation_layout. XLA:CPU's memory_analysis()
    counts them as device arguments (on a CPU both are the same memory)."""
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo_text)
    if layout is None:
        return 0
    return sum(
        BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        for dtype, dims, space in re.findall(
            r"(\w+)\[([\d,]*)\]\{[^}]*?(:S\(5\))?\}", layout.group(1)
        )
        if space
    )


def lower_step(step, shapes, run: RunConfig, mesh, platform=None) -> jax.stages.Lowered:
    """The step lowered for the state's and a global batch's shapes, for this machine
    or for ``platform`` ("cuda": a GPU's program, written without a GPU)."""
    tokens = jax.ShapeDtypeStruct(
        (run.global_batch, run.seq_len + 1),
        jnp.int32,
        sharding=NamedSharding(mesh, P(BATCH)),
    )
    # Chips that are not here (train.py --topology) get the mesh's shape alone: with
    # the devices too, JAX would run the constants made while tracing (the splash
    # kernel's block maps) on them.
    here = mesh.devices.flat[0] in jax.devices()
    abstract = jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
    with jax.set_mesh(mesh) if here else abstract, nn.logical_axis_rules(RULES):
        if platform is None:
            return step.lower(shapes, tokens)
        return step.trace(shapes, tokens).lower(lowering_platforms=(platform,))


def host_placements(lowered_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, global shape) of each value a lowered program moves to host memory."""
    # JAX lowers a device_put to "pinned_host" as annotate_device_placement for GPUs
    # and TPUs; for XLA:CPU it writes none.
    types = re.findall(
        r"@annotate_device_placement\(.*\"pinned_host\".*: \(tensor<([^>]*)>\)",
        lowered_text,
    )
    return [
        (dtype, tuple(int(d) for d in dims))
        for *dims, dtype in (t.split("x") for t in types)
    ]


def offloaded_activations(step, shapes, run: RunConfig, mesh) -> str:
    """--offload activations: what goes to host memory, and the bytes a device moves
    there and back each step, read from the program lowered for CUDA (XLA:CPU's drops
    the placement)."""
    placed = host_placements(lower_step(step, shapes, run, mesh, "cuda").as_text())
    # a micro-batch's rows
    rows = run.global_batch // run.grad_accum
    inputs = [
        (dtype, shape) for dtype, shape in placed if shape[:2] == (rows, run.seq_len)
    ]
    # Stop unless it is one layer input a layer: JAX's offloading under scan and remat
    # has been silently ineffective (jax#23869). The other placements are the
    # optimizer's state, with --offload optimizer.
    if len(inputs) != 1:
        raise SystemExit(
            f"--offload activations: the program lowered for CUDA moves {inputs} to "
            f"host memory, not one ({rows}, {run.seq_len}, width) layer input"
        )
    [(dtype, shape)] = inputs
    # the layers' scan stacks them on a leading axis
    layers = jax.tree.leaves(shapes.params["layers"])[0].shape[0]
    # a layer's input is sharded as the residual stream
    residual = nn.logical_to_mesh_axes(model_lib.RESIDUAL, RULES)
    local = NamedSharding(mesh, residual).shard_shape(shape)
    sent = BYTES[dtype] * math.prod(local) * layers * run.grad_accum
    return (
        f"in host memory (the program lowered for CUDA; XLA:CPU's keeps all in device "
        f"memory): each layer's input, {dtype}[{','.join(map(str, shape))}] a "
        f"micro-batch, {dtype}[{','.join(map(str, local))}] a device; {layers} layers "
        f"x {run.grad_accum} micro-batches = {sent} B ({sent / 1e9:.3f} GB) a "
        f"device, moved to the host and back each step"
    )


def compile_only(step, shapes, run: RunConfig, mesh, eval_step=None) -> None:
    """Compile one step at full size, allocating nothing, and print its costs.

    Also the evaluation step's memory (``eval_step``) and, where the devices report a
    limit, the largest --global-batch that fits (largest_batch)."""
    start = time.perf_counter()
    try:
        compiled = lower_step(step, shapes, run, mesh).compile()
    # A TPU's compiler refuses a program that does not fit (XLA:CPU never does).
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        needed = needed_bytes(str(error), sum(state_bytes(shapes)))
        largest = needed and largest_batch(step, shapes, run, mesh, needed)
        raise SystemExit(
            out_of_memory(str(error), shapes, run, mesh, largest)
        ) from None
    memory = compiled.memory_analysis()
    arguments, temporaries = memory.argument_size_in_bytes, memory.temp_size_in_bytes
    # Donated arguments are reused for the outputs: only the rest is new memory.
    outputs = memory.output_size_in_bytes - memory.alias_size_in_bytes
    sent = collective_bytes(compiled.as_text())
    seconds, device = time.perf_counter() - start, mesh.devices.flat[0]
    where = {
        "cpu": "XLA:CPU's buffer assignment, not a GPU's",
        "tpu": f"{device.device_kind}: the TPU compiler's buffer assignment",
    }.get(device.platform, device.platform)
    if run.topology:
        where += f", for {run.slices} x {run.topology} with no chip here"
    print(
        f"compiled {run.model_config or run.model} on "
        f"{mesh_spec.mesh_flag(dict(mesh.shape))} in {seconds:.1f} s ({where})"
    )
    total = arguments + temporaries + outputs
    print(format_summary(arguments, temporaries, total, sent), flush=True)
    host = host_argument_bytes(compiled.as_text())
    # only with --offload optimizer
    if host:
        print(
            f"in host memory (the program's memory space 5): arguments "
            f"{host / 1e9:.3f} GB, moved to the device and back each step; "
            f"on the device: arguments {(arguments - host) / 1e9:.3f} GB"
        )
    if "activations" in run.offload:
        print(offloaded_activations(step, shapes, run, mesh))
    stages, micro = mesh.shape["pipeline"], run.grad_accum
    if stages > 1:
        print(bubble_line(run.schedule, stages, micro, run.virtual_stages))
    if eval_step is not None:
        held_out = lower_step(eval_step, shapes, run, mesh).compile()
        print(
            f"the evaluation step: total "
            f"{program_total(held_out.memory_analysis()) / 1e9:.3f} GB a device"
        )
    if line := largest_batch(step, shapes, run, mesh, total):
        print(line, flush=True)


def program_total(memory) -> int:
    """A program's memory a device (``memory_analysis()``): arguments, temporaries and
    the outputs that reuse no donated argument."""
    return (
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )


def memory_limit() -> int | None:
    """The bytes JAX may use on each device (``memory_stats()``'s ``bytes_limit``);
    None where the devices keep no count (XLA:CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return stats.get("bytes_limit") if stats else None


UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def needed_bytes(error: str, arguments: int = 0) -> int | None:
    """The bytes a program that did not fit asked for, from the compiler's message;
    None if it says no total (a run's "Attempting to allocate 1.00G")."""
    # XLA:TPU: "Ran out of memory in memory space hbm. Used 16.31G of 15.75G hbm".
    if used := re.search(r"Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm", error):
        return round(float(used[1]) * UNITS[used[2]])
    # jax 0.10.2's libtpu: "the total memory required for HLO temporaries (18.67G)
    # exceeds available HBM", to which the program's arguments are added.
    if temporaries := re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\)", error):
        return round(float(temporaries[1]) * UNITS[temporaries[2]]) + arguments
    return None


def step_bytes(step, shapes, run: RunConfig, mesh) -> int | None:
    """The step's memory a device at the run's sizes: compiled, or what the compiler
    said it needed when it refused; None if it said nothing."""
    try:
        compiled = lower_step(step, shapes, run, mesh).compile()
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        return needed_bytes(str(error), sum(state_bytes(shapes)))
    return program_total(compiled.memory_analysis())


def most_rows(rows: tuple[int, int], totals: tuple[int, int], limit: int) -> int:
    """The most rows a device within ``limit`` bytes, memory taken as a straight line
    (fixed + per row) through two sizes' (rows, totals)."""
    (r1, r2), (t1, t2) = rows, totals
    per_row = (t1 - t2) / (r1 - r2)
    if per_row <= 0:
        return 0
    return max(int((limit - (t1 - per_row * r1)) // per_row), 0)


def largest_batch(step, shapes, run: RunConfig, mesh, total: int) -> str | None:
    """The largest --global-batch at this --grad-accum that fits the devices' memory,
    from ``total`` (the step's bytes) and a second compilation of the same step at half
    the batch (the state does not depend on the batch, only the tokens' shape does)."""
    ways = math.prod(mesh.shape[axis] for axis in BATCH)
    # a micro-batch's rows on one device
    rows = run.global_batch // (run.grad_accum * ways)
    limit = memory_limit()
    if rows < 2 or rows % 2 or not limit:
        return None
    halved = dataclasses.replace(run, global_batch=run.global_batch // 2)
    half = step_bytes(step, shapes, halved, mesh)
    if half is None:
        return None
    most = most_rows((rows, rows // 2), (total, half), limit)
    batch = most * ways * run.grad_accum
    if not batch:
        return f"no --global-batch fits at --grad-accum {run.grad_accum}"
    return (
        f"the largest batch that fits ({limit / 1e9:.2f} GB): --global-batch {batch} "
        f"--grad-accum {run.grad_accum}"
    )


def state_bytes(shapes) -> tuple[int, int]:
    """(the weights', the optimizer state's) bytes on a device; what --offload
    optimizer keeps in host memory left out."""
    on_device = lambda tree: sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(tree)
        if x.sharding.memory_kind != "pinned_host"
    )
    return on_device(shapes.params), on_device(shapes.opt_state)


def out_of_memory(
    error: str, shapes, run: RunConfig, mesh, largest: str | None = None
) -> str:
    """One line for a step that does not fit: what it needs, what a device has, and
    flags that would make it fit."""
    weights, optimizer = state_bytes(shapes)
    needed, limit = needed_bytes(error, weights + optimizer), memory_limit()
    # The weights, their gradient and the moments stay; the rest grows with the
    # micro-batch.
    state = 2 * weights + optimizer
    said = f"needs {needed / 1e9:.2f} GB a device" if needed else "ran out of memory"
    has = f", the device has {limit / 1e9:.2f} GB" if limit else ""
    tries, full = [], limit and state > 0.9 * limit
    if full and run.moments == "float32" and optimizer:
        tries.append("--moments bfloat16 (Adam's moments in half the bytes)")
    if full and "optimizer" not in run.offload:
        tries.append("--offload optimizer (the moments to host memory)")
    if limit and needed and needed > state:
        rest, accum = needed - state, run.grad_accum
        # Going from one micro-batch to several adds the gradients' running sum
        # (float32, as large as the weights).
        summed = state + (weights if accum == 1 else 0)
        fits = lambda k: summed + rest * run.grad_accum / k <= 0.9 * limit
        while accum < run.global_batch and not fits(accum):
            accum *= 2
        if accum > run.grad_accum and fits(accum) and run.global_batch % accum == 0:
            tries.append(f"--grad-accum {accum}")
    if run.remat != "full":
        tries.append("--remat full")
    if largest:
        tries.append(largest)
    weights_line = f"weights, gradients and optimizer state {state / 1e9:.2f} GB"
    # the start of XLA's own message
    xla = " ".join(error.split())[:160]
    flags = "; ".join(tries) or "more devices (--mesh fsdp=...)"
    return f"out of memory: the step {said}{has} ({weights_line}); try {flags} [{xla}]"


def format_summary(
    arguments: int, temporaries: int, total: int, sent: dict[str, int]
) -> str:
    """--compile-only's numbers, as it prints them (``read_summary`` reads them back):
    memory per device in GB, then each collective kind's bytes per device and step."""
    lines = [
        f"per device: arguments {arguments / 1e9:.3f} GB, "
        f"temporaries {temporaries / 1e9:.3f} GB, total {total / 1e9:.3f} GB",
        "collectives per device and step:" + ("" if sent else " none"),
    ]
    lines += [f"  {kind:<18} {size:>18,} B" for kind, size in sorted(sent.items())]
    return "\n".join(lines)


def read_summary(text: str) -> dict:
    """``format_summary``'s numbers from a run's output: {"arguments", "temporaries",
    "total"} in GB as printed, and "collectives", bytes by kind."""
    lines = text[text.index("per device: ") :].splitlines()
    found = dict(re.findall(r"(arguments|temporaries|total) ([\d.]+) GB", lines[0]))
    heading = lines[1] if len(lines) > 1 else ""
    if len(found) < 3 or not heading.startswith("collectives per device and step:"):
        raise ValueError(f"not --compile-only's summary: {lines[:2]}")
    memory = {key: float(found[key]) for key in ("arguments", "temporaries", "total")}
    sent = {}
    for line in lines[2:]:
        if not (kind := re.fullmatch(r"  ([a-z-]+) +([\d,]+) B", line)):
            break
        sent[kind[1]] = int(kind[2].replace(",", ""))
    return {**memory, "collectives": sent}


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
