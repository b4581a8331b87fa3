"""residuals: what autodiff keeps for the backward pass, parsed from print_saved_residuals."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

from jaxdist_lessons import residuals

N = jax.device_count()


def test_saved_residuals_shrink_under_checkpoint():
    def f(w, x):
        for i in range(3):
            x = jnp.tanh(x @ w[i])
        return x.sum()

    w, x = jnp.ones((3, 16, 16)), jnp.ones((4, 16))
    plain = residuals.saved_residuals(f, w, x)
    assert {(r.dtype, r.shape) for r in plain if not r.is_argument} == {
        ("f32", (4, 16)),
        ("f32", (16, 16)),
    }
    # Each of the 3 layers keeps its tanh output and 1 - tanh^2 (4x16), and its weight slice (16x16).
    assert residuals.residual_bytes(f, w, x) == 3 * (2 * 4 * 16 + 16 * 16) * 4
    remat = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
    assert residuals.residual_bytes(remat, w, x) == 0
    assert all(r.is_argument for r in residuals.saved_residuals(remat, w, x))


def test_saved_residuals_of_integers_and_booleans():
    def f(x, i):
        return jnp.sum(jnp.where(x > 0, x, 0.0) ** 2 + x[(i * 2) % 5])

    found = residuals.saved_residuals(f, jnp.ones(5), jnp.arange(5, dtype=jnp.int32))
    # The mask x > 0 (bool), the where and the square's factor (f32), and the gather's indices (i32).
    assert sorted((r.dtype, r.shape, r.nbytes) for r in found) == [
        ("bool", (5,), 5),
        ("f32", (5,), 20),
        ("f32", (5,), 20),
        ("i32", (5, 1), 20),
    ]
    assert not any(r.is_argument for r in found)
    assert (
        residuals.residual_bytes(f, jnp.ones(5), jnp.arange(5, dtype=jnp.int32)) == 65
    )


def test_saved_residuals_of_arrays_sharded_on_explicit_axes_and_of_float8():
    # On Explicit axes JAX prints a sharded dimension as `f32[8@data,4]`; the sizes stay global.
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    f = lambda w: jnp.sin(jnp.cos(w)).sum()
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((2 * N, 4)), jax.NamedSharding(mesh, jax.P("data")))
        found = residuals.saved_residuals(f, w)
    assert [(r.dtype, r.shape, r.nbytes) for r in found] == [
        ("f32", (2 * N, 4), 2 * N * 4 * 4)
    ] * 2
    # JAX prints float8 as `f8_e4m3fn[6]`: one byte an element.
    g = lambda x: (
        (x.astype(jnp.float8_e4m3fn) * x.astype(jnp.float8_e4m3fn))
        .astype(jnp.float32)
        .sum()
    )
    found = residuals.saved_residuals(g, jnp.ones(6))
    assert [(r.dtype, r.shape, r.nbytes) for r in found] == [("f8_e4m3fn", (6,), 6)] * 2


def test_a_residual_line_that_cannot_be_read_is_an_error(monkeypatch):
    monkeypatch.setattr(
        jax.ad_checkpoint,
        "print_saved_residuals",
        lambda *a: print("f32<4> output of sin"),
    )
    with pytest.raises(
        ValueError,
        match="cannot read this line of print_saved_residuals: 'f32<4> output of sin'",
    ):
        residuals.saved_residuals(jnp.sin, jnp.ones(4))


@pytest.fixture(scope="module")
def small_decoder():
    from jaxdist_lessons.models import transformer

    decoder = transformer.Decoder(
        vocab_size=32, num_layers=2, hidden=32, num_heads=2, max_len=16
    )
    tokens = transformer.random_tokens(jax.random.key(1), 2, 17, 32)
    params = decoder.init(jax.random.key(0), tokens[:1, :-1])["params"]
    return decoder, params, tokens


def test_remat_table_trades_residuals_for_flops(small_decoder):
    rows = {r[0]: r for r in residuals.remat_table(*small_decoder).values}
    assert list(rows) == list(residuals.REMAT_POLICIES)
    none, full = rows["none"], rows["full (save only block inputs)"]
    assert none[1] > 2 * full[1] and full[2] > none[2] and full[4] > none[4]


def test_precision_table_halves_stored_parameters_not_residuals(small_decoder):
    fp32, compute, stored = residuals.precision_table(*small_decoder).values
    assert [fp32[0], compute[0], stored[0]] == list(residuals.PRECISIONS)
    assert compute[1] == fp32[1] == 2 * stored[1]
    # softmax, LayerNorm statistics and logits stay f32
    assert fp32[2] / 2 < compute[2] < fp32[2]
