"""The compiler's per-device figures for a program sharded over all devices."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, compiled


def matmul_loss(x, w):
    return jnp.tanh(x @ w).sum()


def test_sharding_the_batch_divides_flops_and_argument_bytes_per_device():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    x, w = jnp.ones((n * 64, 128)), jnp.ones((128, 32))
    one = compiled.compiled_stats(matmul_loss, x, w)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    each = compiled.compiled_stats(matmul_loss, xs, ws)
    # 2 * rows * 128 * 32 multiply-adds; the tanh and the sum add a little on top
    assert one.flops >= 2 * n * 64 * 128 * 32
    assert each.flops * n == pytest.approx(one.flops, rel=0.01)
    assert one.argument_bytes == x.nbytes + w.nbytes
    assert each.argument_bytes == x.nbytes // n + w.nbytes
    assert one.output_bytes == each.output_bytes == 4


def test_compile_fn_accepts_jitted_and_plain_functions():
    x = jnp.ones((8, 8))
    plain = compiled.compile_fn(matmul_loss, x, x)
    jitted = compiled.compile_fn(jax.jit(matmul_loss), x, x)
    assert plain.as_text() == jitted.as_text()


def test_donation_shows_up_as_aliased_bytes():
    x = jnp.ones((256, 256))
    stats = compiled.compiled_stats(jax.jit(lambda a: a * 2, donate_argnums=0), x)
    assert stats.alias_bytes == x.nbytes
    assert stats.live_bytes == stats.argument_bytes + stats.temp_bytes
    kept = compiled.compiled_stats(jax.jit(lambda a: a * 2), x)
    assert (
        kept.alias_bytes == 0
        and kept.live_bytes == kept.argument_bytes + kept.output_bytes + kept.temp_bytes
    )
    # donation lets the output reuse the input's buffer
    assert stats.peak_bytes < kept.peak_bytes


def test_memory_row_and_donation():
    step = lambda state, x: jax.tree.map(lambda s: s + x.sum(), state)
    state, x = {"a": jnp.ones((64, 64)), "b": jnp.ones(64)}, jnp.ones(8)
    kept = compiled.compiled_stats(jax.jit(step), state, x)
    donated = compiled.compiled_stats(jax.jit(step, donate_argnums=0), state, x)
    assert compiled.memory_row(kept)[3] == 0
    assert compiled.memory_row(donated)[3] == comms.tree_bytes(state)
    assert len(compiled.memory_row(kept)) == len(compiled.MEMORY_HEADERS)
    report = compiled.memory_report(
        {"kept": jax.jit(step).lower(state, x).compile()}, title="t"
    )
    assert (
        report.headers == ["program", *compiled.MEMORY_HEADERS]
        and report.rows[0][0] == "kept"
    )
    assert report.rows[0][1] == f"{kept.argument_bytes:,}"


def test_live_bytes_count_the_temporaries_that_xla_cpu_peak_leaves_out():
    x = jnp.ones((256, 256))
    stats = compiled.compiled_stats(lambda x: jnp.sin(jnp.exp(x) @ jnp.cos(x)).sum(), x)
    row = dict(zip(compiled.MEMORY_HEADERS, compiled.memory_row(stats)))
    assert (
        row["live"]
        == row["arguments"] + row["outputs"] + row["temporaries"] - row["aliased"]
    )
    # exp(x) and cos(x) at least, before the dot
    assert row["temporaries"] >= 2 * x.nbytes
    if jax.default_backend() == "cpu":
        # What compiled.CompiledStats.peak_bytes warns of: XLA:CPU's peak is the arguments and outputs.
        assert row["XLA peak"] == row["arguments"] + row["outputs"] < row["live"]


def test_instruction_table_shows_a_nested_jit_as_calls_that_xla_inlines():
    inner = jax.jit(lambda x: jnp.tanh(x) * 2)
    plain = lambda x: jnp.tanh(x) * 2
    grads = lambda f: jax.jit(jax.grad(lambda w, x: jnp.sum(f(x @ w) ** 2)))
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    nested, flat = compiled.instruction_table(
        {"nested": grads(inner), "plain": grads(plain)}, w, x
    ).values
    assert nested[2] > flat[2] and nested[1] > flat[1]  # the calls, lowered
    assert nested[3:] == flat[3:]  # inlined: the same compiled program


def test_compiler_log_catches_the_partitioners_warning_and_its_cure():
    """Rows split over data x fsdp, asked for with the width split over fsdp and the rows
    whole: XLA's partitioner can only gather the whole array, and says so on standard
    error, which compiler_log reads; through rows over data and the width over fsdp (an
    all-to-all over fsdp), it says nothing. The persistent cache stays as it was."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh(
        (2, 4),
        ("data", "fsdp"),
        axis_types=(AxisType.Auto,) * 2,
        devices=jax.devices()[:8],
    )
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    width = NamedSharding(mesh, P(None, None, "fsdp"))
    x = jax.ShapeDtypeStruct((16, 128, 128), jnp.float32, sharding=rows)

    def reshard(*layouts):
        def f(x):
            for layout in layouts:
                x = jax.lax.with_sharding_constraint(x, layout)
            return jnp.sin(x)

        jitted = jax.jit(f, out_shardings=width)
        return lambda: jitted.lower(x).compile()

    cache = jax.config.jax_enable_compilation_cache
    program, log = compiled.compiler_log(reshard(rows, width))
    assert isinstance(program, jax.stages.Compiled)
    [warning] = [line for line in log if "Involuntary full rematerialization" in line]
    assert "cannot go from sharding {devices=[8,1,1]<=[8]}" in warning
    assert jax.config.jax_enable_compilation_cache == cache
    by_data = NamedSharding(mesh, P("data", None, "fsdp"))
    program, log = compiled.compiler_log(reshard(rows, by_data, width))
    assert not [line for line in log if "rematerialization" in line]
    assert "all-to-all" in program.as_text()
