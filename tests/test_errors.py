"""Every error chapter 07_troubleshooting catalogues, reproduced: the message JAX raises today, and explain() recognising it.

If a JAX upgrade rewords one of these messages, a test here fails, and we update the chapter
(and ``errors.KNOWN_ERRORS``) before a reader meets the new text.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import devices, errors

N = jax.device_count()


@pytest.fixture(scope="module")
def auto():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def explicit():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))


def odd_batch():
    # A batch every device count > 1 fails to divide: one example more than a multiple.
    return np.ones((2 * N + 1, 3), np.float32)


def raised(fn, *args, **kwargs) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value


def assert_explained(exc, title):
    explanation = errors.explain(exc)
    assert explanation.known, f"explain() did not recognise {type(exc).__name__}: {exc}"
    assert explanation.title == title
    return explanation


# --- The catalogue -----------------------------------------------------------------------------


@pytest.mark.skipif(N == 1, reason="one device divides every batch")
def test_indivisible_batch_under_device_put_jit_and_process_local_data(auto):
    sharding = NamedSharding(auto, P("data"))
    for exc in (
        raised(jax.device_put, odd_batch(), sharding),
        raised(jax.jit(lambda x: x * 2, in_shardings=sharding), odd_batch()),
        raised(jax.make_array_from_process_local_data, sharding, odd_batch()),
    ):
        assert type(exc).__name__ == "IndivisibleError" and isinstance(exc, ValueError)
        assert re.search(
            rf"implies that array axis 0 is partitioned {N} times, but the dimension size is "
            rf"{2 * N + 1} \(full shape: \({2 * N + 1}, 3\)",
            str(exc),
        )
        explanation = assert_explained(
            exc, "batch does not divide by the devices (jit, device_put)"
        )
        assert (
            explanation.cause
            == f"array axis 0 has size {2 * N + 1}, which {N} devices cannot split evenly"
        )


@pytest.mark.skipif(N == 1, reason="one device divides every batch")
def test_indivisible_batch_on_an_explicit_mesh(explicit):
    exc = raised(jax.device_put, odd_batch(), NamedSharding(explicit, P("data")))
    assert type(exc) is ValueError
    assert (
        f"implies that array axis 0 is partitioned {N} times, but does not evenly divide the dimension "
        f"size {2 * N + 1}" in str(exc)
    )
    explanation = assert_explained(
        exc, "batch does not divide by the devices (jit, device_put)"
    )
    assert f"has size {2 * N + 1}" in explanation.cause


@pytest.mark.skipif(N == 1, reason="one device divides every batch")
def test_indivisible_batch_under_shard_map(auto):
    fn = jax.shard_map(lambda x: x, mesh=auto, in_specs=P("data"), out_specs=P("data"))
    exc = raised(fn, odd_batch())
    assert str(exc).startswith(
        "shard_map applied to the function '<lambda>' was given argument arrays with "
        "axis sizes that are not evenly divisible"
    )
    assert f"but {N} does not evenly divide {2 * N + 1}" in str(exc)
    assert_explained(exc, "batch does not divide by the devices (shard_map)")


@pytest.mark.skipif(N == 1, reason="one device divides every batch")
def test_pmap_takes_at_most_one_row_per_device():
    exc = raised(jax.pmap(lambda x: x), odd_batch())
    assert type(
        exc
    ).__name__ == "IndivisibleError" and "_internal_pmap_axis_name" in str(exc)
    explanation = assert_explained(exc, "pmap: more rows than devices")
    assert explanation.cause.endswith(
        f"it takes at most {N} rows (fewer run on the first devices); this "
        f"array has {2 * N + 1}"
    )
    assert "gradients.split_batch" in explanation.fix
    exc = raised(jax.pmap(lambda x: x), np.ones((2 * N, 3)))
    assert str(exc) == (
        "cannot select an axis to squeeze out which has size not equal to one, "
        "got shape=(2, 3) and dimensions=(0,)"
    )
    assert "(2, 3)" in assert_explained(exc, "pmap: more rows than devices").cause


@pytest.mark.skipif(N == 1, reason="needs fewer rows than devices")
def test_pmap_runs_fewer_rows_than_devices_on_the_first_devices():
    rows = N - 1
    out = jax.pmap(lambda x: x.sum())(
        np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    )
    assert out.shape == (rows,) and np.array_equal(
        out, [4 * i + 1 for i in range(rows)]
    )
    assert out.sharding.device_set == set(jax.devices()[:rows])


def test_spec_with_an_axis_the_mesh_lacks(auto):
    exc = raised(NamedSharding, auto, P("tensor"))  # the constructor checks the names
    assert (
        str(exc)
        == "Resource axis: tensor of P('tensor',) is not found in mesh: ('data',)."
    )
    assert assert_explained(exc, "spec names an axis the mesh does not have").cause == (
        "the spec P('tensor',) names mesh axis 'tensor', but the mesh's axes are ('data',)"
    )


def test_spec_longer_than_the_rank(auto):
    exc = raised(jax.device_put, np.ones(N), NamedSharding(auto, P("data", None)))
    assert (
        "is only valid for values of rank at least 2, but was applied to a value of rank 1"
        in str(exc)
    )
    assert_explained(exc, "spec longer than the array's rank")


def test_unbound_axis_name_under_pmap_and_batchnorm_under_jit():
    exc = raised(jax.pmap(lambda x: jax.lax.pmean(x, "data")), np.ones((N, 3)))
    assert type(exc) is NameError
    assert (
        str(exc)
        == "Found an unbound axis name: data. To fix this, please call psum under `jax.shard_map`."
    )
    assert_explained(exc, "unbound axis name")
    bn = nn.BatchNorm(use_running_average=False, axis_name="data")
    variables = bn.init(jax.random.key(0), jnp.ones((N, 3)))
    exc = raised(
        jax.jit(lambda v, x: bn.apply(v, x, mutable=["batch_stats"])),
        variables,
        jnp.ones((N, 3)),
    )
    assert "Found an unbound axis name: data" in str(exc)
    assert "axis_name='data'" in assert_explained(exc, "unbound axis name").fix
    # eagerly: other words
    exc = raised(bn.apply, variables, jnp.ones((N, 3)), mutable=["batch_stats"])
    assert str(exc) == "unbound axis name: data"
    assert_explained(exc, "unbound axis name")


@pytest.mark.skipif(N < 4, reason="needs a 2-D mesh with both axes > 1")
def test_explicit_axes_ask_for_out_sharding():
    mesh = jax.make_mesh(
        (N // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    x = jax.device_put(
        np.ones((N, 4), np.float32), NamedSharding(mesh, P("data", "tensor"))
    )
    w = jax.device_put(
        np.ones((4, 6), np.float32), NamedSharding(mesh, P("tensor", None))
    )
    exc = raised(jax.jit(lambda x, w: x @ w), x, w)
    assert type(exc).__name__ == "ShardingTypeError" and not isinstance(exc, ValueError)
    assert str(exc).startswith(
        "Contracting dimensions are sharded and it is ambiguous how the output should "
        "be sharded. Please specify the output sharding via the `out_sharding` parameter."
    )
    assert_explained(exc, "Explicit axes: output sharding is ambiguous")
    # The fix the explanation names works:
    with jax.set_mesh(mesh):
        fixed = jax.jit(lambda x, w: jnp.matmul(x, w, out_sharding=P("data", None)))(
            x, w
        )
    assert fixed.sharding.spec == P("data", None) and np.asarray(fixed)[0, 0] == 4.0


def test_with_sharding_constraint_on_explicit_axes(explicit):
    x = jax.device_put(np.ones((N, 4), np.float32), NamedSharding(explicit, P("data")))
    constrain = jax.jit(
        lambda x: jax.lax.with_sharding_constraint(
            x, NamedSharding(explicit, P("data"))
        )
    )
    exc = raised(constrain, x)
    assert (
        "The spec of NamedSharding passed to with_sharding_constraint can only refer to Auto axes of the "
        "mesh."
        in str(exc)
        and "You probably meant to use `reshard` API?" in str(exc)
    )
    assert_explained(exc, "with_sharding_constraint on Explicit axes, without set_mesh")
    with jax.set_mesh(explicit):
        resharded = jax.jit(lambda x: jax.sharding.reshard(x, P("data", None)))(x)
    assert resharded.sharding.spec == P("data", None)


def test_with_sharding_constraint_under_set_mesh_is_an_assertion(explicit):
    x = jax.device_put(np.ones((N, N), np.float32), NamedSharding(explicit, P("data")))
    same = jax.jit(
        lambda x: jax.lax.with_sharding_constraint(
            x, NamedSharding(explicit, P("data"))
        )
    )
    other = jax.jit(
        lambda x: jax.lax.with_sharding_constraint(
            x, NamedSharding(explicit, P(None, "data"))
        )
    )
    with jax.set_mesh(explicit):
        # the sharding it already has: passes, changes nothing
        assert same(x).sharding.spec == P("data", None)
        exc = raised(other, x)
    assert type(exc) is AssertionError
    assert str(exc) == (
        "`with_sharding_constraint` acts as an assert when all axes of mesh are of type `Explicit`. "
        "The array sharding: P('data', None) did not match the sharding provided: P(None, 'data'). "
        "Please use `jax.sharding.reshard` to shard your input to the sharding you want."
    )
    explanation = assert_explained(
        exc, "with_sharding_constraint on Explicit axes, under set_mesh"
    )
    assert (
        "the array is sharded P('data', None), the constraint asked for P(None, 'data')"
        in explanation.cause
    )
    assert "jax.sharding.reshard(x, P(None, 'data'))" in explanation.fix
    # the fix the explanation names works
    with jax.set_mesh(explicit):
        assert jax.jit(lambda x: jax.sharding.reshard(x, P(None, "data")))(
            x
        ).sharding.spec == P(None, "data")


def test_donated_buffer_used_again():
    step = jax.jit(lambda state: state + 1, donate_argnums=0)
    state = jnp.zeros((N, 4))
    new_state = step(state)
    exc = raised(lambda: state + 1)
    assert (
        type(exc) is RuntimeError
        and str(exc) == f"Array has been deleted with shape=float32[{N},4]."
    )
    assert "float32" in assert_explained(exc, "donated buffer used again").cause
    assert float(new_state.sum()) == N * 4


def test_python_control_flow_on_a_traced_value_in_sharded_code(auto):
    def log_on_first_device(x):
        if jax.lax.axis_index("data") == 0:
            print("first device")
        return x

    fn = jax.shard_map(
        log_on_first_device, mesh=auto, in_specs=P("data"), out_specs=P("data")
    )
    exc = raised(fn, np.ones((N, 3)))
    assert isinstance(exc, jax.errors.ConcretizationTypeError)
    # {V:data}: the value varies over the mesh axis 'data' (shard_map's check_vma types)
    assert str(exc).startswith(
        "Attempted boolean conversion of traced array with shape bool[]{V:data}."
    )
    assert_explained(exc, "traced value used as a Python value")
    exc = raised(jax.jit(lambda x: x[: int(x.sum())]), jnp.ones(4))
    assert str(exc).startswith(
        "Abstract tracer value encountered where concrete value is expected"
    )
    assert_explained(exc, "traced value used as a Python value")


def test_leaked_tracer():
    leaked = []
    jax.jit(lambda x: leaked.append(x) or x)(jnp.ones(4))
    exc = raised(lambda: leaked[0] + 1)
    assert str(exc).startswith("Encountered an unexpected tracer.")
    assert_explained(exc, "leaked tracer")


def test_device_count_chosen_too_late():
    exc = raised(jax.config.update, "jax_num_cpu_devices", N + 1)
    assert str(exc).startswith(
        "jax_num_cpu_devices config should be updated before backends are initialized"
    )
    assert_explained(exc, "device count chosen too late")
    exc = raised(devices.setup, N + 1)
    assert isinstance(exc, devices.SetupError)
    assert_explained(exc, "device count chosen too late")


def test_out_of_memory_on_the_host():
    # 2**47 bytes (128 TiB) is more than any host can map, so this fails at once, even with overcommit.
    exc = raised(
        lambda: jnp.zeros((2**15, 2**15, 2**15), jnp.float32).block_until_ready()
    )
    assert isinstance(exc, jax.errors.JaxRuntimeError)
    if jax.default_backend() == "cpu":
        assert (
            str(exc) == f"RESOURCE_EXHAUSTED: Out of memory allocating {2**47} bytes."
        )
    assert str(2**47) in assert_explained(exc, "out of memory").cause


@pytest.mark.parametrize(
    "message, size",
    [
        # as users report it from GPUs (quoted from github.com/jax-ml/jax/issues/13428 and /22755; no GPU here to raise it)
        (
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6291456 bytes.",
            6291456,
        ),
        (
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3743729664 bytes.",
            3743729664,
        ),
    ],
)
def test_explain_knows_the_gpu_wording_of_out_of_memory(message, size):
    explanation = assert_explained(jax.errors.JaxRuntimeError(message), "out of memory")
    assert (
        explanation.cause
        == f"one device was asked for {size} bytes more than it had free"
    )


def test_explain_says_plainly_when_it_does_not_know():
    explanation = errors.explain(KeyError("something else"))
    assert not explanation.known and explanation.title == "unknown KeyError"
    assert "explain() has no entry for this error" in explanation.cause
    with pytest.raises(TypeError, match="takes an exception"):
        errors.explain("a message")


def test_explain_calls_tabulates_what_each_call_raises():
    table = errors.explain_calls(
        {
            "missing axis": lambda: NamedSharding(
                jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,)), P("tensor")
            ),
            "a key": lambda: {}["x"],
        }
    )
    assert table.rows == [
        ["missing axis", "ValueError", "spec names an axis the mesh does not have"],
        ["a key", "KeyError", "unknown KeyError"],
    ]


@pytest.mark.skipif(N == 1, reason="one device divides every batch")
def test_catalogue_raises_each_known_error():
    table = errors.explain_calls(errors.catalogue())
    said = {row[0]: (row[1], row[2]) for row in table.rows}
    assert said == {
        "device_put a batch of 4n+1": (
            "IndivisibleError",
            "batch does not divide by the devices (jit, device_put)",
        ),
        "jit in_shardings, same batch": (
            "IndivisibleError",
            "batch does not divide by the devices (jit, device_put)",
        ),
        "make_array_from_process_local_data": (
            "IndivisibleError",
            "batch does not divide by the devices (jit, device_put)",
        ),
        "device_put on an Explicit mesh": (
            "ValueError",
            "batch does not divide by the devices (jit, device_put)",
        ),
        "shard_map, same batch": (
            "ValueError",
            "batch does not divide by the devices (shard_map)",
        ),
        "pmap, 4n+1 rows (more than n)": (
            "IndivisibleError",
            "pmap: more rows than devices",
        ),
        "pmap, 2n rows not reshaped": ("ValueError", "pmap: more rows than devices"),
        "spec names a missing axis": (
            "ValueError",
            "spec names an axis the mesh does not have",
        ),
        "spec longer than the rank": (
            "ValueError",
            "spec longer than the array's rank",
        ),
        "pmap without axis_name": ("NameError", "unbound axis name"),
        "BatchNorm axis_name under jit": ("NameError", "unbound axis name"),
        "Explicit matmul, no out_sharding": (
            "ShardingTypeError",
            "Explicit axes: output sharding is ambiguous",
        ),
        "with_sharding_constraint, Explicit": (
            "ValueError",
            "with_sharding_constraint on Explicit axes, without set_mesh",
        ),
        "the same under jax.set_mesh": (
            "AssertionError",
            "with_sharding_constraint on Explicit axes, under set_mesh",
        ),
        "donated buffer used again": ("RuntimeError", "donated buffer used again"),
        "Python if on a tracer": (
            "TracerBoolConversionError",
            "traced value used as a Python value",
        ),
        "int() of a tracer": (
            "ConcretizationTypeError",
            "traced value used as a Python value",
        ),
        "leaked tracer": ("UnexpectedTracerError", "leaked tracer"),
        "recompile on every step": ("RecompileError", "recompiled on every step"),
        "device count set too late": ("RuntimeError", "device count chosen too late"),
        "setup() after JAX started": ("SetupError", "device count chosen too late"),
        "out of memory": ("JaxRuntimeError", "out of memory"),
    }
