"""jaxdist_lm/experts.py: DeepSeek-V3's auxiliary-loss-free balance (a routing
bias moved by sign descent) and DeepSeekMoE's shared experts, alone and in the recipe."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_lm_recipe import small_batches, small_experts, steps_on

from jaxdist_lm import experts as experts_lib
from jaxdist_lm import (
    layers,
    model_config,
    train,
)
from jaxdist_lm import optimizer as optimizer_lib
from jaxdist_lm.run_config import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

E, R = 8, 2
CONFIG = dataclasses.replace(
    model_config.PRESETS["tiny"],
    num_experts=E,
    top_k=R,
    group_size=64,
    capacity_factor=E / R,
    balance="bias",
)


def experts(config=CONFIG):
    """An Experts layer's structure (nnx.split's graphdef) and its parameters, on 2
    rows of 64 tokens."""
    rngs = nnx.Rngs(jax.random.key(1))
    layer, params = nnx.split(experts_lib.Experts(config, jnp.float32, rngs=rngs))
    x_BTD = jax.random.normal(jax.random.key(0), (2, 64, config.width))
    return layer, nnx.to_pure_dict(params), x_BTD


def apply(layer, params, x_BTD):
    """The layer ``layer`` (a graphdef) holding ``params``, on x_BTD."""
    return nnx.merge(layer, params)(x_BTD)


def test_the_bias_gradient_is_each_expert_s_load_above_the_mean():
    """d(aux loss)/d(router_bias) = load_e - 1/E, where load_e is expert e's share of
    the top-k choices; no other weight gets a gradient from the bias's term."""
    layer, params, x_BTD = experts()
    grads = jax.grad(lambda p: apply(layer, p, x_BTD)[1])(params)
    probs = jax.nn.softmax(x_BTD.reshape(-1, CONFIG.width) @ params["router"], -1)
    _, chosen = jax.lax.top_k(probs, R)
    load_E = jnp.bincount(chosen.reshape(-1), length=E) / chosen.size
    np.testing.assert_allclose(grads["router_bias"], load_E - 1 / E, atol=1e-7)
    assert float(jnp.abs(load_E - 1 / E).max()) > 0.01  # unbalanced at the start
    without = dataclasses.replace(CONFIG, balance="loss")
    layer_l, params_l, _ = experts(without)
    grads_l = jax.grad(lambda p: apply(layer_l, p, x_BTD)[1])(params_l)
    # Bias: only the z-loss reaches the router; with Switch's loss, its term as well.
    assert "router_bias" not in params_l
    assert not np.allclose(grads["router"], grads_l["router"])


def test_the_bias_chooses_the_experts_and_the_gates_stay_the_router_s(monkeypatch):
    """A bias of 1 on expert 3 makes it every token's choice; the gates are still the
    router's probabilities of the chosen experts, renormalised."""
    layer, params, x_BTD = experts()
    params["router_bias"] = params["router_bias"].at[3].set(1.0)
    # what the layer's route returns as the layer runs
    seen, route = [], experts_lib.Experts.route
    monkeypatch.setattr(
        experts_lib.Experts,
        "route",
        lambda self, x: seen.append(route(self, x)) or seen[-1],
    )
    apply(layer, params, x_BTD)
    gates, chosen, _, _ = seen[0]
    x_BGTD = x_BTD.reshape(2, 1, 64, -1)
    assert bool((chosen == 3).any(-1).all())
    probs = jax.nn.softmax(x_BGTD @ params["router"], -1)
    picked = jnp.take_along_axis(probs, chosen, -1)
    np.testing.assert_allclose(gates, picked / picked.sum(-1, keepdims=True), rtol=1e-6)


def test_sign_descent_moves_the_bias_by_the_rate():
    """make_optimizer with --balance bias: router_bias moves by -rate x sign(gradient),
    and every other weight as AdamW alone moves it."""
    run = RunConfig(
        learning_rate=1e-2,
        warmup_steps=0,
        total_steps=10,
        steps=10,
        clip_norm=1.0,
        weight_decay=0.1,
        balance="bias",
        bias_rate=0.001,
    )
    params = {"router_bias": jnp.zeros(4), "kernel": jnp.ones((2, 2))}
    grads = {
        "router_bias": jnp.array([0.2, -0.1, 0.0, 0.05]),
        "kernel": jnp.full((2, 2), 0.3),
    }
    tx = optimizer_lib.make_optimizer(run)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["router_bias"], [-0.001, 0.001, 0.0, -0.001])
    alone = optimizer_lib.make_optimizer(dataclasses.replace(run, balance="loss"))
    kernel = {"kernel": params["kernel"]}
    expected, _ = alone.update({"kernel": grads["kernel"]}, alone.init(kernel), kernel)
    np.testing.assert_allclose(updates["kernel"], expected["kernel"])


def test_shared_experts_add_one_mlp_every_token_goes_through():
    """--shared-experts 2: the routed experts' output plus an MLP of twice the width,
    with the same weights."""
    shared = dataclasses.replace(CONFIG, shared_experts=2)
    layer, params, x_BTD = experts(shared)
    assert params["shared"]["up"]["kernel"].shape == (
        shared.width,
        2 * shared.mlp_width,
    )
    y_BTD, _ = apply(layer, params, x_BTD)
    alone = {k: v for k, v in params.items() if k != "shared"}
    routed, _ = apply(experts()[0], alone, x_BTD)
    wide = dataclasses.replace(shared, mlp_width=2 * shared.mlp_width)
    mlp_layer = nnx.graphdef(layers.MLP(wide, jnp.float32, rngs=nnx.Rngs(0)))
    mlp = nnx.merge(mlp_layer, params["shared"])(x_BTD)
    np.testing.assert_allclose(y_BTD, routed + mlp, rtol=1e-5, atol=1e-6)
    assert model_config.count_params(shared) == model_config.count_params(CONFIG) + (
        shared.num_layers * 3 * shared.width * 2 * shared.mlp_width
    )


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_bias_balance_and_shared_experts_train_the_same_on_an_expert_axis(tmp_path):
    """--balance bias --shared-experts 1, dropless: 3 steps on data=8 and on
    data=2,expert=4 give the same losses and gradient norms, to 1e-5 (2 layers,
    test_lm_recipe.SMALL_EXPERTS)."""
    batches = small_batches(5, 3)
    shape = small_experts(tmp_path)
    flags = [
        "--experts",
        "8",
        "--top-k",
        "2",
        "--balance",
        "bias",
        "--steps",
        "10",
        "--shared-experts",
        "1",
        "--dispatch",
        "dropless",
    ]
    runs = []
    for spec in ("data=8", "data=2,expert=4"):
        args = train.parse_args([*shape, "--mesh", spec, *flags])
        mesh, _, _, step, shapes, init = train.setup(args)
        assert shapes.params["layers"]["experts"]["router_bias"].shape == (2, 8)
        runs.append(steps_on(step, shapes, init, mesh, batches))
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)
