"""book/data/published_runs.json: every published run has its fields, a source, its source's
words with the measured figure in them as written, a layout whose axes multiply to its device
count, and a split made by the file's own rule (jaxdist_lessons/planning/published.py)."""

from __future__ import annotations

import collections
import json
import re

import pytest

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import published

RUNS = published.load_runs()
META = json.loads(published.PATH.read_text())["meta"]
DTYPES = {"bf16", "fp8", "16-bit", None}


def number(as_written: str) -> float:
    """The value of a figure as its source wrote it: "5,762", "45.2%", "63.1 GB"."""
    return float(re.sub(r"[,%]|\s*GB$", "", as_written))


def test_the_file_loads_into_runs_with_unique_names():
    assert len(RUNS) >= 35
    names = [run.name for run in RUNS]
    assert len(set(names)) == len(names), collections.Counter(names).most_common(3)


def test_a_row_with_a_field_too_many_is_refused():
    row = json.loads(published.PATH.read_text())["runs"][0]
    row["layout"] = {**row["layout"], "sp": 2}
    with pytest.raises(ValueError, match=r"layout: missing \[\], unexpected \['sp'\]"):
        published.run_from_row(row)


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_each_run_cites_its_source_and_quotes_the_number(run):
    assert re.fullmatch(r"https://\S+", run.source), run.source
    assert run.source_page is None or run.source_page.startswith("https://")
    assert run.model.shape_source is None or run.model.shape_source.startswith(
        "https://"
    )
    for quantity in (run.measured, *run.also_published):
        # The figure as written, not a longer number that contains it ("44" in "144").
        pattern = rf"(?<![\d.,]){re.escape(quantity.as_written)}(?![\d])"
        assert re.search(pattern, run.words), quantity
        assert number(quantity.as_written) == pytest.approx(quantity.value), quantity
    assert run.measured.unit in META["units"]
    assert run.dtype in DTYPES
    assert run.split in published.SPLITS
    assert run.devices > 0 and run.seq_len > 0


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_the_layout_multiplies_to_the_devices(run):
    product = run.layout.devices()
    if run.published_inconsistency:
        # Kept as printed: the flag is only for a source whose own numbers disagree.
        assert product is not None and product != run.devices
    elif product is not None:
        assert product == run.devices, run.layout
    lay = run.layout
    if None not in (lay.microbatch, lay.grad_accum, lay.global_batch, lay.dp, lay.fsdp):
        assert lay.microbatch * lay.grad_accum * lay.dp * lay.fsdp == lay.global_batch


def test_chips_are_the_planners_or_listed_as_not():
    outside = set(META["chips_not_in_planner"])
    assert not outside & set(hardware.CHIPS)
    assert {run.chip for run in RUNS} <= set(hardware.CHIPS) | outside


def test_the_split_is_the_rule_and_holds_out_a_quarter_or_more():
    assert {run.name: run.split for run in RUNS} == published.split_by_rule(RUNS)
    held_out = [run for run in RUNS if run.split == "held_out"]
    assert len(held_out) >= len(RUNS) / 4
    by_chip = collections.Counter(run.chip for run in RUNS)
    # Every chip with two runs or more has one held out.
    assert {c for c, n in by_chip.items() if n > 1} <= {run.chip for run in held_out}


def test_megatron_shapes_give_the_papers_parameter_counts():
    """The paper's Eq. 2, P = 12lh^2 (1 + 13/(12h) + (V + s)/(12lh)), on the shapes in the
    file gives the billions its tables print."""
    megatron = [run for run in RUNS if run.group.startswith("megatron")]
    assert len(megatron) == 12
    for run in megatron:
        layers, h = run.model.layers, run.model.width
        V, s = run.model.vocab, run.seq_len
        P = 12 * layers * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * layers * h))
        printed = number(run.model.parameters.rstrip("B"))
        assert printed == pytest.approx(P / 1e9, abs=0.06), run.name


def test_the_runs_per_source():
    """Golden counts: update them (and the report in the lead's notes) when rows are added."""
    counts = collections.Counter(run.group for run in RUNS)
    assert counts == {
        "playbook": 7,
        "megatron-table1": 6,
        "megatron-table2": 6,
        "llama3": 3,
        "torchtitan": 7,
        "llm-foundry": 7,
        "maxtext": 14,
        "jax-toolbox": 1,
    }
    assert set(counts) == set(META["sources"])
    zero3 = [r for r in RUNS if r.group == "megatron-table2" and r.layout.zero == 3]
    assert [(r.devices, r.measured.value) for r in zero3] == [
        (384, 144),
        (768, 88),
        (1536, 44),
    ]
