import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist_lessons.models.attention import attend, head_dim


def qkv(batch=2, length=5, heads=3, head_dim=4, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (batch, length, heads, head_dim)) for k in keys]


@pytest.mark.parametrize("causal", [False, True])
def test_attend_matches_flax_dot_product_attention(causal):
    q, k, v = qkv()
    mask = nn.make_causal_mask(jnp.ones(q.shape[:2])) if causal else None
    expected = nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(
        attend(q, k, v, causal=causal, dtype=jnp.float32),
        expected,
        rtol=1e-5,
        atol=1e-6,
    )


def test_causal_attention_does_not_look_ahead():
    q, k, v = qkv()
    # the future of positions 0, 1, 2
    changed_k, changed_v = (
        k.at[:, 3:].set(9.0),
        v.at[:, 3:].set(-9.0),
    )
    before = attend(q, k, v, causal=True, dtype=jnp.float32)
    after = attend(q, changed_k, changed_v, causal=True, dtype=jnp.float32)
    np.testing.assert_array_equal(before[:, :3], after[:, :3])
    assert not np.allclose(before[:, 3:], after[:, 3:])
    # Position 0 sees only itself: its output is its own value.
    np.testing.assert_allclose(before[:, 0], v[:, 0], rtol=1e-6)


def test_bf16_attention_keeps_the_softmax_in_float32():
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv())
    text = (
        jax.jit(lambda q, k, v: attend(q, k, v, causal=True, dtype=jnp.bfloat16))
        .lower(q, k, v)
        .as_text()
    )
    assert attend(q, k, v, causal=True, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    lines = text.splitlines()
    [exponential] = [line for line in lines if "stablehlo.exponential" in line]
    assert exponential.endswith("tensor<2x3x5x5xf32>")  # the softmax is float32...
    dots = [line for line in lines if "stablehlo.dot_general" in line]
    # ...the einsums bf16
    assert len(dots) == 2 and all("tensor<2x5x3x4xbf16>" in line for line in dots)


def test_head_dim_splits_the_hidden_size_or_says_why_not():
    assert head_dim(768, 12) == 64
    with pytest.raises(
        ValueError, match=r"hidden size 100 is not divisible by num_heads=12"
    ):
        head_dim(100, 12)
