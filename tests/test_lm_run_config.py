"""jaxdist_lm/run_config.py: train.py's command line (command_line.py) read once into a
frozen config, which the planner builds too (importing the same module)."""

import dataclasses
import pathlib

import pytest

from jaxdist_lm import (
    command_line,
    mesh_spec,
    model_config,
    train,
)
from jaxdist_lm.run_config import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_flags_are_the_configs_fields_with_its_defaults():
    """One flag a field, named alike; with no flags, train.py runs RunConfig()."""
    parsed = vars(command_line.flags().parse_args([]))
    assert set(parsed) == {f.name for f in dataclasses.fields(RunConfig)}
    assert train.parse_args([]) == RunConfig()
    run = train.parse_args(["--global-batch", "32", "--offload", "optimizer"])
    assert (run.global_batch, run.offload) == (32, frozenset({"optimizer"}))


def test_the_config_is_frozen_and_a_variant_is_a_copy():
    run = RunConfig(global_batch=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.global_batch = 32
    assert dataclasses.replace(run, global_batch=32).global_batch == 32
    assert run.global_batch == 16


def test_the_planners_run_config_is_the_recipes_file():
    """The planner imports jaxdist_lm/run_config.py and mesh_spec.py themselves (no copy
    of its own); the check both run (mesh_spec) reads the config: the line train.py stops
    with on tiny's tensor=8."""
    from jaxdist_lessons.planning import layouts

    assert layouts.RunConfig is RunConfig and layouts.mesh_spec is mesh_spec
    assert train.RunConfig is RunConfig
    assert (
        pathlib.Path(mesh_spec.__file__).resolve() == ROOT / "jaxdist_lm/mesh_spec.py"
    )
    for copy in ("run_config.py", "mesh_spec.py"):
        assert not (ROOT / "jaxdist_lessons" / "planning" / copy).exists()
    sizes = mesh_spec.parse("tensor=8")
    run = RunConfig(seq_len=64, global_batch=16)
    assert mesh_spec.stop_line(model_config.PRESETS["tiny"], sizes, run) == (
        "num_heads 4 does not split over tensor=8; try --mesh data=4,tensor=2 or "
        "--mesh fsdp=4,tensor=2"
    )
