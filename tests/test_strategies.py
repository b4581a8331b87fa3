"""jaxdist_lessons.strategies: one vocabulary, which every module's strategies come from."""

import pytest

from jaxdist_lessons import memory, partitioning, strategies, zero
from jaxdist_lessons.planning import cli, layouts


def test_every_modules_strategies_are_the_books():
    for chosen in (memory.STRATEGIES, zero.ZERO_STAGES, zero.LAYERED_STRATEGIES):
        assert set(chosen) <= set(strategies.STRATEGIES), chosen
    assert set(partitioning.RULES) <= set(strategies.STRATEGIES)


def test_the_planners_rows_are_named_from_it():
    names = set(strategies.NAMES.values())
    for devices, nodes in ((1, 1), (6, 1), (8, 1), (16, 2)):
        flags = f"--model 8b --devices {devices} --nodes {nodes} --global-batch 16"
        run = cli.make_run(cli.parse_args(flags.split()))
        for c in layouts.candidates(run):
            label = c.strategy.removeprefix("pipeline ").split(" + ")[0]
            assert label in names or label in ("GPipe", "1F1B", "interleaved"), label


def test_an_unknown_strategy_is_refused_with_the_known_ones():
    assert strategies.among("data", "fsdp") == ("data", "fsdp")
    with pytest.raises(ValueError, match=r"not strategies of the book: \['zero3'\]"):
        strategies.among("data", "zero3")
