"""models/nnx_block.py: the recipe's Linen Block in NNX gives the same output for the same
weights, under the same names and logical axes, alone and sharded by the recipe's rules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lessons.models import nnx_block
from jaxdist_lm import layout as lm_layout
from jaxdist_lm import model as lm_model
from jaxdist_lm import model_config as lm_config

CONFIG = lm_config.PRESETS["tiny"]  # width 128, 4 heads sharing 2 key/value heads
T = 16


def inputs(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    x_BTD = jax.random.normal(jax.random.key(seed), (2, T, CONFIG.width))
    return x_BTD, jnp.arange(T)


def both(dtype=jnp.float32):
    """The Linen Block with its variables, and an NNX block given the same weights."""
    x_BTD, positions_T = inputs()
    linen = lm_model.Block(CONFIG, dtype)
    variables = linen.init(jax.random.key(1), x_BTD, positions_T, None)
    block = nnx_block.NNXBlock(CONFIG, dtype, rngs=nnx.Rngs(2))
    nnx.update(block, nn.meta.unbox(variables["params"]))
    return linen, variables, block


def linen_output(linen, variables, *args):
    return linen.apply(variables, *args)[0]  # (output, the experts' loss: 0)


@pytest.mark.parametrize("documents", [False, True])
def test_nnx_block_gives_the_linen_blocks_output(documents):
    linen, variables, block = both()
    x_BTD, positions_T = inputs()
    starts_BT = None
    if documents:  # two documents per row: attention and RoPE restart at token 5
        starts_BT = jnp.where(positions_T < 5, 0, 5)[None].repeat(2, axis=0)
    expected = linen_output(linen, variables, x_BTD, positions_T, starts_BT)
    got = block(x_BTD, positions_T, starts_BT)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_compute_agrees_to_the_bit():
    linen, variables, block = both(jnp.bfloat16)
    x_BTD, positions_T = inputs()
    x_BTD = x_BTD.astype(jnp.bfloat16)  # the residual stream in the compute type
    expected = linen_output(linen, variables, x_BTD, positions_T, None)
    got = block(x_BTD, positions_T)
    assert got.dtype == expected.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), expected.astype(float))


def test_the_comparison_can_fail():
    """Other weights in one projection give other outputs: the equality is not vacuous."""
    linen, variables, block = both()
    x_BTD, positions_T = inputs()
    expected = linen_output(linen, variables, x_BTD, positions_T, None)
    block.mlp.down.kernel[...] = block.mlp.down.kernel[...] * 1.01
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        np.testing.assert_allclose(
            block(x_BTD, positions_T), expected, rtol=1e-6, atol=1e-6
        )


def test_a_fresh_nnx_block_draws_other_weights():
    linen, variables, _ = both()
    x_BTD, positions_T = inputs()
    fresh = nnx_block.NNXBlock(CONFIG, jnp.float32, rngs=nnx.Rngs(2))
    expected = linen_output(linen, variables, x_BTD, positions_T, None)
    assert not np.allclose(fresh(x_BTD, positions_T), expected, atol=1e-3)


def test_same_paths_shapes_and_logical_axis_names():
    _, variables, block = both()
    linen_names = nn.get_partition_spec(variables)["params"]
    nnx_names = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(block)))
    assert nnx_names == linen_names
    shapes = lambda tree: jax.tree.map(jnp.shape, tree)
    linen_params = nn.meta.unbox(variables["params"])
    assert shapes(nnx.to_pure_dict(nnx.state(block))) == shapes(linen_params)


def test_sharded_by_the_recipes_rules_the_output_is_the_same():
    """On data=2, fsdp=2, tensor=2 under layout.RULES: the NNX block's weights are laid
    out as the Linen block's, and its jitted output equals the unsharded Linen one."""
    linen, variables, block = both()
    x_BTD, positions_T = inputs()
    expected = linen_output(linen, variables, x_BTD, positions_T, None)
    sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    mesh = jax.make_mesh(
        tuple(sizes.get(a, 1) for a in lm_layout.AXES),
        lm_layout.AXES,
        axis_types=(AxisType.Auto,) * len(lm_layout.AXES),
        devices=jax.devices()[:8],
    )
    graph, state = nnx.split(block)
    specs = nnx.get_partition_spec(state)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, lm_layout.RULES)
    linen_specs = nn.get_partition_spec(variables)["params"]
    linen_shardings = nn.logical_to_mesh_sharding(linen_specs, mesh, lm_layout.RULES)
    assert nnx.to_pure_dict(shardings) == linen_shardings
    assert shardings["attention"]["query"].get_value().spec == P("fsdp", "tensor", None)

    @jax.jit
    def forward(state, x_BTD):
        return nnx.merge(graph, state)(x_BTD, positions_T)

    with jax.set_mesh(mesh), nn.logical_axis_rules(lm_layout.RULES):
        state = jax.device_put(state, shardings)
        got = forward(state, x_BTD)
    kernel = state["mlp"]["down"]["kernel"].get_value()
    assert kernel.sharding.spec == P("tensor", "fsdp")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
