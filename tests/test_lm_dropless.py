"""jaxdist_lm/dropless.py: dropless experts (grouped matrix products, nothing dropped)
equal a dense loop over the experts, on one device and split over an 'expert' axis; in
the recipe, --dispatch dropless gives the same steps on any mesh, and the same steps as
a capacity large enough to drop nothing."""

import functools
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_lm_recipe import COMMON, small_batches, small_experts, steps_on

from jaxdist_lm import compiled as lm_compiled
from jaxdist_lm import (
    dropless,
    train,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]

E, R, D, F = 8, 2, 16, 24  # experts, choices a token, width, MLP width


def problem(tokens: int, seed: int = 0):
    """Tokens, their top-R experts (expert 5 chosen by none, expert 0 by many) and
    gates, and the experts' weights."""
    k = jax.random.split(jax.random.key(seed), 5)
    x_TD = jax.random.normal(k[0], (tokens, D))
    probs = jax.nn.softmax(jax.random.normal(k[1], (tokens, E)).at[:, 0].add(1.5))
    gates_TR, experts_TR = jax.lax.top_k(probs.at[:, 5].set(0.0), R)
    weights = [
        jax.random.normal(k[i], s) / s[1] ** 0.5
        for i, s in ((2, (E, D, F)), (3, (E, D, F)), (4, (E, F, D)))
    ]
    return x_TD, experts_TR, gates_TR, weights


def loop_over_experts(x_TD, experts_TR, gates_TR, w_gate, w_up, w_down):
    """The reference: every expert on every token, kept where the token chose it."""
    y_TD = jnp.zeros_like(x_TD)
    for e in range(E):
        h = nn.silu(x_TD @ w_gate[e]) * (x_TD @ w_up[e])
        weight_T = jnp.sum(jnp.where(experts_TR == e, gates_TR, 0.0), axis=1)
        y_TD += weight_T[:, None] * (h @ w_down[e])
    return y_TD


def test_dropless_equals_a_loop_over_experts():
    """Forward and every gradient (tokens, gates, the three weights), to 1e-5."""
    x_TD, experts_TR, gates_TR, weights = problem(64)
    assert int((experts_TR == 5).sum()) == 0 and int((experts_TR == 0).sum()) > 32

    def loss(fn, x, g, w):
        return jnp.sum(jnp.sin(fn(x, experts_TR, g, *w)))

    for fn in (dropless.local_experts, loop_over_experts):
        np.testing.assert_allclose(
            fn(x_TD, experts_TR, gates_TR, *weights),
            loop_over_experts(x_TD, experts_TR, gates_TR, *weights),
            rtol=1e-5,
            atol=1e-5,
        )
    ours = jax.grad(loss, argnums=(1, 2, 3))(
        dropless.local_experts, x_TD, gates_TR, weights
    )
    theirs = jax.grad(loss, argnums=(1, 2, 3))(
        loop_over_experts, x_TD, gates_TR, weights
    )
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def ragged_all_to_all_by_gathers(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name,
):
    """jax.lax.ragged_all_to_all as its docstring defines it, from all_gathers (XLA:CPU
    has no ragged-all-to-all): the slice operand[input_offsets[j]:][:send_sizes[j]]
    of each device goes to device j, at output_offsets[j] there."""
    me, rows = jax.lax.axis_index(axis_name), jnp.arange(output.shape[0])
    gather = lambda a: jax.lax.all_gather(a, axis_name)
    sent, starts, sizes, lands = map(
        gather, (operand, input_offsets, send_sizes, output_offsets)
    )
    for source in range(jax.lax.axis_size(axis_name)):
        at, size = lands[source, me], sizes[source, me]
        take = (rows >= at) & (rows < at + size)
        row = jnp.clip(rows - at + starts[source, me], 0, operand.shape[0] - 1)
        output = jnp.where(take[:, None], sent[source][row], output)
    return output


