import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist_lessons import comms, memory, residuals
from jaxdist_lessons.models import transformer as T

CONFIG = {
    "vocab_size": 64,
    "num_layers": 2,
    "hidden": 32,
    "num_heads": 4,
    "max_len": 16,
}


def init(model, tokens):
    return jax.jit(model.init)(jax.random.key(0), tokens)["params"]


def test_parameter_count_matches_chapter_1_formula():
    model = T.Decoder(**CONFIG)
    params = init(model, jnp.zeros((1, 16), jnp.int32))
    count = sum(x.size for x in jax.tree.leaves(params))
    assert count == memory.transformer_params(
        num_layers=2, hidden=32, vocab_size=64, seq_len=16
    )
    assert comms.tree_bytes(params) == 4 * count


def test_logits_shape_and_causality():
    model = T.Decoder(**CONFIG)
    tokens = T.random_tokens(jax.random.key(1), 2, 8, 64)
    params = init(model, tokens)
    apply = jax.jit(model.apply)
    logits = apply({"params": params}, tokens)
    assert logits.shape == (2, 8, 64) and logits.dtype == jnp.float32
    changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % 64)
    other = apply({"params": params}, changed)
    # the past cannot see the future
    np.testing.assert_array_equal(np.asarray(logits[:, :5]), np.asarray(other[:, :5]))
    assert not np.allclose(logits[:, 5:], other[:, 5:])


@pytest.mark.parametrize("policy", ["full", jax.checkpoint_policies.dots_saveable])
def test_remat_changes_nothing_but_memory(policy):
    tokens = T.random_tokens(jax.random.key(1), 2, 9, 64)
    config = {**CONFIG, "num_layers": 1}
    plain, remat = T.Decoder(**config), T.Decoder(**config, remat_policy=policy)
    params = init(plain, tokens[:, :-1])
    grad = lambda model: jax.jit(
        jax.value_and_grad(lambda p: T.next_token_loss(model, p, tokens))
    )(params)
    (loss_a, grads_a), (loss_b, grads_b) = grad(plain), grad(remat)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # ...but memory: the backward pass gets fewer saved activations to read.
    saved = lambda model: residuals.residual_bytes(
        lambda p: T.next_token_loss(model, p, tokens), params
    )
    assert 0 < saved(remat) < saved(plain)


def test_bf16_compute_keeps_fp32_parameters():
    tokens = T.random_tokens(jax.random.key(1), 2, 8, 64)
    model = T.Decoder(**CONFIG, dtype=jnp.bfloat16)
    params = init(model, tokens)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert jax.jit(model.apply)({"params": params}, tokens).dtype == jnp.float32
    stored = T.Decoder(**CONFIG, param_dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(init(stored, tokens))} == {
        jnp.dtype(jnp.bfloat16)
    }


def test_random_tokens_range():
    tokens = T.random_tokens(jax.random.key(0), 3, 5, 7)
    assert tokens.shape == (3, 5) and tokens.dtype == jnp.int32
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 7


def test_bad_shapes_are_explained():
    with pytest.raises(ValueError, match="not divisible by num_heads=5"):
        init(T.Decoder(**{**CONFIG, "num_heads": 5}), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="longer than max_len=16"):
        init(T.Decoder(**CONFIG), jnp.zeros((1, 17), jnp.int32))
