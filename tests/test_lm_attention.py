"""jaxdist_lm/attention.py's attentions: chunked blocks, ring attention on them, cuDNN's placement.

Float32 on the 8 simulated CPU devices of conftest.py. The reference is XLA's
jax.nn.dot_product_attention (the T x S scores, softmax, a matmul). cuDNN's kernel needs an
NVIDIA GPU: here, the flag's error and the shard_map that places the kernel (with XLA's
attention standing in for it).
"""

import dataclasses
import functools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lm import attention as attention_lib
from jaxdist_lm import (
    layout,
    model_config,
    train,
)
from jaxdist_lm import loss as loss_lib
from jaxdist_lm import model as model_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]

B, T, N, K, A = 2, 64, 4, 2, 16
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def apply(model):
    """The model's forward pass as a function of its weights: (params, tokens, ...)."""
    return lambda params, *inputs: model_lib.with_params(model, params)(*inputs)


def init(model, rng) -> dict:
    """The model's weights, drawn from ``rng`` (compiled)."""
    draw = lambda rng: model_lib.params_of(model_lib.initialized(model, rng))
    return jax.jit(draw)(rng)


def reference(q_BTNA, k_BTKA, v_BTKA):
    return jax.nn.dot_product_attention(
        q_BTNA, k_BTKA, v_BTKA, is_causal=True, implementation="xla"
    )


@pytest.fixture(scope="module")
def qkv():
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(B, T, N, A), (B, T, K, A), (B, T, K, A), (B, T, N, A)]
    return [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]


def value_and_grads(attend, q_BTNA, k_BTKA, v_BTKA, d_out_BTNA):
    """attend's output and the gradients of <output, d_out> w.r.t. q, k and v."""
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) * d_out_BTNA)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q_BTNA, k_BTKA, v_BTKA)
    return attend(q_BTNA, k_BTKA, v_BTKA), *grads


@pytest.mark.parametrize("block", [8, 16, 24, 64, 512])
@pytest.mark.parametrize("order", ["in order", "zigzag"])
def test_chunked_equals_xla_forward_and_gradients(qkv, block, order):
    """Blocks of 8 to the whole sequence (512 > T: one block; 24, which does not divide
    T, gives blocks of 16), positions in order or in ring attention's zigzag (the tokens
    permuted, the mask by positions): the output and the gradients of XLA's attention on
    the tokens in order, permuted the same way."""
    positions_T = np.arange(T) if order == "in order" else layout.zigzag(T, 4)
    q, k, v, d_out = (x[:, positions_T] for x in qkv)
    chunked = jax.jit(
        lambda q, k, v: attention_lib.chunked_attention(
            q, k, v, positions_T, positions_T, block
        )
    )
    got = value_and_grads(chunked, q, k, v, d_out)
    expected = value_and_grads(reference, *qkv)
    for name, g, e in zip(["output", "d q", "d k", "d v"], got, expected):
        np.testing.assert_allclose(g, e[:, positions_T], **CLOSE, err_msg=name)


@pytest.mark.parametrize(
    "length, block, size",
    [(64, 24, 16), (768, 512, 384), (1024, 512, 512), (100, 512, 100), (509, 512, 509)],
)
def test_blocks_are_the_largest_that_divide_the_length(length, block, size):
    """A length the block does not divide (--seq-len 768) gets smaller blocks, not an
    error; a length no larger than the block is one block."""
    assert attention_lib.block_size(length, block) == size


def temporaries(attend, length: int) -> int:
    """Bytes of temporaries of attention's forward and backward at one sequence length
    (1 row, N heads of A), compiled, not run: two layers of it in a scan, each
    rematerialised, as the model's layers are (the queries go from layer to layer; the
    keys, values and positions are the same for both)."""
    q = jax.ShapeDtypeStruct((1, length, N, A), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, K, A), jnp.float32)
    layer = jax.checkpoint(attend, policy=jax.checkpoint_policies.nothing_saveable)

    def loss(q, k, v):
        out, _ = jax.lax.scan(lambda x, _: (layer(x, k, v), None), q, length=2)
        return jnp.sum(out)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_memory_is_linear_in_the_sequence_forward_and_backward():
    """Doubling T less than doubles chunked attention's temporaries (blocks of 128: the
    gradient keeps the output and log-sum-exp, not the scores, and remat in a scan keeps
    no block's mask), where XLA's T x T float32 scores quadruple. Measured: chunked
    3,406,952 -> 5,545,064 B; XLA 73,007,360 -> 290,717,952 B (T = 1024 -> 2048). Without
    the optimization barrier in attention_part_forward, chunked's were 53 -> 195 MB."""

    def chunked(q, k, v):
        positions_T = jnp.arange(q.shape[1])
        return attention_lib.chunked_attention(q, k, v, positions_T, positions_T, 128)

    chunked_bytes = [temporaries(chunked, t) for t in (1024, 2048)]
    xla_bytes = [temporaries(reference, t) for t in (1024, 2048)]
    print(f"temporaries: chunked {chunked_bytes}, xla {xla_bytes}")
    assert chunked_bytes[1] <= 2.3 * chunked_bytes[0]
    assert xla_bytes[1] >= 3.5 * xla_bytes[0]  # the measure tells the two apart
    assert chunked_bytes[1] < xla_bytes[1] / 20  # 1 x N x T x T x 4 B = 67 MB at 2048


