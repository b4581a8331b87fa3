"""--mesh: the mesh's axes, a spec such as 'fsdp=4,tensor=2' read into sizes, the rules
from logical axis names to mesh axes, and whether every dimension splits evenly.

Standard library only: the book's planner reads this same file, so that it proposes no
mesh the recipe refuses.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, NamedTuple

# the recipe's run_config.py, or the planner's link to it
if TYPE_CHECKING:
    from .run_config import RunConfig

# 'tensor' last: its devices are neighbours, in one node; 'sequence' next (a ring of
# keys and values); 'pipeline' first, the one whose traffic (a stage's activations)
# crosses nodes best.
AXES = ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")

# the mesh axes that split the batch rows
BATCH = ("data", "fsdp", "expert")

# Logical axis -> mesh axis. Weights: FSDP splits the model width; tensor parallelism
# splits heads, MLP width and vocabulary (Megatron's column/row split); 'expert' splits
# the experts. Activations: the batch over data, fsdp and expert (experts aside,
# 'expert' is one more data axis); the sequence over 'sequence' (context parallelism)
# and, between blocks, over 'tensor' too (Megatron's sequence parallelism); routed
# tokens by expert, not by row; the embedding lookup's output by the batch's replicas.
# A head's width ("head_dim") is never split: named None, since NNX keeps a name that
# no rule maps as a mesh axis's name.
RULES = (
    ("batch", BATCH),
    ("expert_batch", ("data", "fsdp")),
    ("lookup_batch", ("pipeline", "data", "expert")),
    ("layers", "pipeline"),
    ("embed", "fsdp"),
    ("experts", "expert"),
    ("act_experts", "expert"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("act_seq", "sequence"),
    ("act_seq_residual", ("sequence", "tensor")),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def parse(spec: str, devices: int | None = None) -> dict[str, int]:
    """'data=2,tensor=2' -> a size for each of AXES, 1 where the spec says nothing;
    with ``devices``, one may be -1 (the rest) and they multiply to ``devices``."""
    sizes = dict.fromkeys(AXES, 1)
    for item in spec.split(","):
        axis, _, size = item.partition("=")
        lowest = -1 if devices is not None else 1
        if axis not in sizes or not re.fullmatch(r"-?\d+", size) or int(size) < lowest:
            raise ValueError(f"--mesh {spec}: expected axis=size with axes {AXES}")
        if int(size) == 0:
            raise ValueError(f"--mesh {spec}: an axis of size 0 holds no devices")
        sizes[axis] = int(size)
    if devices is None:
        return sizes
    known = math.prod(s for s in sizes.values() if s != -1)
    rest = [axis for axis, size in sizes.items() if size == -1]
    if len(rest) > 1 or devices % known:
        raise ValueError(f"--mesh {spec} does not fit {devices} devices")
    for axis in rest:
        sizes[axis] = devices // known
    if math.prod(sizes.values()) != devices:
        raise ValueError(
            f"--mesh {spec} has {math.prod(sizes.values())} devices, "
            f"not the {devices} there are"
        )
    return sizes


def mesh_flag(sizes: dict[str, int]) -> str:
    """parse's inverse: the axes above 1, as --mesh takes them ('data=1' for one)."""
    return ",".join(f"{a}={sizes[a]}" for a in AXES if sizes[a] > 1) or "data=1"


