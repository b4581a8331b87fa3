"""models/linen_block.py: the recipe's NNX Block written in Linen gives the same output
for the same weights, under the same names and logical axes, alone and sharded by the
recipe's rules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lessons.models import linen_block
from jaxdist_lm import layout as lm_layout
from jaxdist_lm import model as lm_model
from jaxdist_lm import model_config as lm_config

CONFIG = lm_config.PRESETS["tiny"]  # width 128, 4 heads sharing 2 key/value heads
T = 16


def inputs(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    x_BTD = jax.random.normal(jax.random.key(seed), (2, T, CONFIG.width))
    return x_BTD, jnp.arange(T)


def both(dtype=jnp.float32):
    """The recipe's NNX Block, the Linen block, and the NNX block's weights as the
    Linen block's variables (a pure dict: the paths match)."""
    block = lm_model.Block(CONFIG, dtype, rngs=nnx.Rngs(1))
    linen = linen_block.LinenBlock(CONFIG, dtype)
    variables = {"params": nnx.to_pure_dict(nnx.state(block, nnx.Param))}
    return block, linen, variables


def nnx_output(block, *args):
    return block(*args)[0]  # (output, the experts' loss: 0)


@pytest.mark.parametrize("documents", [False, True])
def test_linen_block_gives_the_nnx_blocks_output(documents):
    block, linen, variables = both()
    x_BTD, positions_T = inputs()
    starts_BT = None
    if documents:  # two documents per row: attention and RoPE restart at token 5
        starts_BT = jnp.where(positions_T < 5, 0, 5)[None].repeat(2, axis=0)
    expected = nnx_output(block, x_BTD, positions_T, starts_BT)
    got = linen.apply(variables, x_BTD, positions_T, starts_BT)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_compute_agrees_to_the_bit():
    block, linen, variables = both(jnp.bfloat16)
    x_BTD, positions_T = inputs()
    x_BTD = x_BTD.astype(jnp.bfloat16)  # the residual stream in the compute type
    expected = nnx_output(block, x_BTD, positions_T, None)
    got = linen.apply(variables, x_BTD, positions_T)
    assert got.dtype == expected.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), expected.astype(float))


def test_the_comparison_can_fail():
    """Other weights in one projection give other outputs: the equality is not vacuous."""
    block, linen, variables = both()
    x_BTD, positions_T = inputs()
    expected = nnx_output(block, x_BTD, positions_T, None)
    down = variables["params"]["mlp"]["down"]
    down["kernel"] = down["kernel"] * 1.01
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        np.testing.assert_allclose(
            linen.apply(variables, x_BTD, positions_T), expected, rtol=1e-6, atol=1e-6
        )


def test_a_freshly_initialised_linen_block_draws_other_weights():
    block, linen, _ = both()
    x_BTD, positions_T = inputs()
    fresh = linen.init(jax.random.key(1), x_BTD, positions_T)
    expected = nnx_output(block, x_BTD, positions_T, None)
    assert not np.allclose(linen.apply(fresh, x_BTD, positions_T), expected, atol=1e-3)


def test_same_paths_shapes_and_logical_axis_names():
    block, linen, _ = both()
    x_BTD, positions_T = inputs()
    variables = linen.init(jax.random.key(1), x_BTD, positions_T)
    linen_names = nn.get_partition_spec(variables)["params"]
    nnx_names = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(block)))
    assert nnx_names == linen_names
    shapes = lambda tree: jax.tree.map(jnp.shape, tree)
    linen_params = nn.meta.unbox(variables["params"])
    assert shapes(nnx.to_pure_dict(nnx.state(block))) == shapes(linen_params)


def test_weights_move_back_into_an_nnx_block():
    """Linen's weights go into the recipe's block by one nnx.update."""
    block, linen, _ = both()
    x_BTD, positions_T = inputs()
    variables = linen.init(jax.random.key(1), x_BTD, positions_T)
    nnx.update(block, nn.meta.unbox(variables["params"]))
    expected = linen.apply(variables, x_BTD, positions_T)
    got = nnx_output(block, x_BTD, positions_T, None)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_sharded_by_the_recipes_rules_the_output_is_the_same():
    """On data=2, fsdp=2, tensor=2 under layout.RULES: the Linen block's weights are
    laid out as the NNX block's, and its jitted output equals the unsharded NNX one."""
    block, linen, variables = both()
    x_BTD, positions_T = inputs()
    expected = nnx_output(block, x_BTD, positions_T, None)
    sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    mesh = jax.make_mesh(
        tuple(sizes.get(a, 1) for a in lm_layout.AXES),
        lm_layout.AXES,
        axis_types=(AxisType.Auto,) * len(lm_layout.AXES),
        devices=jax.devices()[:8],
    )
    boxed = linen.init(jax.random.key(1), x_BTD, positions_T)
    linen_specs = nn.get_partition_spec(boxed)["params"]
    shardings = nn.logical_to_mesh_sharding(linen_specs, mesh, lm_layout.RULES)
    nnx_specs = nnx.get_partition_spec(nnx.state(block, nnx.Param))
    nnx_shardings = nn.logical_to_mesh_sharding(nnx_specs, mesh, lm_layout.RULES)
    assert nnx.to_pure_dict(nnx_shardings) == shardings
    assert shardings["attention"]["query"].spec == P("fsdp", "tensor", None)

    @jax.jit
    def forward(params, x_BTD):
        return linen.apply({"params": params}, x_BTD, positions_T)

    with jax.set_mesh(mesh), nn.logical_axis_rules(lm_layout.RULES):
        params = jax.device_put(variables["params"], shardings)
        got = forward(params, x_BTD)
    assert params["mlp"]["down"]["kernel"].sharding.spec == P("tensor", "fsdp")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
