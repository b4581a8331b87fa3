import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import benchmark, comms, compiled, sharding, zero
from jaxdist_lessons.models.transformer import Block

N = jax.device_count()
MESH = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
AUTO_MESH = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))  # jit's FSDP


def mlp_case():
    """A 2-layer MLP; its output bias (10 classes) cannot be split over 4 or 8 devices."""
    key = jax.random.key(0)
    params = {
        "hidden": {
            "kernel": 0.1 * jax.random.normal(key, (16, 64)),
            "bias": jnp.zeros(64),
        },
        "out": {
            "kernel": 0.1 * jax.random.normal(key, (64, 10)),
            "bias": jnp.zeros(10),
        },
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
    return (
        (lambda p, batch: jnp.mean(block.apply({"params": p}, batch) ** 2)),
        params,
        x,
    )


CASES = {"MLP": mlp_case, "Transformer block": block_case}


def place(strategy, params, opt_state, mesh, axis="data"):
    """The state as ``strategy`` keeps it (``zero.state_specs``)."""
    specs = zero.state_specs(strategy, params, opt_state, mesh, axis)
    return zero.copy_to((params, opt_state), specs, mesh)


def compiled_collectives(strategy, loss_fn, params, batch, tx):
    step = zero.make_step(
        strategy, loss_fn, tx, MESH, params, jax.eval_shape(tx.init, params)
    )
    placed = place(strategy, params, tx.init(params), MESH)
    text = comms.compiled_text(
        step, *placed, jax.device_put(batch, NamedSharding(MESH, P("data")))
    )
    return {kind: row["bytes"] for kind, row in comms.summary(text).items()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", zero.ZERO_STAGES)
def test_measured_collective_bytes_equal_theory(case, strategy):
    loss_fn, params, batch = CASES[case]()
    measured = compiled_collectives(strategy, loss_fn, params, batch, optax.adam(1e-3))
    assert measured == zero.expected_collectives(strategy, params, N)


@pytest.mark.parametrize("case", CASES)
def test_the_three_strategies_train_identically(case):
    loss_fn, params, batch = CASES[case]()
    # Adam would magnify rounding noise in gradients that are exactly zero
    tx = optax.sgd(0.1, momentum=0.9)
    batch = jax.device_put(batch, NamedSharding(MESH, P("data")))
    finals = {}
    for strategy in zero.ZERO_STAGES:
        step = zero.make_step(
            strategy, loss_fn, tx, MESH, params, jax.eval_shape(tx.init, params)
        )
        p, o = place(strategy, params, tx.init(params), MESH)
        for _ in range(3):
            p, o, loss = step(p, o, batch)
        finals[strategy] = (jax.device_get(p), float(loss))
    for strategy in ("zero1", "fsdp"):
        assert finals[strategy][1] == pytest.approx(finals["data"][1], rel=1e-6)
        for a, b in zip(
            jax.tree.leaves(finals[strategy][0]), jax.tree.leaves(finals["data"][0])
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def jit_fsdp_step(loss_fn, tx, params, mesh):
    """Chapter 06_performance's FSDP: the one-device step under ``jax.jit``, the state sharded by ``fsdp_spec``."""

    def shardings(tree):
        return jax.tree.map(
            lambda x: NamedSharding(mesh, zero.fsdp_spec(x.shape, mesh)), tree
        )

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = (shardings(params), shardings(jax.eval_shape(tx.init, params)))
    step = jax.jit(
        train_step,
        in_shardings=(*state, NamedSharding(mesh, P("data"))),
        out_shardings=(*state, NamedSharding(mesh, P())),
    )
    init = jax.jit(lambda p: (p, tx.init(p)), out_shardings=state)
    return step, init(params)


@pytest.mark.parametrize("case", CASES)
def test_fsdp_by_jit_with_the_rule_trains_as_the_shard_map_step(case):
    loss_fn, params, batch = CASES[case]()
    tx = optax.sgd(0.1, momentum=0.9)
    step, (p, o) = jit_fsdp_step(loss_fn, tx, params, AUTO_MESH)
    mapped = zero.make_step("fsdp", loss_fn, tx, MESH, params, tx.init(params))
    q, r = place("fsdp", params, tx.init(params), MESH)
    for _ in range(3):
        p, o, loss = step(
            p, o, jax.device_put(batch, NamedSharding(AUTO_MESH, P("data")))
        )
        q, r, mapped_loss = mapped(
            q, r, jax.device_put(batch, NamedSharding(MESH, P("data")))
        )
    assert float(loss) == pytest.approx(float(mapped_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        assert a.sharding.shard_shape(a.shape) == b.sharding.shard_shape(b.shape)
        np.testing.assert_allclose(jax.device_get(a), jax.device_get(b), atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu" or N == 1, reason="XLA:CPU's choice")
def test_fsdp_by_jit_gathers_the_sharded_bytes_and_all_reduces_every_gradient():
    """On chapter 06_performance's MLP, XLA:CPU gathers each sharded parameter once and all-reduces the whole gradient.

    (On tiny arrays it may move activations instead: the compiler chooses.) If a new jaxlib
    turns the all-reduce into a reduce-scatter, update chapter 06_performance's prose (section "FSDP: jit
    with a sharding rule") and this test to ``expected_collectives``.
    """
    work = benchmark.mlp_workload(N, width=32 * N)
    loss_fn, params, batch = work.loss_fn, work.params, work.batch
    tx = optax.adam(1e-3)
    step, state = jit_fsdp_step(loss_fn, tx, params, AUTO_MESH)
    batch = jax.device_put(batch, NamedSharding(AUTO_MESH, P("data")))
    found = comms.bytes_by_kind(comms.compiled_text(step, *state, batch))
    parts = zero.split(params, N)
    assert found == {
        "all-gather": parts.sharded,
        "all-reduce": comms.tree_bytes(params) + 4,
    }


def test_fsdp_state_per_device_is_total_over_n_plus_the_named_remainder():
    _, params, _ = mlp_case()
    tx = optax.adam(1e-3)
    p, o = place("fsdp", params, tx.init(params), MESH)
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
    p, o = place("zero1", params, tx.init(params), MESH)
    assert set(sharding.bytes_per_device(p).values()) == {comms.tree_bytes(params)}
    opt = zero.split(tx.init(params), N)
    assert set(sharding.bytes_per_device(o).values()) == {
        opt.sharded // N + opt.replicated
    }


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
        # comms counts the result, 1/group of what is reduced
        elif c.kind == "reduce-scatter":
            sent += comms.ring_reduce_scatter_bytes(c.bytes * group, group)
        else:
            raise AssertionError(f"unexpected collective {c.kind}")
    return sent


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", zero.ZERO_STAGES)
def test_ring_bytes_sent_are_those_of_the_compiled_collectives(case, strategy):
    loss_fn, params, batch = CASES[case]()
    tx = optax.adam(1e-3)
    step = zero.make_step(
        strategy, loss_fn, tx, MESH, params, jax.eval_shape(tx.init, params)
    )
    text = comms.compiled_text(
        step,
        *place(strategy, params, tx.init(params), MESH),
        jax.device_put(batch, NamedSharding(MESH, P("data"))),
    )
    # The step's mean loss, which the formula leaves out.
    loss = comms.ring_all_reduce_bytes(4, N)
    assert ring_bytes_of_program(text) - loss == pytest.approx(
        zero.ring_bytes_sent(strategy, params, N)
    )


def test_regathering_fsdp_sends_half_as_much_again_as_data_parallelism():
    # every array splits on 2, 4 and 8 devices: no remainder
    _, params, _ = block_case()
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


def test_state_specs_shard_what_each_strategy_shards():
    params = {"w": jnp.zeros((3, 2 * N)), "b": jnp.zeros((3,))}
    opt_state = optax.adam(1e-3).init(params)
    sharded, replicated = P(None, "data"), P()
    for strategy, params_sharded, state_sharded in [
        ("data", False, False),
        ("zero1", False, True),
        ("fsdp", True, True),
    ]:
        param_specs, state_specs = zero.state_specs(strategy, params, opt_state, MESH)
        assert param_specs == zero.param_specs(strategy, params, MESH)
        assert state_specs == zero.opt_state_specs(strategy, opt_state, MESH)
        assert param_specs["w"] == (sharded if params_sharded else replicated)
        assert param_specs["b"] == replicated  # 3 does not split over N > 1 devices
        assert state_specs[0].mu["w"] == (sharded if state_sharded else replicated)


def test_unknown_strategy():
    with pytest.raises(
        ValueError, match="unknown strategy 'zero2'; allowed: data, zero1, fsdp"
    ):
        zero.param_specs("zero2", {}, MESH)


# --- FSDP one layer at a time ------------------------------------------------------------------


def layered_case(num_devices, num_layers=3):
    """A stack of Transformer blocks, each array splitting over ``num_devices``, and a batch to regress."""
    hidden = 16 * num_devices
    block = Block(num_heads=2)
    inputs = jax.random.normal(jax.random.key(1), (2 * num_devices, 4, hidden))
    targets = jax.random.normal(jax.random.key(2), inputs.shape)
    init = lambda key: block.init(key, inputs[:1])["params"]
    layers = jax.jit(jax.vmap(init))(jax.random.split(jax.random.key(0), num_layers))
    layer_fn = lambda p, x: block.apply({"params": p}, x)
    return layer_fn, layers, (inputs, targets)


def fsdp_mesh(num_devices):
    return jax.make_mesh(
        (num_devices,),
        ("fsdp",),
        axis_types=(AxisType.Explicit,),
        devices=jax.devices()[:num_devices],
    )


# Each remat setting once, one of them on a count that is not a power of two.
LAYERED_CASES = [(N, True), (6, False)] if N >= 6 else [(N, True), (N, False)]


@pytest.mark.parametrize("num_devices,remat", LAYERED_CASES)
def test_layered_fsdp_gradients_equal_the_unsharded_reference(num_devices, remat):
    layer_fn, layers, batch = layered_case(num_devices)
    mesh = fsdp_mesh(num_devices)
    # compiled whole, as the step is (op by op is slower)
    reference = jax.jit(jax.value_and_grad(zero.stack_loss(layer_fn)))
    ref_loss, ref_grads = reference(layers, batch)
    tx = optax.sgd(1.0)  # new = old - gradient: the step's update is its gradient
    step = zero.make_layered_fsdp_step(
        layer_fn, tx, mesh, layers, tx.init(layers), remat=remat
    )
    placed = place_stacked((layers, tx.init(layers)), mesh)
    # every array is sharded, never along its layer axis
    assert all(
        s.spec[0] is None and "fsdp" in s.spec
        for s in jax.tree.leaves(jax.tree.map(lambda x: x.sharding, placed[0]))
    )
    new, _, loss = step(*placed, jax.device_put(batch, NamedSharding(mesh, P("fsdp"))))
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    grads = jax.tree.map(lambda old, new: old - new, layers, jax.device_get(new))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def place_stacked(tree, mesh):
    """A copy of ``tree`` sharded by ``zero.stacked_specs``."""
    return zero.copy_to(tree, zero.stacked_specs(tree, mesh), mesh)


def compiled_layered(layer_fn, layers, batch, mesh, strategy):
    """The compiled Adam step of ``strategy`` (one of ``zero.LAYERED_STRATEGIES``) on the stack."""
    tx = optax.adam(1e-3)
    opt_state = tx.init(layers)
    if strategy == "data":
        step = zero.make_step(
            "data", zero.stack_loss(layer_fn), tx, mesh, layers, opt_state, axis="fsdp"
        )
        placed = place("data", layers, opt_state, mesh, axis="fsdp")
    else:
        remat = strategy == "fsdp_per_layer"
        step = zero.make_layered_fsdp_step(
            layer_fn, tx, mesh, layers, opt_state, remat=remat
        )
        placed = place_stacked((layers, opt_state), mesh)
    batch = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))
    return step.lower(*placed, batch).compile()


def test_layer_gathers_stay_inside_the_loop_and_regather_in_the_backward_pass():
    layer_fn, layers, batch = layered_case(N)
    sharded_leaves = len(jax.tree.leaves(layers))  # every leaf splits (hidden = 16 N)
    found = {
        s: [
            c
            for c in comms.collectives(
                compiled_layered(layer_fn, layers, batch, fsdp_mesh(N), s).as_text()
            )
            if c.kind == "all-gather"
        ]
        for s in ("fsdp_all_gathered", "fsdp_per_layer")
    }
    assert all(c.in_loop for gathers in found.values() for c in gathers)
    # Once per leaf in the forward pass; again in the backward pass for every weight it needs.
    assert len(found["fsdp_all_gathered"]) == sharded_leaves
    assert sharded_leaves < len(found["fsdp_per_layer"]) < 2 * sharded_leaves


def test_expected_layered_bytes():
    # 512 B sharded, 12 B not
    layer = {
        "kernel": jnp.zeros((16, 8)),
        "bias": jnp.zeros(3),
    }
    assert zero.expected_layered_bytes("data", layer, 2, 4) == {
        "parameters": 1048,
        "optimizer state": 2096,
        "gathered weights": 0,
        "gradients and updates": 2096,
    }
    per_layer = zero.expected_layered_bytes("fsdp_per_layer", layer, 2, 4)
    assert (
        per_layer["parameters"] == 2 * (128 + 12)
        and per_layer["gathered weights"] == 512
    )
    assert (
        zero.expected_layered_bytes("fsdp_all_gathered", layer, 2, 4)[
            "gathered weights"
        ]
        == 1024
    )
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        zero.expected_layered_bytes("zero3", layer, 2, 4)


def test_measure_layered_reads_what_the_compiled_steps_hold():
    num_layers = 4
    layer_fn, layers, batch = layered_case(N, num_layers)
    mesh = fsdp_mesh(N)
    one_layer = jax.tree.map(lambda x: x[0], layers)
    steps = zero.layered_steps(layer_fn, optax.adam(1e-3), mesh, layers)
    assert list(steps) == list(zero.LAYERED_STRATEGIES)
    placed = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))
    found = zero.measure_layered(steps, placed, one_layer, num_layers, N)
    rows = {row[0]: row for row in found.table.values}
    for s in zero.LAYERED_STRATEGIES:
        stats = compiled.stats(compiled_layered(layer_fn, layers, batch, mesh, s))
        assert (
            rows[s][4] == stats.live_bytes
            and found.measured[s]["temporaries"] == stats.temp_bytes
        )
        assert found.measured[s]["parameters"] == found.predicted[s]["parameters"]
        assert 0.7 < rows[s][6] < 1.3
    assert rows["fsdp_per_layer"][4] < rows["fsdp_all_gathered"][4] < rows["data"][4]
    assert rows["data"][7:] == [0, 0] and rows["fsdp_per_layer"][8] == 0
    assert rows["fsdp_per_layer"][7] == len(found.gathers["fsdp_per_layer"]) > 0
    assert list(found.labelled(found.measured)) == list(zero.LAYERED_LABELS.values())


def test_copy_to_gives_new_buffers_sharded_as_asked():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data")))
    y = zero.copy_to(x, P("data"), mesh)
    assert y.sharding == NamedSharding(mesh, P("data"))
    x.delete()  # as a donating step would: the copy keeps its own buffers
    assert y.sum() == 120.0
