"""Every error chapter 7 catalogues, reproduced: the message JAX raises today, and explain() recognising it.

If a JAX upgrade rewords one of these messages, a test here fails, and we update the chapter
(and ``troubleshoot.KNOWN_ERRORS``) before a reader meets the new text.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, devices, memory, zero
from jaxdist_lessons import troubleshoot as T
from jaxdist_lessons.sharding import ShardingError

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
    explanation = T.explain(exc)
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
    assert type(exc).__name__ == "IndivisibleError" and "_internal_pmap_axis_name" in str(
        exc
    )
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
    assert out.shape == (rows,) and np.array_equal(out, [4 * i + 1 for i in range(rows)])
    assert out.sharding.device_set == set(jax.devices()[:rows])


def test_spec_with_an_axis_the_mesh_lacks(auto):
    exc = raised(NamedSharding, auto, P("model"))  # the constructor checks the names
    assert (
        str(exc) == "Resource axis: model of P('model',) is not found in mesh: ('data',)."
    )
    assert assert_explained(exc, "spec names an axis the mesh does not have").cause == (
        "the spec P('model',) names mesh axis 'model', but the mesh's axes are ('data',)"
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
    exc = raised(
        bn.apply, variables, jnp.ones((N, 3)), mutable=["batch_stats"]
    )  # eagerly: other words
    assert str(exc) == "unbound axis name: data"
    assert_explained(exc, "unbound axis name")


@pytest.mark.skipif(N < 4, reason="needs a 2-D mesh with both axes > 1")
def test_explicit_axes_ask_for_out_sharding():
    mesh = jax.make_mesh(
        (N // 2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
    )
    x = jax.device_put(np.ones((N, 4), np.float32), NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(np.ones((4, 6), np.float32), NamedSharding(mesh, P("model", None)))
    exc = raised(jax.jit(lambda x, w: x @ w), x, w)
    assert type(exc).__name__ == "ShardingTypeError" and not isinstance(exc, ValueError)
    assert str(exc).startswith(
        "Contracting dimensions are sharded and it is ambiguous how the output should "
        "be sharded. Please specify the output sharding via the `out_sharding` parameter."
    )
    assert_explained(exc, "Explicit axes: output sharding is ambiguous")
    # The fix the explanation names works:
    with jax.set_mesh(mesh):
        fixed = jax.jit(lambda x, w: jnp.matmul(x, w, out_sharding=P("data", None)))(x, w)
    assert fixed.sharding.spec == P("data", None) and np.asarray(fixed)[0, 0] == 4.0


def test_with_sharding_constraint_on_explicit_axes(explicit):
    x = jax.device_put(np.ones((N, 4), np.float32), NamedSharding(explicit, P("data")))
    constrain = jax.jit(
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(explicit, P("data")))
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
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(explicit, P("data")))
    )
    other = jax.jit(
        lambda x: jax.lax.with_sharding_constraint(
            x, NamedSharding(explicit, P(None, "data"))
        )
    )
    with jax.set_mesh(explicit):
        assert same(x).sharding.spec == P(
            "data", None
        )  # the sharding it already has: passes, changes nothing
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
    exc = raised(lambda: jnp.zeros((2**15, 2**15, 2**15), jnp.float32).block_until_ready())
    assert isinstance(exc, jax.errors.JaxRuntimeError)
    if jax.default_backend() == "cpu":
        assert str(exc) == f"RESOURCE_EXHAUSTED: Out of memory allocating {2**47} bytes."
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
        explanation.cause == f"one device was asked for {size} bytes more than it had free"
    )


def test_explain_says_plainly_when_it_does_not_know():
    explanation = T.explain(KeyError("something else"))
    assert not explanation.known and explanation.title == "unknown KeyError"
    assert "explain() has no entry for this error" in explanation.cause
    with pytest.raises(TypeError, match="takes an exception"):
        T.explain("a message")


# --- Pre-flight checks -------------------------------------------------------------------------


@pytest.mark.skipif(N == 1, reason="one device divides every batch")
def test_check_batch_raises_before_jax_and_names_both_fixes(auto):
    batch = {"images": odd_batch(), "labels": np.zeros(2 * N + 1, np.int32)}
    with pytest.raises(
        T.BatchError,
        match=rf"images: a batch of {2 * N + 1} does not split over the {N} devices"
        rf".*pad it to {3 * N} .* drop the remainder to {2 * N}",
    ):
        T.check_batch(batch, auto, P("data"))
    padded, mask = T.pad_batch(batch, N)
    T.check_batch(padded, auto, P("data"))
    assert (
        padded["images"].shape == (3 * N, 3) and mask.sum() == 2 * N + 1 and mask[-1] == 0
    )
    assert np.array_equal(padded["labels"][: 2 * N + 1], batch["labels"])
    T.check_batch(T.drop_remainder(batch, N), auto, P("data"))
    assert T.drop_remainder(batch, N)["labels"].shape == (2 * N,)


def test_pad_and_drop_need_one_leading_size():
    mismatched = {"images": np.ones((5, 3)), "labels": np.zeros(7, np.int32)}
    for fix in (T.pad_batch, T.drop_remainder):
        with pytest.raises(
            T.BatchError,
            match=r"must share their leading \(batch\) size, got "
            r"\{'images': 5, 'labels': 7\}",
        ):
            fix(mismatched, 4)
        with pytest.raises(T.BatchError, match="step is a scalar"):
            fix({"images": np.ones((5, 3)), "step": np.int32(3)}, 4)
        with pytest.raises(T.BatchError, match="no arrays"):
            fix({}, 4)
    assert T.batch_size({"images": np.ones((5, 3)), "labels": np.zeros(5)}) == 5


def test_check_batch_names_the_other_spec_problems(auto):
    good = np.ones((N, 3))
    T.check_batch({"x": good}, auto, P("data"))
    with pytest.raises(ShardingError, match="names axis 'model', which is not in the mesh"):
        T.check_batch({"x": good}, auto, P("model"))
    with pytest.raises(
        ShardingError, match="x: spec .* has 3 entries but the array has rank 2"
    ):
        T.check_batch({"x": good}, auto, P("data", None, None))
    with pytest.raises(T.BatchError, match="share their leading"):
        T.check_batch({"x": good, "y": np.ones(N + 1)}, auto, P("data"))
    with pytest.raises(T.BatchError, match="no arrays"):
        T.check_batch({}, auto, P("data"))


def test_fits_uses_chapter_1_arithmetic():
    gpt3 = memory.transformer_params(
        **{k: v for k, v in memory.GPT3_175B.items() if k != "heads"}
    )
    one = T.fits(gpt3, 1, "H100 80GB")
    assert one.needed == 16 * gpt3 and not one.ok
    sharded = T.fits(gpt3, 64, "H100 80GB", strategy="fsdp")
    assert sharded.needed == pytest.approx(16 * gpt3 / 64) and sharded.ok
    assert sharded.check() is sharded
    with pytest.raises(
        T.OutOfMemoryError, match="does NOT fit in 80.0 GB.*Largest parts: optimizer"
    ):
        one.check()
    assert (
        T.fits(1e9, 8, 40e9, strategy="data", activation_bytes=8e9).parts["activations"]
        == 1e9
    )
    with pytest.raises(ValueError, match="reports no memory limit"):
        T.fits(1e6, 1, jax.devices()[0])
    with pytest.raises(ValueError, match="positive integer"):
        T.fits(1e6, 0, 1e9)


def test_compiled_fits_reads_the_compilers_figures(auto):
    stats = T.step_memory(T.Lever(per_device_batch=64), auto)
    fit = T.compiled_fits(stats, 1e9)
    assert fit.needed == stats.live_bytes and fit.ok
    assert not T.compiled_fits(stats, stats.live_bytes - 1).ok


# --- The compile counter ---------------------------------------------------------------------


def test_count_compiles_sees_a_recompile_per_new_shape():
    @jax.jit
    def step(x):
        return (x * 2).sum()

    with T.count_compiles(step) as counter:
        for size in (8, 8, 7, 6, 8):
            step(jnp.ones((size, 3)))
    assert (counter.traces, counter.compiles) == (3, 3)
    assert step._cache_size() == 3  # jax's own count agrees
    with T.count_compiles(step) as counter:
        step(jnp.ones((8, 3)))
    assert counter.compiles == 0
    limit_error = pytest.raises(
        T.RecompileError, match="step compiled 2 times \\(limit 1\\)"
    )
    with limit_error as info, T.count_compiles(step, limit=1):
        step(jnp.ones((5, 3)))
        step(jnp.ones((4, 3)))
    assert_explained(info.value, "recompiled on every step")
    # the listener is gone once the block ends: later compilations are not counted
    step(jnp.ones((3, 3)))
    assert counter.compiles == 0


# --- Out-of-memory levers ---------------------------------------------------------------------


def test_each_lever_lowers_what_it_should(auto):
    base = T.step_memory(T.Lever(), auto)
    half = T.step_memory(T.Lever(per_device_batch=512), auto)
    remat = T.step_memory(T.Lever(remat=True), auto)
    donated = T.step_memory(T.Lever(donate=True), auto)
    bf16 = T.step_memory(T.Lever(dtype="bfloat16"), auto)
    assert half.temp_bytes < base.temp_bytes and remat.temp_bytes < base.temp_bytes
    assert (
        donated.alias_bytes >= base.output_bytes - 1024
        and donated.live_bytes < base.live_bytes
    )
    # bf16 halves the state (XLA:CPU still computes bf16 matmuls in f32, so not the temporaries)
    assert bf16.output_bytes == pytest.approx(base.output_bytes / 2, rel=1e-3)
    if N > 1:
        lever = T.Lever(shard_state=True)
        sharded = T.step_memory(lever, auto)
        # the state (params and Adam's moments) is what the step outputs; only what zero.fsdp_spec cannot
        # split (Adam's step count, and the 10-way head's bias unless N divides 10) stays whole
        assert base.output_bytes / N < sharded.output_bytes < base.output_bytes / N * 1.01
        # the arguments are the state and this device's slice of the batch: the state is what zero's theory says
        batch_bytes = comms.tree_bytes(T.lever_batch(lever, auto)) // N
        assert sharded.argument_bytes - batch_bytes == zero.expected_state_bytes(
            "fsdp", *T.lever_state(lever), N
        )
        assert base.argument_bytes - batch_bytes == comms.tree_bytes(
            T.lever_state(T.Lever())
        )


def test_custom_prng_changes_the_key_type_not_the_memory(auto):
    shape = (16 * N, 256)
    plain, plain_type = T.random_init_memory(shape, auto, P("data"))
    with jax.enable_custom_prng(True):
        custom, custom_type = T.random_init_memory(shape, auto, P("data"))
    assert (plain_type, custom_type) == ("uint32[2]", "key<fry>[]")
    assert plain == custom


@pytest.mark.skipif(N < 4, reason="compares meshes of 2 and 4 devices")
def test_threefry_partitionable_keeps_temporaries_flat_as_devices_grow():
    temps = {}
    for k in (2, 4):
        submesh = jax.make_mesh(
            (k,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:k]
        )
        on, _ = T.random_init_memory((16 * k, 256), submesh, P("data"))
        with jax.threefry_partitionable(False):
            off, _ = T.random_init_memory((16 * k, 256), submesh, P("data"))
        temps[k] = on.temp_bytes, off.temp_bytes
    assert temps[2][0] == temps[4][0]  # partitionable: depends on the shard only
    assert temps[4][1] > temps[2][1] and temps[4][1] > temps[4][0]
    assert (
        temps[2][1] < temps[2][0]
    )  # on two devices the old scheme needs fewer temporaries
    assert jax.config.jax_threefry_partitionable  # the context manager restored the default


def test_threefry_partitionable_changes_the_numbers():
    draw = jax.jit(lambda key: jax.random.normal(key, (4 * N, 4)))
    new = draw(jax.random.key(0))
    with jax.threefry_partitionable(False):
        old = draw(jax.random.key(0))
    assert not np.array_equal(new, old)
