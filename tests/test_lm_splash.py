"""jaxdist_lm/splash.py: JAX's Pallas splash-attention kernel, run on the CPU in Pallas's
interpret mode (the kernel's own code, executed op by op: what CI can check without a TPU).

Float32 on the 8 simulated CPU devices of conftest.py, at 256 tokens: two blocks of 128
(splash_blocks' choice for 256 is one block, so the tests ask for 128), so the causal
mask skips a block pair and cuts through others. The reference is XLA's
jax.nn.dot_product_attention. Interpreted in float32, the kernel agrees with it to
rounding. Measured: at most 6e-7 in the output and 6e-6 in the gradients (values up to
about 7); 3e-5 with the inputs doubled (the mesh test's second half, gradients up to
about 30). CLOSE: 1e-5 relative and 5e-5 absolute; the absolute part is needed because
a query that starts a document sees only itself, so its d q is exactly 0 in XLA and the
kernel's rounding of it is up to 2e-5.
"""

import pathlib
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist_lm import attention as attention_lib
from jaxdist_lm import model as model_lib
from jaxdist_lm import (
    model_config,
    splash,
    train,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]

B, T, N, K, A = 2, 256, 4, 2, 64
CLOSE = {"rtol": 1e-5, "atol": 5e-5}
EOD = 0
# Each row's documents (lengths), ending in EOD; none ends on a block's edge.
DOCUMENTS = [(64, 100, 92), (200, 56)]


RECIPE_BLOCKS = splash.SPLASH_BLOCKS


@pytest.fixture(autouse=True)
def blocks_of_128(monkeypatch):
    """Two blocks of 128 at T = 256 (not splash_blocks' one), a fresh kernel cache."""
    monkeypatch.setattr(splash, "SPLASH_BLOCKS", (128,))
    splash.splash_kernel.cache_clear()
    yield
    splash.splash_kernel.cache_clear()


@pytest.fixture(scope="module")
def qkv():
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(B, T, N, A), (B, T, K, A), (B, T, K, A), (B, T, N, A)]
    return [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]


def starts(documents) -> jax.Array:
    """Document starts (attention.document_starts) of rows packed with ``documents``."""
    tokens_BT = np.ones((len(documents), T), np.int32)
    for row, lengths in enumerate(documents):
        tokens_BT[row, np.cumsum(lengths) - 1] = EOD
    return attention_lib.document_starts(jnp.asarray(tokens_BT), EOD)


def reference(q_BTNA, k_BTKA, v_BTKA, starts_BT=None):
    return jax.nn.dot_product_attention(
        q_BTNA,
        k_BTKA,
        v_BTKA,
        mask=attention_lib.document_mask(starts_BT),
        is_causal=True,
        implementation="xla",
    )


def value_and_grads(attend, q_BTNA, k_BTKA, v_BTKA, d_out_BTNA):
    """attend's output and the gradients of <output, d_out> w.r.t. q, k and v."""
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) * d_out_BTNA)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q_BTNA, k_BTKA, v_BTKA)
    return attend(q_BTNA, k_BTKA, v_BTKA), *grads


@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["one text", "documents"])
def test_splash_equals_xla_forward_and_gradients(qkv, documents):
    """4 query heads sharing 2 key/value heads, causal, and with documents packed into
    each row (segment ids from their starts) XLA's attention under the document mask:
    the output and the gradients w.r.t. q, k and v."""
    starts_BT = None if documents is None else starts(documents)
    attend = jax.jit(lambda q, k, v: splash.splash_attention(q, k, v, starts_BT))
    got = value_and_grads(attend, *qkv)
    expected = value_and_grads(lambda q, k, v: reference(q, k, v, starts_BT), *qkv)
    for name, g, e in zip(["output", "d q", "d k", "d v"], got, expected):
        np.testing.assert_allclose(g, e, **CLOSE, err_msg=name)


