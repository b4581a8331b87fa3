"""examples/lm/run_config.py: train.py's command line read once into a frozen config,
which the planner builds too (through its link to the same file)."""

import dataclasses
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))
import mesh_spec  # noqa: E402
import model_config  # noqa: E402
import train  # noqa: E402
from run_config import RunConfig  # noqa: E402


def test_the_flags_are_the_configs_fields_with_its_defaults():
    """One flag a field, named alike; with no flags, train.py runs RunConfig()."""
    parsed = vars(train.flags().parse_args([]))
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
    """planning/run_config.py links to examples/lm/run_config.py; the check both run
    (mesh_spec) reads the config: the line train.py stops with on tiny's tensor=8."""
    path = ROOT / "jaxdist_lessons" / "planning" / "run_config.py"
    assert path.is_symlink()
    assert path.resolve() == (ROOT / "examples" / "lm" / "run_config.py").resolve()
    sizes = mesh_spec.parse("tensor=8")
    run = RunConfig(seq_len=64, global_batch=16)
    assert mesh_spec.stop_line(model_config.PRESETS["tiny"], sizes, run) == (
        "num_heads 4 does not split over tensor=8; try --mesh data=4,tensor=2 or "
        "--mesh fsdp=4,tensor=2"
    )
