"""planning.shapes: the planner's model is the recipe's own file, and the weights it splits
add up to the recipe's parameter count."""

import dataclasses
import math
import pathlib

from planning_helpers import ROOT

from jaxdist_lessons.planning import cli, layouts, shapes
from jaxdist_lm import model_config


def test_the_planners_model_config_is_the_recipes_file():
    """The planner imports jaxdist_lm/model_config.py itself, and keeps no copy: one
    module, so the presets, parameter counts and flops per token cannot drift apart."""
    path = ROOT / "jaxdist_lm" / "model_config.py"
    assert pathlib.Path(model_config.__file__).resolve() == path
    assert shapes.ModelConfig is model_config.ModelConfig
    assert layouts.ModelConfig is model_config.ModelConfig
    assert cli.PRESETS is model_config.PRESETS
    assert not (ROOT / "jaxdist_lessons" / "planning" / "model_config.py").exists()


def test_the_weights_it_splits_are_every_parameter():
    for name, shape in model_config.PRESETS.items():
        for experts in ({}, {"num_experts": 8, "top_k": 2}):
            ours = dataclasses.replace(shape, **experts)
            weights = sum(math.prod(dims) for dims, _ in shapes.weight_shapes(ours))
            assert weights == model_config.count_params(ours), (name, experts)
            # 6 flops per weight a token multiplies, and attention's 12 L T N A
            lookup = 0 if ours.tie_embeddings else ours.vocab_size * ours.width
            used = model_config.count_params(ours) - lookup
            used -= ours.width * (2 * ours.num_layers + 1)  # the norms: no matmul
            unused = ours.num_experts - ours.top_k if ours.num_experts else 0
            used -= ours.num_layers * unused * 3 * ours.width * ours.mlp_width
            attention = 12 * ours.num_layers * 4096 * ours.width
            assert model_config.flops_per_token(ours, 4096) == 6 * used + attention
