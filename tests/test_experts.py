"""The MoE layer: routing and capacity, the einsum and all-to-all forms against a dense reference."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, experts

E, D, F = 24, 16, 32  # 24 experts: 4, 6 and 8 devices all divide it
PARAMS = experts.init_params(jax.random.key(0), D, F, E)


def max_error(a, b):
    return max(
        float(jnp.max(jnp.abs(u - v)))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def test_capacity_is_the_ceiling():
    assert experts.capacity(100, 8, 1, 1.0) == 13
    assert experts.capacity(100, 8, 2, 1.25) == 32
    assert experts.capacity(16, 24, 2, 12.0) == 16


def test_route_drops_beyond_capacity_first_choices_first():
    # 4 tokens all prefer expert 0, then expert 1; capacity 2.
    logits_TE = jnp.array([[3.0, 2.0, 0.0]] * 4)
    r = experts.route(logits_TE, 2, 2)
    assert r.dispatch_TEM[:, 0].tolist() == [[1, 0], [0, 1], [0, 0], [0, 0]]
    assert r.dispatch_TEM[:, 1].tolist() == [[1, 0], [0, 1], [0, 0], [0, 0]]
    assert int(r.dropped) == 4
    assert r.fraction_E.tolist() == [0.5, 0.5, 0.0]
    gate0 = 1 / (1 + jnp.exp(-1.0))  # renormalised top-2 gate of expert 0
    assert jnp.allclose(r.combine_TEM[0, 0, 0], gate0)
    assert experts.dropped_fraction(logits_TE, 2, 0.75) == 0.5


def test_balance_loss_is_one_when_uniform_and_z_loss_is_mean_squared_logsumexp():
    assert float(experts.balance_loss(jnp.full(4, 0.25), jnp.full(4, 0.25))) == 1.0
    assert (
        float(
            experts.balance_loss(jnp.array([1.0, 0, 0, 0]), jnp.array([1.0, 0, 0, 0]))
        )
        == 4.0
    )
    logits_TE = jnp.array([[0.0, 0.0], [1.0, 1.0]])
    expected = (jnp.log(2.0) ** 2 + (1 + jnp.log(2.0)) ** 2) / 2
    assert jnp.allclose(experts.route(logits_TE, 1, 2).z_loss, expected)


@pytest.mark.parametrize("top_k", [1, 2])
def test_einsum_layer_equals_reference_with_ample_capacity(top_k):
    x_TD = jax.random.normal(jax.random.key(1), (32, D))
    y_TD, stats = experts.moe_einsum(PARAMS, x_TD, top_k, E / top_k)
    assert int(stats.dropped) == 0
    assert max_error(y_TD, experts.moe_reference(PARAMS, x_TD, top_k)) < 1e-5
    # and a tight capacity drops tokens, so the layer no longer equals the reference
    y_tight, tight = experts.moe_einsum(PARAMS, x_TD, top_k, 0.5)
    assert int(tight.dropped) > 0 and max_error(y_tight, y_TD) > 1e-2


@pytest.mark.parametrize(
    "shape, top_k", [((8, 1), 1), ((4, 2), 2), ((3, 2), 1), ((4, 1), 2)]
)
def test_all_to_all_layer_equals_reference_outputs_gradients_and_bytes(shape, top_k):
    n = shape[0] * shape[1]
    mesh = jax.make_mesh(
        shape,
        ("expert", "data"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices()[:n],
    )
    x_TD = jax.random.normal(jax.random.key(1), (8 * n, D))
    factor = E / top_k  # every expert can take every local token: none dropped

    def loss(layer, params, x_TD):
        y_TD, stats = layer(params, x_TD)
        return jnp.sum(y_TD**2), (stats, y_TD)

    def layer(p, x):
        return experts.moe_all_to_all(p, x, top_k, factor, mesh)

    def reference(p, x):
        return experts.moe_reference(p, x, top_k), experts.moe_einsum(
            p, x, top_k, factor
        )[1]

    step = jax.jit(
        jax.value_and_grad(lambda p, x: loss(layer, p, x), (0, 1), has_aux=True)
    )
    compiled = step.lower(PARAMS, x_TD).compile()
    (_, (stats, y_TD)), grads = compiled(PARAMS, x_TD)
    (_, (ref_stats, ref_TD)), ref_grads = jax.jit(
        jax.value_and_grad(lambda p, x: loss(reference, p, x), (0, 1), has_aux=True)
    )(PARAMS, x_TD)
    assert int(stats.dropped) == 0
    assert max_error(y_TD, ref_TD) < 1e-5
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
    assert max_error(grads, ref_grads) < 1e-5 * scale
    assert abs(float(stats.balance_loss - ref_stats.balance_loss)) < 1e-5
    assert abs(float(stats.z_loss - ref_stats.z_loss)) < 1e-4
    # forward: 2 all-to-alls of the local buffer; with the input's gradient, backward adds 2 more
    buffer = experts.all_to_all_bytes(E, experts.capacity(8, E, top_k, factor), D)
    forward = jax.jit(layer).lower(PARAMS, x_TD).compile().as_text()
    assert comms.summary(forward)["all-to-all"] == {
        "count": 2,
        "in_loop": 0,
        "bytes": 2 * buffer,
    }
    backward = comms.summary(compiled.as_text())["all-to-all"]
    assert backward == {"count": 4, "in_loop": 0, "bytes": 4 * buffer}


def test_router_logits_skew_favours_low_experts():
    logits_TE = experts.router_logits(jax.random.key(0), 4096, 8, skew=2.0)
    counts = jnp.bincount(jnp.argmax(logits_TE, axis=-1), length=8)
    assert int(counts[0]) > int(counts[1]) > int(counts[-1])
    flat = experts.router_logits(jax.random.key(0), 4096, 8)
    assert experts.dropped_fraction(logits_TE, 1, 1.0) > experts.dropped_fraction(
        flat, 1, 1.0
    )


def test_all_to_all_buffers_in_bf16_and_the_weights_per_device_compile_only():
    # compile only: 24 experts of width 512 -> 1024 in bf16 on (4, 2), 256 tokens per device
    mesh = jax.make_mesh(
        (4, 2), ("expert", "data"), axis_types=(AxisType.Explicit,) * 2
    )
    specs = {"router_DE": P(), "w_in_EDF": P("expert"), "w_out_EFD": P("expert")}
    shapes = {
        "router_DE": (512, E),
        "w_in_EDF": (E, 512, 1024),
        "w_out_EFD": (E, 1024, 512),
    }
    abstract = {
        name: jax.ShapeDtypeStruct(
            shapes[name], jnp.bfloat16, sharding=NamedSharding(mesh, specs[name])
        )
        for name in specs
    }
    x = jax.ShapeDtypeStruct(
        (256 * 8, 512),
        jnp.bfloat16,
        sharding=NamedSharding(mesh, P(("expert", "data"))),
    )
    layer = jax.jit(lambda p, x: experts.moe_all_to_all(p, x, 2, 1.25, mesh))
    lowered = layer.lower(abstract, x)
    # the program JAX writes moves bf16 buffers (a float32 one-hot would have promoted them) ...
    lines = lowered.as_text().splitlines()
    exchanged = [
        line.split("->")[-1] for line in lines if "stablehlo.all_to_all" in line
    ]
    assert len(exchanged) == 2 and all("x512xbf16>" in line for line in exchanged)
    # ... and XLA:CPU converts them to float32 around its all-to-all: twice the bytes
    program = lowered.compile()
    buffer = experts.all_to_all_bytes(
        E, experts.capacity(256, E, 2, 1.25), 512, itemsize=4
    )
    found = comms.summary(program.as_text())["all-to-all"]["bytes"]
    assert found == 2 * buffer == 2 * 24 * 27 * 512 * 4
    weights = 2 * E * 512 * 1024 * 2 // 4 + 512 * E * 2
    assert program.memory_analysis().argument_size_in_bytes == weights + 256 * 512 * 2
