"""sequence: three context-parallel attentions equal one device's causal attention, in outputs and
gradients, at 4, 6 and 8 devices; their compiled collectives are the formula's bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxdist_lessons import comms, sequence

# 48 tokens split into 2n chunks for n = 4, 6, 8; 24 heads for Ulysses
B, T, N, A = (
    1,
    48,
    24,
    4,
)


def mesh_of(n):
    return jax.make_mesh(
        (n,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n]
    )


def inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(k, (B, T, N, A), jnp.float32) for k in keys)


def out_and_grads(attention):
    """The output and the gradients of a weighted sum of it, in one jitted program."""
    weights = jnp.cos(jnp.arange(T, dtype=jnp.float32))[None, :, None, None]

    def run(q, k, v):
        out, pull = jax.vjp(attention, q, k, v)
        return out, pull(jnp.broadcast_to(weights, out.shape))

    return jax.jit(run)(*inputs())


REFERENCE = None


def reference():
    global REFERENCE
    if REFERENCE is None:
        REFERENCE = out_and_grads(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
        )
    return REFERENCE


@pytest.mark.parametrize("n", [4, 6, 8])
@pytest.mark.parametrize("kind", list(sequence.ATTENTIONS))
def test_each_attention_equals_one_device_in_outputs_and_gradients(kind, n):
    order = sequence.zigzag(T, n)
    back = np.argsort(order)
    sharded = sequence.over_sequence(sequence.ATTENTIONS[kind], mesh_of(n))
    got = out_and_grads(
        lambda q, k, v: sharded(q[:, order], k[:, order], v[:, order])[:, back]
    )
    want = reference()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", list(sequence.ATTENTIONS))
def test_compiled_bytes_are_the_formula(kind):
    n = 4
    q = jax.ShapeDtypeStruct((B, T, N, A), jnp.float32)
    text = comms.compiled_text(
        sequence.over_sequence(sequence.ATTENTIONS[kind], mesh_of(n)), q, q, q
    )
    predicted = sequence.predicted_bytes(kind, B, T, N, A, n)
    sent = predicted.pop("sent")
    assert comms.bytes_by_kind(text) == predicted
    # chunk bytes: K and V of one device's 12 tokens, 24 heads of 4, float32 = 9,216
    assert (
        sent
        == {"ring": 3 * 9216, "all-gather KV": 3 * 9216, "Ulysses": 4 * 3 / 4 * 4608}[
            kind
        ]
    )


def test_zigzag_puts_chunks_i_and_2n_minus_1_minus_i_on_device_i():
    assert sequence.zigzag(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="must divide into 2 x 4 chunks"):
        sequence.zigzag(12, 4)


def test_causal_work_is_balanced_by_zigzag_only():
    assert sequence.causal_work(4, "contiguous") == [0.5, 1.5, 2.5, 3.5]
    assert sequence.causal_work(4, "zigzag") == [2.0, 2.0, 2.0, 2.0]
    assert sum(sequence.causal_work(6, "zigzag")) == sum(
        sequence.causal_work(6, "contiguous")
    )
    with pytest.raises(ValueError, match="unknown layout 'striped'"):
        sequence.causal_work(4, "striped")


def test_megatron_sequence_parallel_sends_what_tensor_parallel_sends():
    got = sequence.megatron_bytes(batch=2, seq_len=64, width=32, tensor=4)
    assert got["tensor"] == {"all-reduce": 16384, "sent": 24576}
    assert got["tensor + sequence"] == {
        "all-gather": 16384,
        "reduce-scatter": 4096,
        "sent": 24576,
    }


def test_predicted_bytes_rejects_an_unknown_attention():
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        sequence.predicted_bytes("flash", B, T, N, A, 4)
