import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import accumulate, comms

N = jax.device_count()
MESH = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
MICRO = 4


def loss_fn(params, batch):
    x, y = batch
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.fixture(scope="module")
def problem():
    params = {
        "w1": jax.random.normal(jax.random.key(0), (8, 16)),
        "w2": jax.random.normal(jax.random.key(1), (16, 5)),
    }
    rows = 2 * MICRO * N
    batch = (
        jax.random.normal(jax.random.key(2), (rows, 8)),
        jax.random.randint(jax.random.key(3), (rows,), 0, 5),
    )
    placed = (
        jax.device_put(params, NamedSharding(MESH, P())),
        jax.device_put(batch, NamedSharding(MESH, P("data"))),
    )
    return params, batch, placed


def test_split_micro_takes_every_kth_row():
    batch = {"x": jnp.arange(12).reshape(6, 2), "y": jnp.arange(6)}
    micro = accumulate.split_micro(batch, 3)
    assert micro["x"].shape == (3, 2, 2)
    np.testing.assert_array_equal(micro["y"], [[0, 3], [1, 4], [2, 5]])


def test_split_micro_errors():
    with pytest.raises(ValueError, match="does not split into 4 equal micro-batches"):
        accumulate.split_micro(jnp.zeros((6, 2)), 4)
    with pytest.raises(ValueError, match="same leading size"):
        accumulate.split_micro((jnp.zeros((4,)), jnp.zeros((6,))), 2)
    with pytest.raises(ValueError, match="num_micro must be a positive integer"):
        accumulate.naive_grads(loss_fn, MESH, 0)


def test_local_grads_names_the_global_batch_it_needs(problem):
    # Inside shard_map the batch is one device's rows: 3 rows per device do not split into 2 micro-batches,
    # and the fix is a global batch that is a multiple of 2 x N, not of 2.
    _, _, (params, _) = problem
    batch = jax.device_put(
        (jnp.zeros((3 * N, 8)), jnp.zeros((3 * N,), jnp.int32)),
        NamedSharding(MESH, P("data")),
    )
    with pytest.raises(
        ValueError,
        match=rf"each device's 3 rows do not split into 2 equal micro-batches: "
        rf"make the global batch a multiple of 2 x {N} devices = {2 * N}",
    ):
        accumulate.local_grads(loss_fn, MESH, 2)(params, batch)


@pytest.mark.parametrize("variant", accumulate.VARIANTS)
def test_accumulated_gradients_equal_the_full_batch_gradient(problem, variant):
    params, batch, placed = problem
    loss, grads = accumulate.VARIANTS[variant](loss_fn, MESH, MICRO)(*placed)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_where_each_variant_all_reduces(problem):
    params, _, placed = problem
    grads_bytes = comms.tree_bytes(params)
    naive = comms.collectives(
        comms.compiled_text(accumulate.naive_grads(loss_fn, MESH, MICRO), *placed)
    )
    local = comms.collectives(
        comms.compiled_text(accumulate.local_grads(loss_fn, MESH, MICRO), *placed)
    )
    if N == 1:
        assert naive == local == []
        return
    # jit + scan: the gradient all-reduce is in the loop body, so it runs once per micro-batch.
    assert {c.kind for c in naive} == {"all-reduce"} and all(c.in_loop for c in naive)
    assert sum(c.bytes for c in naive) >= grads_bytes
    # shard_map: one all-reduce of the gradients (and the loss), after the loop.
    assert [(c.kind, c.in_loop) for c in local] == [("all-reduce", False)]
    assert local[0].bytes == grads_bytes + 4


def test_comparison_table_puts_the_naive_all_reduce_in_the_loop(problem):
    _, _, (params, batch) = problem
    table = accumulate.comparison_table(loss_fn, params, batch, MESH, MICRO)
    naive, local = table.values
    assert [naive[0], local[0]] == list(accumulate.VARIANTS)
    assert naive[1] == naive[2] >= 1 and local[2] == 0  # in the loop, against after it
    assert naive[4] == MICRO * local[4]
    # gradients + loss
    assert local[3] == 1 and local[4] == comms.tree_bytes(params) + 4
    assert max(naive[5], local[5]) < 1e-5
    naive_fn = accumulate.naive_grads(loss_fn, MESH, MICRO)
    assert accumulate.bytes_per_step(naive_fn, params, batch, MICRO) == naive[4]
