import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, precision

N = jax.device_count()
MESH = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))


def loss_fn(params, x):
    return jnp.mean(
        jnp.tanh(x.astype(params["w"].dtype) @ params["w"]).astype(jnp.float32) ** 2
    )


@pytest.fixture(scope="module")
def problem():
    params = {"w": jax.random.normal(jax.random.key(0), (32, 64)) * 0.2}
    x = jax.random.normal(jax.random.key(1), (4 * N, 32))
    return params, jax.device_put(x, NamedSharding(MESH, P("data"))), x


def test_policy_casts_floats_only():
    tree = {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}
    cast = precision.policy("bf16 compute").to_compute(tree)
    assert cast["w"].dtype == jnp.bfloat16 and cast["step"].dtype == jnp.int32
    with pytest.raises(ValueError, match="unknown precision policy 'fp8'"):
        precision.policy("fp8")


@pytest.mark.parametrize("name", precision.POLICIES)
def test_gradients_match_fp32(problem, name):
    params, x, x_one_device = problem
    policy = precision.policy(name)
    placed = jax.device_put(policy.to_param(params), NamedSharding(MESH, P()))
    loss, grads = precision.data_parallel_grads(loss_fn, policy, MESH)(placed, x)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, x_one_device)
    assert grads["w"].dtype == policy.param_dtype
    # bf16: 7 explicit mantissa bits, 8 bits of precision
    tolerance = 1e-6 if name == "fp32" else 5e-2
    np.testing.assert_allclose(
        np.asarray(grads["w"], np.float32),
        ref_grads["w"],
        rtol=tolerance,
        atol=tolerance * 1e-1,
    )
    assert float(loss) == pytest.approx(float(ref_loss), rel=tolerance)


def test_bf16_all_reduce_halves_the_bytes_in_the_lowered_program(problem):
    params, x, _ = problem
    found = {}
    for name in ("fp32", "bf16 compute", "bf16 compute and all-reduce"):
        policy = precision.policy(name)
        lowered = precision.data_parallel_grads(loss_fn, policy, MESH).lower(
            jax.device_put(params, NamedSharding(MESH, P())), x
        )
        grads_reduce = [
            c
            for c in comms.collectives(lowered.as_text(dialect="hlo"))
            if c.elements == params["w"].size
        ]
        found[name] = (grads_reduce[0].dtype, grads_reduce[0].bytes, lowered)
    assert found["fp32"][:2] == ("f32", 4 * params["w"].size)
    # bf16 compute alone: fp32 gradients travel
    assert found["bf16 compute"][:2] == found["fp32"][:2]
    assert found["bf16 compute and all-reduce"][:2] == ("bf16", 2 * params["w"].size)
    compiled = comms.collectives(
        found["bf16 compute and all-reduce"][2].compile().as_text()
    )
    if N > 1 and jax.default_backend() == "cpu":
        # XLA:CPU runs its all-reduces in f32: the saving appears only on backends that keep bf16.
        assert {c.dtype for c in compiled} == {"f32"}


def test_wire_table_halves_the_lowered_all_reduce_only_with_bf16_gradients(problem):
    params, x, _ = problem
    rows = {
        row[0]: row for row in precision.wire_table(loss_fn, params, x, MESH).values
    }
    assert list(rows) == list(precision.POLICIES)
    fp32_bytes = comms.tree_bytes(params)
    assert rows["fp32"][1:3] == ["f32", fp32_bytes] == rows["bf16 compute"][1:3]
    assert rows["bf16 compute and all-reduce"][1:3] == ["bf16", fp32_bytes // 2]
    if jax.default_backend() == "cpu":
        # XLA:CPU widens bf16 all-reduces
        assert {row[3] for row in rows.values()} == {"f32"}
