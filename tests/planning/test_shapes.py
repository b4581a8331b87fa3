"""planning.shapes: the presets, parameters and flops are the recipe's."""

import dataclasses
import math

from planning_helpers import (
    model_lib,
)

from jaxdist_lessons.planning import (
    shapes,
)


def test_presets_params_and_flops_are_the_recipes():
    assert shapes.PRESETS.keys() == model_lib.PRESETS.keys()
    for name, shape in shapes.PRESETS.items():
        recipe = model_lib.PRESETS[name]
        for field in dataclasses.fields(shape):
            assert getattr(shape, field.name) == getattr(recipe, field.name), (
                name,
                field,
            )
        for experts in ({}, {"num_experts": 8, "top_k": 2}):
            ours = dataclasses.replace(shape, **experts)
            theirs = dataclasses.replace(recipe, **experts)
            assert shapes.param_count(ours) == model_lib.count_params(theirs)
            assert shapes.model_flops_per_token(
                ours, 4096
            ) == model_lib.flops_per_token(theirs, 4096)
            weights = sum(math.prod(dims) for dims, _ in shapes.weight_shapes(ours))
            assert weights == shapes.param_count(ours)