def meshes(devices: int) -> list[dict[str, int]]:
    """Every way to split ``devices`` over AXES: a size for each, multiplying to it."""
    found = [{}]
    for axis in AXES[:-1]:
        found = [
            {**sizes, axis: n}
            for sizes in found
            for left in [devices // math.prod(sizes.values())]
            for n in range(1, left + 1)
            if left % n == 0
        ]
    return [{**m, AXES[-1]: devices // math.prod(m.values())} for m in found]


class Dimension(NamedTuple):
    """An array dimension that a rule may split."""

    # how a message names it
    what: str
    size: int
    # its logical axis name
    name: str
    # what each device's share is cut into on top: the zigzag's 2, the virtual stages
    chunks: int = 1


# what the chunks are, by logical axis
CHUNKS = {"layers": "virtual stages", "act_seq": "zigzag chunks"}


def dimensions(
    config, sizes: dict[str, int], run: RunConfig, lookup: str = "rows"
) -> list[Dimension]:
    """Every named dimension of the model's weights and activations, sized for this
    model and run (``lookup``: the model's; "rows" adds "lookup_batch").
    tests/test_lm_mesh_sweep.py holds this list to the arrays the model makes."""
    c, micro, T = config, run.grad_accum, run.seq_len
    virtual = run.virtual_stages if run.schedule == "interleaved" else 1
    found = [
        Dimension(f"width {c.width}", c.width, "embed"),
        Dimension(f"num_layers {c.num_layers}", c.num_layers, "layers", virtual),
        Dimension(f"head_width {c.head_width}", c.head_width, "head_dim"),
    ]
    for field, names in (
        ("num_heads", ("heads", "act_heads")),
        ("num_kv_heads", ("kv_heads", "act_kv_heads")),
        ("mlp_width", ("mlp", "act_mlp")),
        ("vocab_size", ("vocab", "act_vocab")),
    ):
        size = getattr(c, field)
        found += [Dimension(f"{field} {size}", size, name) for name in names]
    if c.num_experts:
        found += [
            Dimension(f"--experts {c.num_experts}", c.num_experts, name)
            for name in ("experts", "act_experts")
        ]
    if c.shared_experts:
        width = c.shared_experts * c.mlp_width
        found += [
            Dimension(f"the shared experts' mlp_width {width}", width, name)
            for name in ("mlp", "act_mlp")
        ]
    # a micro-batch's rows (a pipeline's too)
    rows = run.global_batch // micro
    batch = f"--global-batch {run.global_batch}"
    if micro > 1:
        batch += f" in --grad-accum {micro} micro-batches of {rows} rows"
    # ring attention's chunks a device
    zigzag = 2 if sizes["sequence"] > 1 else 1
    found += [
        Dimension(batch, rows, "batch"),
        Dimension(f"--seq-len {T}", T, "act_seq", zigzag),
        Dimension(f"--seq-len {T}", T, "act_seq_residual"),
    ]
    # A pipeline looks the whole batch up at once.
    if lookup == "rows" and sizes["pipeline"] > 1:
        found.append(
            Dimension(
                f"--global-batch {run.global_batch}", run.global_batch, "lookup_batch"
            )
        )
    elif lookup == "rows":
        found.append(Dimension(batch, rows, "lookup_batch"))
    if c.num_experts:
        group = min(c.group_size, T)
        found += [
            Dimension(batch, rows, "expert_batch"),
            Dimension(
                f"routing groups: {T // group} of {group} tokens (--seq-len {T}, "
                f"--group-size {c.group_size})",
                T // group,
                "act_seq",
            ),
        ]
    return found


def flag_problems(config, sizes: dict[str, int], run: RunConfig) -> list[str]:
    """What the run's flags leave undone on a mesh of these ``sizes``, before any
    dimension is split: each a line that says which flag to change."""
    stages, micro, T = sizes["pipeline"], run.grad_accum, run.seq_len
    interleaved = run.schedule == "interleaved"
    out = []
    if micro < 1:
        out.append(f"--grad-accum {micro} must be 1 or more")
    if run.virtual_stages != 1 and (stages == 1 or not interleaved):
        out.append(
            f"--virtual-stages {run.virtual_stages} needs a pipeline axis and "
            "--schedule interleaved"
        )
    elif run.virtual_stages < 1:
        out.append(f"--virtual-stages {run.virtual_stages} must be 1 or more")
    if out:
        return out
    if run.global_batch % micro:
        out.append(
            f"--global-batch {run.global_batch} does not split into --grad-accum "
            f"{micro} micro-batches"
        )
    group = min(config.group_size, T)
    if config.num_experts and T % group:
        out.append(f"--seq-len {T} does not make groups of {group} tokens")
    if stages > 1 and micro < stages:
        out.append(
            f"pipeline={stages} needs at least {stages} micro-batches: set "
            f"--grad-accum to {stages} or more (more micro-batches, a smaller bubble)"
        )
    if stages > 1 and interleaved and micro % stages:
        out.append(
            f"--schedule interleaved runs micro-batches in groups of pipeline="
            f"{stages}: set --grad-accum to a multiple of {stages}"
        )
    if "activations" in run.offload and (run.remat != "full" or stages > 1):
        out.append(
            "--offload activations moves the one input a layer keeps under full remat "
            "to host memory: it needs --remat full and no pipeline axis (a "
            "pipeline keeps its stage inputs itself)"
        )
    return out


def uneven(
    config, sizes: dict[str, int], run: RunConfig, lookup: str = "rows"
) -> list[str]:
    """A line for each dimension that its rule's mesh axes do not split evenly. JAX
    refuses such a weight and pads such an activation; the recipe refuses both."""
    rules, out = dict(RULES), []
    for d in dimensions(config, sizes, run, lookup):
        axes = rules[d.name]
        axes = (axes,) if isinstance(axes, str) else axes or ()
        ways = math.prod(sizes[a] for a in axes) * d.chunks
        if d.size % ways == 0:
            continue
        parts = [f"{a}={sizes[a]}" for a in axes if sizes[a] > 1]
        parts += [f"{d.chunks} {CHUNKS[d.name]}"] if d.chunks > 1 else []
        over = " x ".join(parts) + (f" = {ways}" if len(parts) > 1 else "")
        if (line := f"{d.what} does not split over {over}") not in out:
            out.append(line)
    return out


def refusals(
    config, sizes: dict[str, int], run: RunConfig, lookup: str = "rows"
) -> list[str]:
    """Why train.py refuses this run on a mesh of these ``sizes``, a line each."""
    # The planner, which does not choose the lookup, leaves "rows", the strictest.
    return flag_problems(config, sizes, run) or uneven(config, sizes, run, lookup)


def lookup(config, sizes: dict[str, int], tokens: int) -> str:
    """The model's ``lookup`` (model.Transformer.lookup) on a mesh of these ``sizes``,
    with ``tokens`` a step."""
    data, expert, fsdp = sizes["data"], sizes["expert"], sizes["fsdp"]
    # the stages, too, each look up the whole batch
    data *= sizes["pipeline"]
    # No batch replicas, or nothing but replicas: XLA's partitioner needs no help.
    if data * expert == 1 or fsdp * sizes["sequence"] * sizes["tensor"] == 1:
        return "xla"
    # "rows" unless gathering the table moves fewer bytes: with 'data', when each
    # device has at least as many tokens as the table has rows; with 'expert', when an
    # fsdp group's share of a step's tokens does (read from compiled programs of 1B to
    # 8B models). A vocabulary split over 'tensor': "rows" always.
    if data > 1:
        table = tokens / (data * fsdp * expert) >= config.vocab_size
    else:
        table = tokens / fsdp >= config.vocab_size
    return "table" if table and sizes["tensor"] == 1 else "rows"


def recipe_refusals(config, sizes: dict[str, int], run: RunConfig) -> list[str]:
    """``refusals`` with the lookup train.py chooses for these sizes."""
    how = lookup(config, sizes, run.global_batch * run.seq_len)
    return refusals(config, sizes, run, how)


def try_instead(config, sizes: dict[str, int], run: RunConfig) -> str:
    """The end of a refusal's line, "; try --mesh A or --mesh B": the two meshes of as
    many devices nearest ``sizes`` that split everything, or, if none does, those with
    the next --global-batch that has one."""
    devices = math.prod(sizes.values())
    cost = dict(data=0, fsdp=1, tensor=2, expert=2, sequence=3, pipeline=4)
    # A dense model's 'expert' is one more data axis: 'data' says it plainer.
    plain = config.num_experts or sizes["expert"] > 1
    # Nearest: the fewest factors moved between axes, then the cheapest axes changed.
    ranked = sorted(
        (m for m in meshes(devices) if plain or m["expert"] == 1),
        key=lambda m: (
            round(sum(abs(math.log(m[a] / sizes[a])) for a in AXES), 9),
            sum(cost[a] for a in AXES if m[a] != sizes[a]),
        ),
    )
    for batch in range(run.global_batch, 2 * run.global_batch):
        tried = dataclasses.replace(run, global_batch=batch)
        near = ranked if batch == run.global_batch else ranked[:50]
        fits = [m for m in near if not recipe_refusals(config, m, tried)][:2]
        if fits:
            flags = " or ".join(f"--mesh {mesh_flag(m)}" for m in fits)
            more = "" if batch == run.global_batch else f" with --global-batch {batch}"
            return f"; try {flags}{more}"
    return f"; no mesh of {devices} devices splits it"


def slices_refusal(sizes: dict[str, int], slices: int) -> str | None:
    """Why ``sizes`` cannot lie over ``slices`` TPU slices, or None: only `data` crosses
    them (layout.slices_grid), so it must be a multiple of the slices."""
    if sizes["data"] % slices:
        return (
            f"data={sizes['data']} does not split over the {slices} slices: "
            f"only the data axis crosses slices, so make it a multiple of {slices}"
        )
    return None


def stop_line(config, sizes: dict[str, int], run: RunConfig) -> str | None:
    """The one line train.py stops with on a mesh of these ``sizes``; None: it runs."""
    if said := flag_problems(config, sizes, run):
        return said[0]
    if said := recipe_refusals(config, sizes, run):
        return said[0] + try_instead(config, sizes, run)
    return None