def test_ring_attention_on_chunked_blocks_equals_one_device(qkv):
    """Ring attention over a 'sequence' axis of 4 devices (each holds T/4 = 16 tokens of
    the zigzag, in blocks of 8; keys and values go round the ring): the output and the
    gradients of one device's attention on the whole sequence."""
    mesh = jax.make_mesh(
        (4,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4]
    )
    positions_T = layout.zigzag(T, 4)
    split = P(None, "sequence")
    ring = jax.shard_map(
        functools.partial(attention_lib.ring_attention, block=8),
        mesh=mesh,
        in_specs=(split, split, split, P()),
        out_specs=split,
    )
    attend = jax.jit(lambda q, k, v: ring(q, k, v, positions_T))
    got = value_and_grads(attend, *(x[:, positions_T] for x in qkv))
    expected = value_and_grads(reference, *qkv)
    for name, g, e in zip(["output", "d q", "d k", "d v"], got, expected):
        np.testing.assert_allclose(g, e[:, positions_T], **CLOSE, err_msg=name)
    jaxpr = str(jax.make_jaxpr(attend)(*qkv[:3]))
    # n - 1 = 3 steps pass the keys and the values on (one ppermute each, a device's
    # T/4 tokens), and no step gathers the sequence.
    sent = re.findall(r"f32\[([\d,]+)\]\S* = ppermute\[", jaxpr)
    assert sent == [f"{B},{T // 4},{K},{A}"] * 6
    assert "all_gather" not in jaxpr


def test_the_model_gives_xla_logits_with_chunked_attention():
    """The tiny preset (4 layers, 4 heads sharing 2 key/value heads) on 2 x 128 tokens,
    under train.py's rules on data=4 x tensor=2 (chunked attention placed by rows and
    heads): the logits of XLA's attention, with the same weights."""
    config = model_config.PRESETS["tiny"]
    tokens_BT = jax.random.randint(jax.random.key(1), (4, 128), 0, config.vocab_size)
    xla = model_lib.abstract(config, attention="xla")
    params = init(xla, jax.random.key(2))
    mesh = train.make_mesh("data=4,tensor=2")
    logits = {}
    for kind in ("xla", "chunked"):
        with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
            # traced once: its jaxpr read, then compiled and run
            model = model_lib.variant(xla, attention=kind)
            traced = jax.jit(apply(model)).trace(params, tokens_BT)
            jaxpr = str(traced.jaxpr)
            logits[kind], _ = traced.lower().compile()(params, tokens_BT)
        assert ("shard_map" in jaxpr) == (kind == "chunked")
    np.testing.assert_allclose(logits["chunked"], logits["xla"], **CLOSE)


def test_attention_cudnn_on_a_cpu_stops_with_one_line():
    args = train.parse_args(["--mesh", "data=8", "--attention", "cudnn"])
    message = (
        "--attention cudnn needs an NVIDIA GPU; this machine has cpu devices: "
        "use --attention chunked or xla"
    )
    with pytest.raises(SystemExit, match=f"^{message}$"):
        train.setup(args)
    assert train.attention_kind(None) == "chunked"  # the default on a CPU
    assert train.attention_kind("xla") == "xla"


