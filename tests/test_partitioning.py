import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import partitioning as PT
from jaxdist_lessons import sharding
from jaxdist_lessons.models import small, transformer, vit

N = jax.device_count()
MODEL = vit.ViT(
    num_classes=10, patch_size=4, hidden=32, num_layers=1, num_heads=8, mlp_dim=64
)
IMAGES = jnp.zeros((1, 8, 8, 3))


def loss_fn(params, batch):
    return vit.classification_loss(MODEL, params, batch)


@pytest.fixture(scope="module")
def variables():
    return jax.eval_shape(MODEL.init, jax.random.key(0), IMAGES)


def mesh_specs(variables, rules):
    """Every leaf's mesh spec under ``rules``, as the chapter takes it with Flax."""
    return jax.tree.map(
        lambda spec: nn.logical_to_mesh_axes(spec, rules),
        nn.get_partition_spec(variables),
        is_leaf=lambda x: isinstance(x, P),
    )


def spec(variables, strategy, *path):
    specs = mesh_specs(variables, PT.rules_for(strategy))["params"]
    for key in path:
        specs = specs[key]
    return specs


def test_rules_give_each_strategy_its_specs(variables):
    up, down = ("Block_0", "mlp", "up", "kernel"), ("Block_0", "mlp", "down", "kernel")
    query = ("Block_0", "attention", "query", "kernel")
    assert spec(variables, "data", *up) == P(None, None)
    assert spec(variables, "fsdp", *up) == P("fsdp", None)
    # through 'mlp', the next rule
    assert spec(variables, "fsdp", "Block_0", "mlp", "up", "bias") == P("fsdp")
    assert spec(variables, "tensor", *up) == P(None, "tensor")
    assert spec(variables, "tensor", *down) == P("tensor", None)
    assert spec(variables, "tensor", *query) == P(None, "tensor", None)
    assert spec(variables, "hybrid", *query) == P(None, "tensor", None)
    assert spec(variables, "fsdp+tensor", *up) == P("fsdp", "tensor")
    assert spec(variables, "tensor", "head", "kernel") == P(None, None)
    assert nn.logical_to_mesh_axes(("batch",), PT.rules_for("hybrid")) == P("data")


def test_mesh_shapes_and_unknown_strategy():
    assert PT.mesh_shape_for("data", N) == (N, 1, 1)
    assert PT.mesh_shape_for("fsdp", N) == (1, N, 1)
    assert PT.mesh_shape_for("tensor", N) == (1, 1, N)
    assert PT.mesh_shape_for("hybrid", 8) == (4, 1, 2)
    assert PT.mesh_shape_for("fsdp+tensor", 8, tensor=4) == (1, 2, 4)
    with pytest.raises(ValueError, match="unknown strategy 'zero'; known: data, fsdp"):
        PT.rules_for("zero")


def test_four_axis_rules_split_the_batch_over_data_and_fsdp_first():
    # The first matching rule wins: 'mlp' goes to 'tensor' (tensor rules come before FSDP's).
    assert nn.logical_to_mesh_axes(("embed", "mlp"), PT.FOUR_AXIS_RULES) == P(
        "fsdp", "tensor"
    )
    assert nn.logical_to_mesh_axes(("mlp",), PT.FOUR_AXIS_RULES) == P("tensor")
    # 'fsdp' is taken by the batch, so 'embed' stays whole in an activation.
    assert nn.logical_to_mesh_axes(("batch", None, "embed"), PT.FOUR_AXIS_RULES) == P(
        ("data", "fsdp"), None, None
    )