EXCHANGES = {
    "padded": dropless.padded_experts,
    "ragged": functools.partial(
        dropless.ragged_experts, exchange=ragged_all_to_all_by_gathers
    ),
}


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_experts_split_over_devices_give_the_same_tokens_and_gradients(exchange):
    """Both exchanges (padded all_to_alls; ragged_all_to_all, here written with
    all_gathers) on 4 devices of an 'expert' axis, 2 experts each, every device with its
    own 16 tokens (expert 0's device gets most of the pairs, expert 5's none of its
    own): the outputs and gradients of local_experts on all 64, to 1e-5."""
    x_TD, experts_TR, gates_TR, weights = problem(64, seed=1)
    mesh = jax.make_mesh(
        (4,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4]
    )
    split = jax.jit(
        jax.shard_map(
            lambda x, e, g, *w: EXCHANGES[exchange](x, e, g, *w, axis="expert"),
            mesh=mesh,
            in_specs=(P("expert"), P("expert"), P("expert"), *[P("expert")] * 3),
            out_specs=P("expert"),
        )
    )

    def loss(fn, x, g, w):
        return jnp.sum(jnp.sin(fn(x, experts_TR, g, *w)))

    np.testing.assert_allclose(
        split(x_TD, experts_TR, gates_TR, *weights),
        dropless.local_experts(x_TD, experts_TR, gates_TR, *weights),
        rtol=1e-5,
        atol=1e-5,
    )
    ours = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)(
        split, x_TD, gates_TR, weights
    )
    theirs = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)(
        dropless.local_experts, x_TD, gates_TR, weights
    )
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_on_a_gpu_the_recipe_exchanges_with_ragged_all_to_all(monkeypatch):
    """Dropless on data=2,expert=4: where the backend is a GPU, train.py picks the
    ragged exchange, and the step lowered for CUDA calls ragged_all_to_all 6 times
    (a layer's two exchanges in the forward, again in the remat's recomputation, and
    their two transposes in the backward); on this CPU, the padded one, none."""
    flags = [
        *COMMON,
        "--mesh",
        "data=2,expert=4",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--dispatch",
        "dropless",
        "--attention",
        "chunked",
    ]
    args = train.parse_args(flags)
    calls = {}
    for backend in ("cpu", "gpu"):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        mesh, model, _, step, shapes, _ = train.setup(args)
        monkeypatch.undo()
        text = lm_compiled.lower_step(step, shapes, args, mesh, "cuda").as_text()
        calls[model.config.exchange] = text.count("@ragged_all_to_all(")
    assert calls == {"padded": 0, "ragged": 6}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_dropless_compiles_in_bfloat16_with_float32_sums_of_gradients():
    """In bfloat16 on data=2,expert=4 and fsdp=2,expert=2,tensor=2: XLA:CPU compiles the
    step (it aborts on a bfloat16 sum that a shard_map's transpose writes, so the sums of
    the tokens' and weights' gradients are float32, dropless.in_compute_type), and the
    experts' weight gradients are reduce-scattered over fsdp (dropless.gathered)."""
    for mesh_flag in ("data=2,expert=4", "fsdp=2,expert=2,tensor=2"):
        args = train.parse_args(
            [
                *COMMON,
                "--mesh",
                mesh_flag,
                "--experts",
                "8",
                "--top-k",
                "2",
                "--dispatch",
                "dropless",
                "--dtype",
                "bfloat16",
            ]
        )
        mesh, _, _, step, shapes, _ = train.setup(args)
        text = lm_compiled.lower_step(step, shapes, args, mesh).compile().as_text()
        sent = lm_compiled.collective_bytes(text)
        assert ("reduce-scatter" in sent) == ("fsdp" in mesh_flag), sent


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_dropless_steps_are_the_same_on_every_mesh_and_as_a_roomy_capacity(tmp_path):
    """8 experts, top-2, 3 steps in float32, 2 layers (test_lm_recipe.SMALL_EXPERTS):
    --dispatch dropless on data=8, on data=2,expert=4 (worst-case all_to_alls) and on
    fsdp=2,expert=2,tensor=2 (weights gathered over fsdp, the MLP width split over
    tensor) give the same losses and gradient norms, to 1e-5; so does GShard's dispatch
    with a capacity factor of experts / top-k = 4, which drops nothing; a capacity
    factor of 1 drops choices and gives other losses."""
    batches = small_batches(4, 3)
    shape = small_experts(tmp_path)
    moe = ["--experts", "8", "--top-k", "2", "--steps", "10"]
    runs = {}
    for spec, extra in (
        ("data=8", ["--dispatch", "dropless"]),
        ("data=2,expert=4", ["--dispatch", "dropless"]),
        ("fsdp=2,expert=2,tensor=2", ["--dispatch", "dropless"]),
        ("data=8", ["--capacity-factor", "4"]),
        ("data=8", ["--capacity-factor", "1"]),
    ):
        args = train.parse_args([*shape, "--mesh", spec, *moe, *extra])
        mesh, _, _, step, shapes, init = train.setup(args)
        runs[spec, extra[-1]] = steps_on(step, shapes, init, mesh, batches)
    print(runs)
    expected = runs["data=8", "dropless"]
    for key in [
        ("data=2,expert=4", "dropless"),
        ("fsdp=2,expert=2,tensor=2", "dropless"),
        ("data=8", "4"),
    ]:
        np.testing.assert_allclose(runs[key], expected, rtol=1e-5, err_msg=str(key))
    assert np.abs(runs["data=8", "1"][:, 0] - expected[:, 0]).max() > 1e-4
