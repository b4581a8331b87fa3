import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, sharding, zero
from jaxdist_lessons.mesh import make_mesh
from jaxdist_lessons.models.transformer import Block

N = jax.device_count()
MESH = make_mesh((N,), ("data",))


def mlp_case():
    """A 2-layer MLP; its output bias (10 classes) cannot be split over 4 or 8 devices."""
    key = jax.random.key(0)
    params = {
        "hidden": {"kernel": 0.1 * jax.random.normal(key, (16, 64)), "bias": jnp.zeros(64)},
        "out": {"kernel": 0.1 * jax.random.normal(key, (64, 10)), "bias": jnp.zeros(10)},
    }

    def loss_fn(p, batch):
        x, y = batch
        logits = (
            jax.nn.relu(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
            @ p["out"]["kernel"]
            + p["out"]["bias"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    batch = (
        jax.random.normal(jax.random.key(1), (4 * N, 16)),
        jax.random.randint(jax.random.key(2), (4 * N,), 0, 10),
    )
    return loss_fn, params, batch


def block_case():
    """One Transformer block, trained to shrink its output."""
    block = Block(num_heads=4)
    x = jax.random.normal(jax.random.key(1), (2 * N, 8, 32))
    params = jax.jit(block.init)(jax.random.key(0), x[:1])["params"]
    return (lambda p, batch: jnp.mean(block.apply({"params": p}, batch) ** 2)), params, x


CASES = {"MLP": mlp_case, "Transformer block": block_case}


def compiled_collectives(strategy, loss_fn, params, batch, tx):
    step = zero.make_step(
        strategy, loss_fn, tx, MESH, params, jax.eval_shape(tx.init, params)
    )
    placed = zero.place(strategy, params, tx.init(params), MESH)
    text = comms.compiled_text(
        step, *placed, jax.device_put(batch, NamedSharding(MESH, P("data")))
    )
    return {kind: row["bytes"] for kind, row in comms.summary(text).items()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", zero.STRATEGIES)
def test_measured_collective_bytes_equal_theory(case, strategy):
    loss_fn, params, batch = CASES[case]()
    measured = compiled_collectives(strategy, loss_fn, params, batch, optax.adam(1e-3))
    assert measured == zero.expected_collectives(strategy, params, N)


@pytest.mark.parametrize("case", CASES)
def test_the_three_strategies_train_identically(case):
    loss_fn, params, batch = CASES[case]()
    tx = optax.sgd(
        0.1, momentum=0.9
    )  # Adam would magnify rounding noise in gradients that are exactly zero
    batch = jax.device_put(batch, NamedSharding(MESH, P("data")))
    finals = {}
    for strategy in zero.STRATEGIES:
        step = zero.make_step(
            strategy, loss_fn, tx, MESH, params, jax.eval_shape(tx.init, params)
        )
        p, o = zero.place(strategy, params, tx.init(params), MESH)
        for _ in range(3):
            p, o, loss = step(p, o, batch)
        finals[strategy] = (jax.device_get(p), float(loss))
    for strategy in ("zero1", "fsdp"):
        assert finals[strategy][1] == pytest.approx(finals["data"][1], rel=1e-6)
        for a, b in zip(
            jax.tree.leaves(finals[strategy][0]), jax.tree.leaves(finals["data"][0])
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fsdp_state_per_device_is_total_over_n_plus_the_named_remainder():
    _, params, _ = mlp_case()
    tx = optax.adam(1e-3)
    p, o = zero.place("fsdp", params, tx.init(params), MESH)
    held = sharding.bytes_per_device((p, o))
    total = comms.tree_bytes((p, o))
    parts = zero.split((params, tx.init(params)), N)
    # On 1 or 2 devices every array of this MLP splits but Adam's scalar step counter; on 4 or 8 the
    # 10 output biases and their two Adam slots stay whole too.
    remainder = ["1/0/count"] + (
        ["0/out/bias", "1/0/mu/out/bias", "1/0/nu/out/bias"] if 10 % N else []
    )
    assert sorted(parts.replicated_leaves) == sorted(remainder)
    assert parts.replicated == 4 + (3 * 10 * 4 if 10 % N else 0)
    assert set(held.values()) == {(total - parts.replicated) // N + parts.replicated}
    assert held[0] == zero.expected_state_bytes("fsdp", params, tx.init(params), N)


def test_zero1_shards_only_the_optimizer_state():
    _, params, _ = mlp_case()
    tx = optax.adam(1e-3)
    p, o = zero.place("zero1", params, tx.init(params), MESH)
    assert set(sharding.bytes_per_device(p).values()) == {comms.tree_bytes(params)}
    opt = zero.split(tx.init(params), N)
    assert set(sharding.bytes_per_device(o).values()) == {opt.sharded // N + opt.replicated}


def test_the_rule():
    assert zero.shard_dim((64, 16), 8) == 0 and zero.shard_dim((16, 64), 8) == 1
    assert zero.shard_dim((10,), 8) is None and zero.shard_dim((), 8) is None
    assert zero.shard_dim((3, 8, 8), 4) == 1  # a tie goes to the first
    assert zero.fsdp_spec((16, 64), MESH) == P(None, "data")
    assert zero.fsdp_spec((2 * N + 1,), MESH) == P()


def ring_bytes_of_program(text):
    """Bytes each device sends for the collectives of a compiled program, each priced by a ring algorithm."""
    sent = 0.0
    for c in comms.collectives(text):
        group = c.group_size or N
        if c.kind == "all-reduce":
            sent += comms.ring_all_reduce_bytes(c.bytes, group)
        elif c.kind == "all-gather":
            sent += comms.ring_all_gather_bytes(c.bytes, group)
        elif (
            c.kind == "reduce-scatter"
        ):  # comms counts the result, 1/group of what is reduced
            sent += comms.ring_reduce_scatter_bytes(c.bytes * group, group)
        else:
            raise AssertionError(f"unexpected collective {c.kind}")
    return sent


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", zero.STRATEGIES)
def test_ring_bytes_sent_are_those_of_the_compiled_collectives(case, strategy):
    loss_fn, params, batch = CASES[case]()
    tx = optax.adam(1e-3)
    step = zero.make_step(
        strategy, loss_fn, tx, MESH, params, jax.eval_shape(tx.init, params)
    )
    text = comms.compiled_text(
        step,
        *zero.place(strategy, params, tx.init(params), MESH),
        jax.device_put(batch, NamedSharding(MESH, P("data"))),
    )
    # The step's mean loss, which the formula leaves out.
    loss = comms.ring_all_reduce_bytes(4, N)
    assert ring_bytes_of_program(text) - loss == pytest.approx(
        zero.ring_bytes_sent(strategy, params, N)
    )


def test_regathering_fsdp_sends_half_as_much_again_as_data_parallelism():
    _, params, _ = block_case()  # every array splits on 2, 4 and 8 devices: no remainder
    assert zero.split(params, N).replicated == 0
    data = zero.ring_bytes_sent("data", params, N)
    assert zero.regathering_fsdp_ring_bytes(params, N) == pytest.approx(1.5 * data)
    # The remainder is all-reduced, as in data parallelism: a little under 1.5.
    if N > 1:
        _, mlp_params, _ = mlp_case()
        ratio = zero.regathering_fsdp_ring_bytes(mlp_params, N) / zero.ring_bytes_sent(
            "data", mlp_params, N
        )
        assert 1.4 < ratio <= 1.5


def test_unknown_strategy():
    with pytest.raises(
        ValueError, match="unknown strategy 'zero2'; allowed: data, zero1, fsdp"
    ):
        zero.param_specs("zero2", {}, MESH)