def test_same_losses_under_every_strategy_and_state_born_sharded():
    batch = {
        "images": jax.random.normal(jax.random.key(1), (8, 8, 8, 3)),
        "labels": jax.random.randint(jax.random.key(2), (8,), 0, 10),
    }
    losses, states = {}, {}
    for strategy in ("data", "fsdp", "tensor", "hybrid"):
        mesh, rules = PT.strategy_mesh(strategy), PT.rules_for(strategy)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            run = PT.train_strategy(MODEL, loss_fn, [batch] * 3, mesh, rules)
        losses[strategy], states[strategy] = run.losses, run.state
    reference = losses["data"]
    assert reference[2] < reference[0]  # it learns the batch
    for strategy, values in losses.items():
        np.testing.assert_allclose(values, reference, rtol=2e-5, err_msg=strategy)
    # Each parameter, and Adam's moments with it, is held in the blocks its rules say.
    for strategy, state in states.items():
        kernel = state.params["Block_0"]["mlp"]["up"]["kernel"]
        mu = state.opt_state[0].mu["Block_0"]["mlp"]["up"]["kernel"]
        expected = {
            "data": (32, 64),
            "fsdp": (32 // N, 64),
            "tensor": (32, 64 // N),
            "hybrid": (32, 64 // min(2, N)),
        }[strategy]
        assert kernel.value.addressable_shards[0].data.shape == expected
        assert mu.value.sharding == kernel.value.sharding
    held = max(sharding.bytes_per_device(nn.unbox(states["fsdp"].params)).values())
    total = sum(x.nbytes for x in jax.tree.leaves(nn.unbox(states["data"].params)))
    assert held < total / N * 1.05  # FSDP: about 1/N of the weights per device


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_nnx_partitioning_survives_an_optimizer_step(axis_type):
    # Chapter 09_flax_partitioning's NNX cells: created under nnx.jit in the mesh, one nnx.value_and_grad step.
    tensor_size = min(2, N)
    mesh = jax.make_mesh(
        (N // tensor_size, tensor_size), ("data", "tensor"), axis_types=(axis_type,) * 2
    )

    @nnx.jit
    def create():
        return small.NNXMLP(8, 16, 4, rngs=nnx.Rngs(0))

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(model):
            prediction = model(x, out_sharding=jax.typeof(y).sharding.spec)
            return jnp.mean((prediction - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with jax.set_mesh(mesh):
        model = create()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    specs = nnx.get_partition_spec(nnx.state(model))
    assert specs["up"]["kernel"].get_value() == P(None, "tensor")
    assert specs["down"]["kernel"].get_value() == P("tensor", None)
    named = nnx.get_named_sharding(nnx.state(model), mesh)
    assert named["up"]["kernel"].get_value() == jax.NamedSharding(
        mesh, P(None, "tensor")
    )
    rows = jax.sharding.NamedSharding(mesh, P("data"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 8)), rows)
    y = jax.device_put(jnp.ones((8, 4)), rows)
    with jax.set_mesh(mesh):
        losses = [float(step(model, optimizer, x, y)) for _ in range(3)]
    assert losses[2] < losses[0]
    kernel = model.up.kernel.get_value()
    assert kernel.addressable_shards[0].data.shape == (8, 16 // tensor_size)
    assert (
        optimizer.opt_state[0].mu["up"]["kernel"].get_value().sharding.spec
        == kernel.sharding.spec
    )


def test_nnx_without_a_mesh_in_context_fails_with_flax_message():
    with pytest.raises(
        ValueError, match="An auto mesh context or metadata is required"
    ):
        small.NNXMLP(8, 16, 4, rngs=nnx.Rngs(0))


LM_CONFIG = {
    "vocab_size": 32,
    "num_layers": 1,
    "hidden": 16,
    "num_heads": 8,
    "max_len": 8,
}


def test_decoder_logical_axes_name_every_parameter_and_change_no_value():
    tokens = jnp.zeros((1, 8), jnp.int32)
    plain = jax.jit(transformer.Decoder(**LM_CONFIG).init)(jax.random.key(0), tokens)
    named = jax.jit(transformer.Decoder(**LM_CONFIG, logical_axes=True).init)(
        jax.random.key(0), tokens
    )
    # the default is unchanged
    assert not any(
        isinstance(x, nn.LogicallyPartitioned)
        for x in jax.tree.leaves(
            plain, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
        )
    )
    for a, b in zip(
        jax.tree.leaves(plain), jax.tree.leaves(nn.unbox(named)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    tensor = mesh_specs(named, PT.rules_for("tensor"))["params"]
    assert tensor["embed"]["embedding"] == P("tensor", None)  # vocabulary-parallel
    assert tensor["Block_0"]["attention"]["query"]["kernel"] == P(None, "tensor", None)
    assert tensor["Block_0"]["attention"]["out"]["kernel"] == P("tensor", None, None)
    assert tensor["Block_0"]["mlp"]["down"]["kernel"] == P("tensor", None)
    assert mesh_specs(named, PT.rules_for("fsdp"))["params"]["position"] == P(
        None, "fsdp"
    )


def test_decoder_same_losses_data_parallel_and_fsdp_with_tensor():
    lm = transformer.Decoder(**LM_CONFIG, logical_axes=True)
    tokens = transformer.random_tokens(jax.random.key(1), 8, 9, 32)

    def loss(params, batch):
        return transformer.next_token_loss(lm, params, batch)

    runs = {  # no rules in context: the decoder's DenseGeneral kernels (make_train_step)
        s: PT.train_strategy(
            lm,
            loss,
            [tokens] * 3,
            PT.strategy_mesh(s),
            PT.rules_for(s),
            sample=tokens[:1, :-1],
        )
        for s in ("data", "fsdp+tensor")
    }
    assert runs["data"].losses[2] < runs["data"].losses[0]
    np.testing.assert_allclose(
        runs["fsdp+tensor"].losses, runs["data"].losses, rtol=2e-5
    )
    embedding = runs["fsdp+tensor"].state.params["embed"]["embedding"].value
    tensor_size = runs["fsdp+tensor"].mesh.shape["tensor"]
    assert embedding.addressable_shards[0].data.shape == (
        32 // tensor_size,
        16 // (N // tensor_size),
    )
