"""Published training runs, as their sources printed them: the set the planner is fitted to
and checked against.

``book/data/published_runs.json`` holds one row per measured run (the Ultra-Scale Playbook,
Megatron-LM's Tables 1 and 2, Llama 3 405B, torchtitan, llm-foundry, MaxText on TPU v5e and
v5p, JAX-Toolbox), each with its source's URL and its own words quoted. ``load_runs`` reads it
into frozen dataclasses and refuses a row whose fields differ from these, so the file and the
code cannot drift apart. Each row's ``split`` is "fit" or "held_out" by the rule in the file's
``meta`` (``split_by_rule``), chosen before any fitting. Standard library only, like the rest
of ``planning``.

    from jaxdist_lessons.planning import published
    runs = published.load_runs()
    held_out = [r for r in runs if r.split == "held_out"]
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

PATH = (
    pathlib.Path(__file__).resolve().parents[2]
    / "book"
    / "data"
    / "published_runs.json"
)
SPLITS = ("fit", "held_out")
# The parallel axes whose sizes multiply to the device count.
DEGREES = ("dp", "fsdp", "tp", "pp", "cp", "ep")


@dataclasses.dataclass(frozen=True)
class Quantity:
    """A figure as published: its value, its unit and the characters its source wrote."""

    value: float
    unit: str
    as_written: str


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """The model's shape where the source (or the config it names) gives it; ``None`` where not."""

    name: str
    parameters: str | None
    layers: int | None
    width: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    ffn: int | None
    vocab: int | None
    mlp: str | None
    tied_embeddings: bool | None
    shape_source: str | None
    shape_note: str | None


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The published layout: axis sizes, the ZeRO stage, and batch sizes in sequences."""

    dp: int | None
    fsdp: int | None
    tp: int | None
    pp: int | None
    cp: int | None
    ep: int | None
    zero: int | None
    model_parallel: int | None
    microbatch: int | None
    grad_accum: int | None
    global_batch: int | None
    note: str | None

    def devices(self) -> int | None:
        """The product of the parallel axes' sizes; ``None`` when one of them is not given."""
        sizes = [getattr(self, axis) for axis in DEGREES]
        return None if None in sizes else math.prod(sizes)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published, measured training run and what its source says about it."""

    name: str
    group: str
    source: str
    source_page: str | None
    words: str
    chip: str
    devices: int
    nodes: int | None
    slices: int | None
    model: ModelFacts
    seq_len: int
    layout: Parallelism
    dtype: str | None
    remat: str | None
    measured: Quantity
    also_published: tuple[Quantity, ...]
    derived: tuple[str, ...]
    published_inconsistency: str | None
    notes: str | None
    split: str


def _build(cls: type, row: dict[str, Any], where: str) -> Any:
    """``cls(**row)`` after checking that the keys are exactly ``cls``'s fields."""
    names = {field.name for field in dataclasses.fields(cls)}
    if set(row) != names:
        missing, extra = sorted(names - set(row)), sorted(set(row) - names)
        raise ValueError(f"{where}: missing {missing}, unexpected {extra}")
    return cls(**row)


def run_from_row(row: dict[str, Any]) -> PublishedRun:
    """A ``PublishedRun`` from one row of the JSON file."""
    where = str(row.get("name", "a row"))
    fields = dict(row)
    fields["model"] = _build(ModelFacts, row["model"], f"{where}: model")
    fields["layout"] = _build(Parallelism, row["layout"], f"{where}: layout")
    fields["measured"] = _build(Quantity, row["measured"], f"{where}: measured")
    fields["also_published"] = tuple(
        _build(Quantity, q, f"{where}: also_published") for q in row["also_published"]
    )
    fields["derived"] = tuple(row["derived"])
    return _build(PublishedRun, fields, where)


def load_runs(path: pathlib.Path | str = PATH) -> list[PublishedRun]:
    """Every run in the published-runs file, in its order."""
    data = json.loads(pathlib.Path(path).read_text())
    return [run_from_row(row) for row in data["runs"]]


def split_by_rule(runs: list[PublishedRun]) -> dict[str, str]:
    """Each run's split by the file's rule: within each (group, chip), sorted by (devices,
    name), every third run from the second is held out."""
    groups: dict[tuple[str, str], list[PublishedRun]] = {}
    for run in runs:
        groups.setdefault((run.group, run.chip), []).append(run)
    split = {}
    for members in groups.values():
        members.sort(key=lambda run: (run.devices, run.name))
        for position, run in enumerate(members):
            split[run.name] = "held_out" if position % 3 == 1 else "fit"
    return split