def test_the_placement_splits_rows_and_heads_and_keeps_the_result(qkv):
    """placed() runs the kernel on each device's batch rows and heads: on data=2 x fsdp=2
    x tensor=2, 4 rows split 4 ways and the 4 query heads (2 key/value heads) 2 ways.
    XLA's attention, standing in for cuDNN's, sees one row, 2 query heads and their key
    value head, the whole sequence, and gives the unplaced result."""
    q_BTNA, k_BTKA, v_BTKA, _ = qkv
    mesh = train.make_mesh("data=2,fsdp=2,tensor=2")  # rows over data x fsdp = 4
    q_BTNA, k_BTKA, v_BTKA = (
        jnp.concatenate([x, 2 * x]) for x in (q_BTNA, k_BTKA, v_BTKA)
    )
    seen = []

    def stand_in(q_BTNA, k_BTKA, v_BTKA):
        seen.append((q_BTNA.shape, k_BTKA.shape))
        return reference(q_BTNA, k_BTKA, v_BTKA)

    with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
        placed = jax.jit(attention_lib.placed(stand_in))(q_BTNA, k_BTKA, v_BTKA)
    unplaced = reference(q_BTNA, k_BTKA, v_BTKA)
    np.testing.assert_allclose(placed, unplaced, **CLOSE)
    assert seen == [((1, T, N // 2, A), (1, T, K // 2, A))]  # 4 rows / 4, heads / 2
    # and the output stays split so: one row, 2 heads a device
    assert {shard.data.shape for shard in placed.addressable_shards} == {(1, T, 2, A)}


def test_document_starts_restart_after_each_end_of_document():
    tokens_BT = jnp.array([[5, 0, 3, 4, 0, 0, 7], [1, 2, 3, 4, 5, 6, 0]])
    starts_BT = attention_lib.document_starts(tokens_BT, eod_id=0)
    np.testing.assert_array_equal(
        starts_BT, [[0, 0, 2, 2, 2, 5, 6], [0, 0, 0, 0, 0, 0, 0]]
    )


EOD = 0  # <|endoftext|>, as in data.py's corpus
LENGTHS = (16, 32, 16)  # three documents packed into one row of 64, each ending in EOD


@pytest.fixture(scope="module")
def packed():
    """The tiny preset (depth 2), its weights, and 4 rows of 64 tokens, each three
    documents that end in EOD (no other EOD in them)."""
    config = dataclasses.replace(model_config.PRESETS["tiny"], num_layers=2)
    tokens_BT = jax.random.randint(jax.random.key(3), (4, 64), 1, config.vocab_size)
    tokens_BT = tokens_BT.at[:, np.cumsum(LENGTHS) - 1].set(EOD)
    model = model_lib.abstract(config, remat="none", attention="xla")
    params = init(model, jax.random.key(4))
    return model, params, tokens_BT


def alone(model, params, tokens_BT) -> jax.Array:
    """Each document run on its own (positions from 0, nothing else to attend to), the
    logits put back side by side. Compiled (two programs, for 16 and 32 tokens): op by
    op, the three runs took seconds."""
    cuts = np.cumsum((0, *LENGTHS))
    run = jax.jit(apply(model))
    return jnp.concatenate(
        [run(params, tokens_BT[:, a:b])[0] for a, b in zip(cuts[:-1], cuts[1:])],
        axis=1,
    )


@pytest.mark.parametrize("kind", ["xla", "chunked"])
def test_a_packed_row_gives_each_documents_logits_alone(packed, kind, monkeypatch):
    """With document starts, the logits of a row packed with three documents equal
    those of each document run alone; without them, the later documents differ (they
    attend to the earlier ones). Chunked in blocks of 16: a document's blocks skip the
    others' blocks."""
    model, params, tokens_BT = packed
    monkeypatch.setattr(model_lib, "BLOCK", 16)
    model = model_lib.variant(model, attention=kind)
    starts_BT = attention_lib.document_starts(tokens_BT, EOD)
    masked, _ = jax.jit(apply(model))(params, tokens_BT, None, starts_BT)
    expected = alone(model, params, tokens_BT)
    np.testing.assert_allclose(masked, expected, **CLOSE)
    unmasked, _ = jax.jit(apply(model))(params, tokens_BT)
    np.testing.assert_allclose(unmasked[:, :16], expected[:, :16], **CLOSE)
    assert np.abs(unmasked[:, 16:] - expected[:, 16:]).min(axis=-1).max() > 1e-3


def test_document_masking_gradients_agree_across_xla_chunked_and_the_ring(
    packed, monkeypatch
):
    """The loss and the weights' gradients of the packed rows with document masking:
    XLA's attention on one device, chunked (blocks of 16) on data=4 x tensor=2, and
    ring attention on data=2 x sequence=4 (the zigzag order, the starts moved with the
    tokens, whole along the sequence on each device), all equal."""
    model, params, tokens_BT = packed
    monkeypatch.setattr(model_lib, "BLOCK", 16)
    targets_BT = jnp.roll(tokens_BT, -1, axis=1)  # the last target: the row's first

    def loss_and_grads(model, order):
        def loss(params):
            starts_BT = attention_lib.document_starts(tokens_BT, EOD)
            logits_BTV, _ = apply(model)(
                params, tokens_BT[:, order], order, starts_BT[:, order]
            )
            return loss_lib.cross_entropy(logits_BTV, targets_BT[:, order])

        return jax.jit(jax.value_and_grad(loss))(params)

    expected = loss_and_grads(model, np.arange(64))
    vary = functools.partial(model_lib.variant, model)
    runs = {
        "chunked": ("data=4,tensor=2", vary(attention="chunked"), 1),
        "ring": ("data=2,sequence=4", vary(context_parallel=True), 4),
    }
    for name, (spec, variant, ring) in runs.items():
        order = layout.zigzag(64, ring) if ring > 1 else np.arange(64)
        with jax.set_mesh(train.make_mesh(spec)), nn.logical_axis_rules(train.RULES):
            loss, grads = loss_and_grads(variant, order)
        np.testing.assert_allclose(loss, expected[0], **CLOSE, err_msg=name)
        for (path, g), e in zip(
            jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected[1])
        ):
            where = f"{name} {jax.tree_util.keystr(path)}"
            np.testing.assert_allclose(g, e, **CLOSE, err_msg=where)
