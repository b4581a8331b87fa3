"""The request and the layouts: ``Run`` (a model, a batch, the machines, the recipe's flags that
change a step: remat, micro-batches), ``Layout`` (devices per mesh axis of the recipe's
``layout.AXES``, pipeline stages and what runs on top), every layout the devices allow, and why the
recipe cannot split a model a given way (``problems``: the recipe's own check, which
``mesh_spec.py`` holds).
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist_lessons import hardware
from jaxdist_lessons.strategies import NAMES
from jaxdist_lm import mesh_spec
from jaxdist_lm.model_config import ModelConfig
from jaxdist_lm.run_config import RunConfig

# The recipe's axes (jaxdist_lm/mesh_spec.py), pipeline stages apart
AXES = tuple(axis for axis in mesh_spec.AXES if axis != "pipeline")


@dataclasses.dataclass(frozen=True, kw_only=True)  # Layout(fsdp=4, tensor=2): by name
class Layout:
    """How a job lays out its devices: how many along each of the recipe's mesh axes
    (``AXES``, ``layout.AXES``), in ``stages`` pipeline stages (outermost, each a copy of
    that mesh) of ``virtual`` stages each, and what the recipe does on top: a pipeline's
    schedule, host offload, the experts' dispatch. ``strategy`` names it in tables. The
    planner and chapter 11_pipelines_mesh_shape's cost model (``costmodel``) both describe layouts with it."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1
    stages: int = 1
    virtual: int = 1
    schedule: str = ""  # GPipe, 1F1B, interleaved
    offload: bool = False  # Adam's moments and the layers' inputs in host memory
    dispatch: str = "capacity"  # the experts': or "dropless"
    strategy: str = ""

    def __post_init__(self):
        for name in (*AXES, "stages", "virtual"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(
                    f"Layout.{name} must be a positive integer, got {size!r}"
                )

    @classmethod
    def from_flag(cls, flag: str, **options) -> Layout:
        """``Layout.from_flag("fsdp=4,tensor=2", strategy=NAMES["fsdp+tensor"])``: a recipe's --mesh."""
        return cls(**mesh_sizes(flag), **options)

    def size(self, axis: str) -> int:
        """Devices along one of ``AXES``."""
        return getattr(self, axis)

    @property
    def mesh(self) -> tuple[int, ...]:
        """Devices along each of ``AXES``, in order."""
        return tuple(self.size(a) for a in AXES)

    @property
    def devices(self) -> int:
        """Devices the layout uses."""
        return math.prod(self.mesh) * self.stages

    @property
    def batch_ways(self) -> int:
        """Mesh axes that split the batch rows: data, fsdp, expert (mesh_spec.BATCH)."""
        return self.size("data") * self.size("fsdp") * self.size("expert")

    @property
    def sizes(self) -> dict[str, int]:
        """Devices along each of the recipe's axes, pipeline stages first (mesh_spec)."""
        return {"pipeline": self.stages, **{a: self.size(a) for a in AXES}}

    @property
    def mesh_flag(self) -> str:
        """The recipe's --mesh: ``pipeline=2,fsdp=4`` (``mesh_spec.mesh_flag``)."""
        return mesh_spec.mesh_flag(self.sizes)

    @property
    def label(self) -> str:
        """Chapter 11_pipelines_mesh_shape's notation: ``(4,2)`` for (data, tensor), or ``FSDP 8`` (``FSDP 8 x
        tensor 2``, ``FSDP 4 x data 2``)."""
        if self.fsdp == 1:
            return f"({self.data},{self.tensor})"
        rest = f" x tensor {self.tensor}" if self.tensor > 1 else ""
        data = f" x data {self.data}" if self.data > 1 else ""
        return f"FSDP {self.fsdp}{data}{rest}"


@dataclasses.dataclass(frozen=True)
class Run:
    """What the reader asks for: a model, a batch and the machines."""

    model: str
    shape: ModelConfig
    devices: int
    nodes: int
    chip: hardware.Chip
    seq_len: int
    global_batch: int
    dtype: str = "bfloat16"
    remat: str = "full"  # train.py's --remat: none, dots or full
    grad_accum: int = 1  # train.py's --grad-accum: micro-batches a step
    fit_accum: bool = False  # --grad-accum auto: each layout's fewest that fit (plan)
    # the collectives priced: "gpu" (predicted) or "xla-cpu" (compiled)
    bytes: str = "gpu"
    efficiency: float | None = None  # of the chip's peak; None: the chip's fitted one

    @property
    def per_node(self) -> int:
        return self.devices // self.nodes

    @property
    def itemsize(self) -> int:
        """Bytes of one value in the compute type (activations, gathered weights)."""
        return 2 if self.dtype == "bfloat16" else 4


def checked(run: Run, c: Layout) -> bool:
    """Whether ``--check`` compares this row with the compiled recipe: the XLA:CPU counts
    were read under full remat, one micro-batch a step. Not yet for pipelines (their
    predicted bytes and memory are not the compiled program's), nor ZeRO-1 (XLA:CPU
    all-reduces the gradient where the prediction has a reduce-scatter), nor offloading
    (XLA:CPU's program keeps everything in device memory), nor a tensor axis beside data
    or sequence (the counts were read with FSDP beside it; compiled, such programs
    all-reduce 1.1 to 1.5 times the predicted bytes)."""
    plain = run.remat == "full" and run.grad_accum == 1
    read = c.tensor == 1 or c.data == c.sequence == 1
    return (
        plain
        and read
        and c.stages == 1
        and not c.strategy.startswith("ZeRO")
        and not c.offload
    )


def micro_rows(run: Run, c: Layout) -> int:
    """Sequences one device runs at once: its rows over --grad-accum, or one in a
    pipeline (a micro-batch of one sequence a device)."""
    rows = run.global_batch // c.batch_ways
    return 1 if c.stages > 1 else rows // run.grad_accum


def mesh_sizes(flag: str) -> dict[str, int]:
    """``'fsdp=4,tensor=2'`` -> devices per axis of ``AXES``, read as the recipe reads
    its --mesh (``mesh_spec.parse``); the planner's layouts give pipeline stages apart."""
    try:
        sizes = mesh_spec.parse(flag)
    except ValueError:
        sizes = {"pipeline": 0}
    if sizes.pop("pipeline") != 1:
        raise PlanError(
            f"mesh {flag!r}: expected axis=size with axes {', '.join(AXES)}"
        )
    return sizes


def candidates(run: Run) -> list[Layout]:
    """Every layout family at the sizes the devices allow; ``problems`` filters what cannot
    run. Besides one strategy alone: tensor parallelism inside a node with FSDP, data
    parallelism or both (HSDP) across; context parallelism with it; and pipelines of every
    depth ``pipeline_depths`` allows, FSDP or data parallelism inside the stages. On
    several TPU slices, only those whose ``data`` axis crosses them (``multislice_refusals``)."""
    n, p, m = run.devices, run.per_node, run.shape
    out = [
        Layout(data=n, strategy=z)
        for z in (NAMES["data"], NAMES["zero1"], NAMES["zero2"])
    ]
    out.append(Layout(fsdp=n, strategy=NAMES["fsdp"]))
    # HSDP: FSDP inside groups of k devices (powers of two, a node's among them), replicas
    # across them
    inner = {2**i for i in range(1, n.bit_length()) if n % 2**i == 0 and 2**i < n}
    inner |= {p} if 1 < p < n else set()
    out += [Layout(data=n // k, fsdp=k, strategy=NAMES["hsdp"]) for k in sorted(inner)]
    # Inside a node, not all devices, powers of two: on an odd ring XLA:CPU moves the embedding
    # table instead of the activations, which the counts below do not follow.
    inside = [k for k in (2, 4, 8) if p % k == 0 and k < n]
    tensors = tensor_sizes(run)
    out += [
        Layout(fsdp=n // t, tensor=t, strategy=NAMES["fsdp+tensor"]) for t in tensors
    ]
    out += [Layout(fsdp=n // s, sequence=s, strategy=NAMES["sequence"]) for s in inside]
    if m.num_experts:
        for dispatch, name in (
            ("capacity", "experts"),
            ("dropless", "experts dropless"),
        ):
            out += [
                Layout(fsdp=n // e, expert=e, dispatch=dispatch, strategy=name)
                for e in inside
            ]
    if run.chip.host_bytes_per_s and n > 1:
        out.append(Layout(fsdp=n, offload=True, strategy=f"{NAMES['fsdp']} + offload"))
    # Megatron's data x tensor; HSDP's replicas across nodes, FSDP and tensor inside each
    out += [Layout(data=n // t, tensor=t, strategy=NAMES["hybrid"]) for t in tensors]
    if run.nodes > 1:
        out += [
            Layout(data=run.nodes, fsdp=p // t, tensor=t, strategy=NAMES["hsdp+tensor"])
            for t in tensors
            if p > t
        ]
    # context parallelism beside tensor parallelism, both inside a node, FSDP across
    out += [
        Layout(
            fsdp=n // (s * t),
            sequence=s,
            tensor=t,
            strategy=f"{NAMES['sequence']} + {NAMES['tensor']}",
        )
        for s in inside
        for t in tensors
        if p % (s * t) == 0
    ]
    home = run.nodes if run.nodes > 1 else 2
    for stages in pipeline_depths(run):
        out += pipelines(run, stages, tensors, every_schedule=stages == home)
    return [c for c in out if not multislice_refusals(run, c)]


def tensor_sizes(run: Run) -> list[int]:
    """Tensor-parallel sizes: powers of two that divide a node, not all the devices, up
    to 16 (a TPU slice's torus holds 16 neighbours, MaxText's TP 16; a GPU node has 8)."""
    return [t for t in (2, 4, 8, 16) if run.per_node % t == 0 and t < run.devices]


def pipeline_depths(run: Run) -> list[int]:
    """Pipeline stages the planner tries: the node count (2 in one node), as chapter 11
    cuts a pipeline, first; then every other divisor of the devices that divides the
    layers (a stage holds whole layers), as Megatron picks its depth for the model."""
    n, layers = run.devices, run.shape.num_layers
    home = run.nodes if run.nodes > 1 else 2
    depths = [home] if n % home == 0 and n > 1 else []
    return depths + [
        d
        for d in range(2, min(n, layers) + 1)
        if n % d == 0 and layers % d == 0 and d != home
    ]


def pipelines(
    run: Run, stages: int, tensors: list[int], every_schedule: bool
) -> list[Layout]:
    """Pipelines of ``stages`` stages: FSDP inside each stage (1F1B, and with
    ``every_schedule`` GPipe and interleaved too), and 1F1B with tensor parallelism inside
    a node and FSDP or data parallelism beside it in the stage."""
    stage = run.devices // stages
    schedules = [("GPipe", 1), ("1F1B", 1), ("interleaved", 2)]
    out = [
        Layout(
            fsdp=stage,
            stages=stages,
            virtual=virtual,
            schedule=schedule,
            strategy=f"pipeline {schedule}",
        )
        for schedule, virtual in (schedules if every_schedule else schedules[1:2])
    ]
    inner = [t for t in tensors if stage % t == 0]
    # tensor parallelism inside each stage, FSDP beside it; then data beside it
    beside = (("fsdp", NAMES["tensor"]), ("data", NAMES["hybrid"]))
    out += [
        Layout(
            **{axis: stage // t},
            tensor=t,
            stages=stages,
            schedule="1F1B",
            strategy=f"pipeline 1F1B + {name}",
        )
        for axis, name in beside
        for t in inner
        if axis == "fsdp" or stage > t
    ]
    return out


NEEDS = {
    NAMES[
        "zero2"
    ]: "needs: ZeRO-2 in the recipe (it has --zero1, and FSDP, which shards "
    "the gradients too)"
}


def runnable(c: Layout) -> bool:
    """Whether ``jaxdist_lm/train.py`` runs this layout (``NEEDS`` says what the others
    need)."""
    return c.strategy not in NEEDS


def recipe_run_config(run: Run, c: Layout) -> RunConfig:
    """train.py's run config for the flags that ``ranking.recipe_flags`` writes for this
    layout: a pipeline runs one sequence a device a micro-batch."""
    pipelined = c.stages > 1
    return RunConfig(
        seq_len=run.seq_len,
        global_batch=run.global_batch,
        grad_accum=max(1, run.global_batch // c.batch_ways)
        if pipelined
        else run.grad_accum,
        schedule=c.schedule.lower() or "1f1b",
        virtual_stages=c.virtual,
        offload=frozenset({"optimizer", "activations"} if c.offload else ()),
        remat=run.remat,
    )


def problems(run: Run, c: Layout) -> list[str]:
    """Why the recipe cannot run this layout: the recipe's own check
    (``mesh_spec.refusals``, which ``layout.check_fits`` runs), on its flags."""
    return mesh_spec.refusals(run.shape, c.sizes, recipe_run_config(run, c))


def multislice_refusals(run: Run, c: Layout) -> list[str]:
    """Why the recipe's mesh cannot lay this layout over several TPU slices, by the
    recipe's own check (``mesh_spec.slices_refusal``): only ``data`` crosses them, as
    MaxText's base.yml recommends and the scaling book's training chapter does ("we do
    pure data parallelism over the DCN axis and FSDP within a pod"), so it must be a
    multiple of the slices; a pipeline's stages are inside a slice too. ``candidates``
    leaves such layouts out."""
    if not run.chip.name.startswith("TPU") or run.nodes == 1:
        return []
    said = mesh_spec.slices_refusal(c.sizes, run.nodes)
    return [said] if said else []


class PlanError(ValueError):
    """Input the planner cannot plan for; the command line prints it on one line, status 2."""
