import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

from jaxdist_lessons import memory, sharding
from jaxdist_lessons.mesh import mesh_shape
from jaxdist_lessons.models import resnet


def abstract_variables(model, image_size=32):
    init = functools.partial(model.init, train=False)
    return jax.eval_shape(
        init, jax.random.key(0), jnp.ones((1, image_size, image_size, 3))
    )


@pytest.mark.parametrize(
    "family, stage_sizes, bottleneck, published",
    [
        (resnet.ResNet18, (2, 2, 2, 2), False, 11_689_512),
        (resnet.ResNet34, (3, 4, 6, 3), False, 21_797_672),
        (resnet.ResNet50, (3, 4, 6, 3), True, 25_557_032),
        (resnet.ResNet101, (3, 4, 23, 3), True, 44_549_160),
        (resnet.ResNet152, (3, 8, 36, 3), True, 60_192_808),
    ],
)
def test_parameter_counts_are_the_published_ones_and_match_the_memory_walk(
    family, stage_sizes, bottleneck, published
):
    params = abstract_variables(family(num_classes=1000))["params"]
    count = sum(leaf.size for leaf in jax.tree.leaves(params))
    assert count == published
    assert count == memory.resnet_params(
        stage_sizes=stage_sizes, bottleneck=bottleneck, num_classes=1000
    )


def test_width_multiplier_and_batch_stats():
    variables = abstract_variables(resnet.ResNet18(num_classes=10, width=0.25))
    assert variables["params"]["conv_init"]["kernel"].shape == (7, 7, 3, 16)
    assert variables["params"]["head"]["kernel"].shape == (128, 10)
    assert set(variables) == {"params", "batch_stats"}


def test_forward_pass_shapes_and_dtype():
    model = resnet.ResNet18(num_classes=10, width=0.125, dtype=jnp.bfloat16)
    x = jnp.ones((2, 32, 32, 3))
    variables = model.init(jax.random.key(0), x, train=False)
    logits, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert logits.shape == (2, 10) and logits.dtype == jnp.bfloat16
    assert set(updates) == {"batch_stats"}


def test_partition_rules_cover_resnet50_on_a_tensor_axis():
    n = jax.device_count()
    mesh = jax.make_mesh(
        mesh_shape(n, data=-1, tensor=2),
        ("data", "tensor"),
        axis_types=(AxisType.Explicit,) * 2,
    )
    variables = abstract_variables(resnet.ResNet50(num_classes=1000))
    specs = sharding.specs_from_rules(variables, mesh, resnet.partition_rules())
    assert specs["params"]["conv_init"]["kernel"] == jax.sharding.PartitionSpec(
        None, None, None, "tensor"
    )
    assert specs["params"]["head"]["kernel"] == jax.sharding.PartitionSpec(
        None, "tensor"
    )
    assert specs["batch_stats"]["bn_init"]["mean"] == jax.sharding.PartitionSpec(
        "tensor"
    )