def kernel_shapes(jaxpr) -> list[list[tuple[int, ...]]]:
    """The operands' and results' shapes of each Pallas kernel a jaxpr calls, in
    sub-jaxprs too (not inside the kernels)."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls.append([v.aval.shape for v in (*eqn.invars, *eqn.outvars)])
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    calls += kernel_shapes(sub)
    return calls


def test_the_kernels_read_keys_and_values_at_their_own_heads(qkv):
    """Grouped heads without repeating K and V: the two kernels a gradient runs (the
    forward; the fused backward, d q, d k and d v at once) each take k and v with their
    K = 2 heads, and the backward gives their gradients so too. Repeated to N heads
    beforehand, no operand would have K heads."""
    q, k, v, d_out = qkv
    loss = lambda q, k, v: jnp.sum(splash.splash_attention(q, k, v) * d_out)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    calls = kernel_shapes(jaxpr)
    assert sorted(shapes.count((B, K, T, A)) for shapes in calls) == [2, 4]


@pytest.mark.parametrize(
    "length, block",
    [(128, 128), (384, 128), (512, 512), (768, 256), (2048, 1024), (8192, 1024)],
)
def test_blocks_are_the_largest_of_splash_blocks_that_divide_the_length(
    length, block, monkeypatch
):
    """Every block the same size, the largest of 1,024, 512, 256 and 128 that divides
    the length, and one fused backward kernel (no dq kernel of its own)."""
    monkeypatch.setattr(splash, "SPLASH_BLOCKS", RECIPE_BLOCKS)  # not the fixture's
    sizes = splash.splash_blocks(length)
    names = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv")
    assert {getattr(sizes, name) for name in names} == {block}
    assert sizes.use_fused_bwd_kernel and sizes.block_q_dq is None


def test_a_length_not_a_multiple_of_128_is_refused_with_one_line():
    message = (
        "splash attention needs a sequence length that is a multiple of 128; got 100: "
        "use --attention chunked or another --seq-len"
    )
    with pytest.raises(ValueError, match=f"^{message}$"):
        splash.splash_blocks(100)
    q_BTNA = jnp.zeros((1, 100, N, A))
    with pytest.raises(ValueError, match=f"^{message}$"):
        splash.splash_attention(q_BTNA, q_BTNA[:, :, :K], q_BTNA[:, :, :K])


def test_splash_on_a_mesh_equals_one_device(qkv):
    """Placed as the model places it (attention.placed) on data=2 x fsdp=2 x tensor=2, 4 rows
    of documents split 4 ways and the heads 2 ways (each device's kernel: 2 query heads,
    1 key/value head): the output and gradients of XLA's attention on one device."""
    mesh = train.make_mesh("data=2,fsdp=2,tensor=2")
    q, k, v, d_out = (jnp.concatenate([x, 2 * x]) for x in qkv)
    starts_BT = starts(DOCUMENTS * 2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
        placed = attention_lib.placed(splash.splash_attention)
        attend = jax.jit(lambda q, k, v: placed(q, k, v, starts_BT))
        got = value_and_grads(attend, q, k, v, d_out)
    expected = value_and_grads(
        lambda q, k, v: reference(q, k, v, starts_BT), q, k, v, d_out
    )
    for name, g, e in zip(["output", "d q", "d k", "d v"], got, expected):
        np.testing.assert_allclose(g, e, **CLOSE, err_msg=name)
    # one kernel was built, for each device's 2 query heads of the whole sequence
    built = splash.splash_kernel.cache_info()
    splash.splash_kernel(N // 2, T, True)
    assert built.currsize == 1
    assert splash.splash_kernel.cache_info().hits == built.hits + 1


def test_the_model_gives_xla_logits_with_splash_attention():
    """The tiny preset (4 layers, 4 heads sharing 2 key/value heads) on 4 x 256 tokens,
    under train.py's rules on data=4 x tensor=2 (the kernel placed by rows and heads):
    the logits of XLA's attention on one device, with the same weights."""
    config = model_config.PRESETS["tiny"]
    tokens_BT = jax.random.randint(jax.random.key(1), (4, T), 0, config.vocab_size)
    xla = model_lib.abstract(config, attention="xla")
    params = model_lib.params_of(model_lib.initialized(xla, jax.random.key(2)))
    # the model's forward pass as a function of its weights
    apply = lambda model: lambda p, t: model_lib.with_params(model, p)(t)
    expected, _ = jax.jit(apply(xla))(params, tokens_BT)
    mesh = train.make_mesh("data=4,tensor=2")
    with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
        splash = model_lib.variant(xla, attention="splash")
        logits, _ = jax.jit(apply(splash))(params, tokens_BT)
    np.testing.assert_allclose(logits, expected, **CLOSE)


def test_attention_splash_off_a_tpu_stops_with_one_line(monkeypatch):
    """On the CPU, --attention splash stops (interpreted, it is far too slow to train);
    on a TPU it is the default, for a --seq-len the kernel's blocks fit."""
    args = train.parse_args(["--mesh", "data=8", "--attention", "splash"])
    message = (
        "--attention splash needs a TPU; this machine has cpu devices: "
        "use --attention chunked or xla"
    )
    with pytest.raises(SystemExit, match=f"^{message}$"):
        train.setup(args)
    tpu = [types.SimpleNamespace(platform="tpu")]
    monkeypatch.setattr(train.jax, "devices", lambda: tpu)
    assert train.attention_kind(None) == "splash"
    assert train.attention_kind(None, 2048) == "splash"
    assert train.attention_kind(None, 100) == "chunked"
    assert train.attention_kind("xla", 2048) == "xla"
    message = (
        "--attention splash needs a --seq-len that is a multiple of 128; got 100: "
        "use --attention chunked"
    )
    with pytest.raises(SystemExit, match=f"^{message}$"):
        train.attention_kind("splash", 100)


def test_train_steps_with_splash_equal_chunked(monkeypatch):
    """train.py's step (the tiny preset, 16 rows of 128 tokens, float32, full remat in
    the scan over layers) with splash, as on a TPU: --eod-id 0 (documents of about 30
    tokens) and --grad-accum 2 (the step vmapped over the data replicas) on data=2 x
    fsdp=2 x tensor=2. Two steps' losses and gradient norms are chunked attention's."""
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(2):
        batch_BT = rng.integers(1, 2048, (16, 129), dtype=np.int32)
        batches.append(np.where(rng.random(batch_BT.shape) < 1 / 30, EOD, batch_BT))
    flags = ["--model", "tiny", "--global-batch", "16", "--seq-len", "128"]
    flags += ["--dtype", "float32", "--mesh", "data=2,fsdp=2,tensor=2"]
    flags += ["--eod-id", str(EOD), "--grad-accum", "2"]
    runs = {}
    for kind in ("chunked", "splash"):
        monkeypatch.setattr(train, "attention_kind", lambda *_, kind=kind: kind)
        mesh, _, _, step, shapes, init = train.setup(train.parse_args(flags))
        sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(train.BATCH)
        )
        with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
            state_shardings = jax.tree.map(lambda s: s.sharding, shapes)
            state = jax.jit(init, out_shardings=state_shardings)(jax.random.key(0))
            runs[kind] = []
            for batch_BT in batches:
                state, metrics = step(state, jax.device_put(batch_BT, sharding))
                runs[kind].append([float(metrics["loss"]), float(metrics["grad_norm"])])
    np.testing.assert_allclose(runs["splash"], runs["chunked"], rtol=1e-5)
