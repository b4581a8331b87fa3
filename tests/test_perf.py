import jax
import jax.numpy as jnp
import pytest

from jaxdist_lessons import comms, compiled, perf, zero
from jaxdist_lessons.mesh import make_mesh

N = jax.device_count()

HLO = """
HloModule m

%fused_computation (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %multiply.1 = f32[4]{0} multiply(f32[4]{0} %p0, f32[4]{0} %p0)
}

ENTRY %main (a: f32[4], b: f32[4,4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %fusion = f32[4]{0} fusion(f32[4]{0} %a), kind=kLoop, calls=%fused_computation
  %dot.2 = f32[4]{0} dot(f32[4,4]{1,0} %b, f32[4]{0} %fusion), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tuple = (f32[4]{0}, f32[4]{0}) tuple(f32[4]{0} %fusion, f32[4]{0} %dot.2)
}
"""


def test_op_counts_read_every_computation_and_the_entry_alone():
    assert perf.op_counts(HLO) == {
        "parameter": 3,
        "multiply": 1,
        "fusion": 1,
        "dot": 1,
        "tuple": 1,
    }
    assert perf.instruction_count(HLO) == 7
    assert perf.entry_op_counts(HLO) == {"parameter": 2, "fusion": 1, "dot": 1, "tuple": 1}


def test_a_nested_jit_compiles_to_the_same_program():
    def norm(x):
        return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)

    def program(inner):
        return jax.jit(jax.grad(lambda w, x: jnp.sum(inner(x @ w) ** 2))).lower(
            jnp.ones((8, 8)), jnp.ones((4, 8))
        )

    nested, plain = program(jax.jit(norm)), program(norm)
    assert (
        perf.op_counts(nested.as_text(dialect="hlo"))["call"]
        == perf.op_counts(plain.as_text(dialect="hlo"))["call"] + 1
    )
    assert perf.op_counts(nested.compile().as_text()) == perf.op_counts(
        plain.compile().as_text()
    )


def test_saved_residuals_shrink_under_checkpoint():
    def f(w, x):
        for i in range(3):
            x = jnp.tanh(x @ w[i])
        return x.sum()

    w, x = jnp.ones((3, 16, 16)), jnp.ones((4, 16))
    plain = perf.saved_residuals(f, w, x)
    assert {(r.dtype, r.shape) for r in plain if not r.is_argument} == {
        ("f32", (4, 16)),
        ("f32", (16, 16)),
    }
    # Each of the 3 layers keeps its tanh output and 1 - tanh^2 (4x16), and its weight slice (16x16).
    assert perf.residual_bytes(f, w, x) == 3 * (2 * 4 * 16 + 16 * 16) * 4
    remat = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
    assert perf.residual_bytes(remat, w, x) == 0
    assert all(r.is_argument for r in perf.saved_residuals(remat, w, x))


def test_saved_residuals_of_integers_and_booleans():
    def f(x, i):
        return jnp.sum(jnp.where(x > 0, x, 0.0) ** 2 + x[(i * 2) % 5])

    found = perf.saved_residuals(f, jnp.ones(5), jnp.arange(5, dtype=jnp.int32))
    # The mask x > 0 (bool), the where and the square's factor (f32), and the gather's indices (i32).
    assert sorted((r.dtype, r.shape, r.nbytes) for r in found) == [
        ("bool", (5,), 5),
        ("f32", (5,), 20),
        ("f32", (5,), 20),
        ("i32", (5, 1), 20),
    ]
    assert not any(r.is_argument for r in found)
    assert perf.residual_bytes(f, jnp.ones(5), jnp.arange(5, dtype=jnp.int32)) == 65


def test_saved_residuals_of_arrays_sharded_on_explicit_axes_and_of_float8():
    # On Explicit axes JAX prints a sharded dimension as `f32[8@data,4]`; the sizes stay global.
    mesh = make_mesh((N,), ("data",))  # Explicit axes
    f = lambda w: jnp.sin(jnp.cos(w)).sum()
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((2 * N, 4)), jax.NamedSharding(mesh, jax.P("data")))
        found = perf.saved_residuals(f, w)
    assert [(r.dtype, r.shape, r.nbytes) for r in found] == [
        ("f32", (2 * N, 4), 2 * N * 4 * 4)
    ] * 2
    # JAX prints float8 as `f8_e4m3fn[6]`: one byte an element.
    g = lambda x: (
        (x.astype(jnp.float8_e4m3fn) * x.astype(jnp.float8_e4m3fn))
        .astype(jnp.float32)
        .sum()
    )
    found = perf.saved_residuals(g, jnp.ones(6))
    assert [(r.dtype, r.shape, r.nbytes) for r in found] == [("f8_e4m3fn", (6,), 6)] * 2


def test_a_residual_line_that_cannot_be_read_is_an_error(monkeypatch):
    monkeypatch.setattr(
        jax.ad_checkpoint, "print_saved_residuals", lambda *a: print("f32<4> output of sin")
    )
    with pytest.raises(
        ValueError,
        match="cannot read this line of print_saved_residuals: 'f32<4> output of sin'",
    ):
        perf.saved_residuals(jnp.sin, jnp.ones(4))


def test_memory_row_and_donation():
    step = lambda state, x: jax.tree.map(lambda s: s + x.sum(), state)
    state, x = {"a": jnp.ones((64, 64)), "b": jnp.ones(64)}, jnp.ones(8)
    kept = compiled.compiled_stats(jax.jit(step), state, x)
    donated = compiled.compiled_stats(jax.jit(step, donate_argnums=0), state, x)
    assert perf.memory_row(kept)[3] == 0
    assert perf.memory_row(donated)[3] == comms.tree_bytes(state)
    assert len(perf.memory_row(kept)) == len(perf.MEMORY_HEADERS)
    report = perf.memory_report(
        {"kept": jax.jit(step).lower(state, x).compile()}, title="t"
    )
    assert (
        report.headers == ["program", *perf.MEMORY_HEADERS] and report.rows[0][0] == "kept"
    )
    assert report.rows[0][1] == f"{kept.argument_bytes:,}"


def test_live_bytes_count_the_temporaries_that_xla_cpu_peak_leaves_out():
    x = jnp.ones((256, 256))
    stats = compiled.compiled_stats(lambda x: jnp.sin(jnp.exp(x) @ jnp.cos(x)).sum(), x)
    row = dict(zip(perf.MEMORY_HEADERS, perf.memory_row(stats)))
    assert (
        row["live"]
        == row["arguments"] + row["outputs"] + row["temporaries"] - row["aliased"]
    )
    assert row["temporaries"] >= 2 * x.nbytes  # exp(x) and cos(x) at least, before the dot
    if jax.default_backend() == "cpu":
        # What compiled.CompiledStats.peak_bytes warns of: XLA:CPU's peak is the arguments and outputs.
        assert row["XLA peak"] == row["arguments"] + row["outputs"] < row["live"]


def test_mfu():
    assert perf.mfu(5e12, 0.01, 1e15) == pytest.approx(0.5)
    assert perf.mfu(1e12, 2.0, 1e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="must be positive"):
        perf.mfu(1.0, 0.0, 1e12)


def test_peaks_match_device_kinds_exactly():
    # Near misses must not borrow a neighbour's peak: a v4i, an H100 NVL, another spelling, a CPU.
    for kind in ["TPU v4 lite", "NVIDIA H100 NVL", "tpu v5", "TPU v5p ", "H100", "cpu"]:
        assert perf.peak_flops(kind) is None, kind
    # A TPU v5p reports "TPU v5", a v5e "TPU v5 lite": two chips, two peaks.
    assert perf.peak_flops("TPU v5") > perf.peak_flops("TPU v5 lite")
    assert perf.peak_flops("NVIDIA H100 PCIe") < perf.peak_flops("NVIDIA H100 80GB HBM3")
    for kind, (flops, source) in perf.PEAK_BF16_FLOPS.items():
        assert perf.peak_flops(kind) == flops and 1e14 < flops < 1e16
        assert "datasheet" in source or "docs" in source, kind


def test_tpu_kinds_are_ones_jax_knows():
    # JAX's own map from device_kind to TPU generation (a private module: skip if it moves).
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    for kind in perf.PEAK_BF16_FLOPS:
        if kind.startswith("TPU"):
            assert tpu_info.chip_version_from_device_kind(kind) is not None, kind
    assert tpu_info.chip_version_from_device_kind("TPU v5").name == "TPU_V5P"


def test_time_per_call_runs_the_call():
    calls = []
    seconds = perf.time_per_call(lambda: calls.append(1) or jnp.ones(1), calls=3, warmup=1)
    assert len(calls) == 4 and seconds >= 0
    with pytest.raises(ValueError, match="calls must be a positive integer"):
        perf.time_per_call(lambda: None, calls=0)


def test_benchmark_table_agrees_with_theory():
    work = perf.mlp_workload(N, width=64, depth=1, per_device_batch=4)
    table = perf.benchmark("fsdp", work, make_mesh((N,), ("data",)), calls=1)
    equal = {row[0]: row[3] for row in table.rows if row[3]}
    assert equal and set(equal.values()) == {"yes"}
    assert zero.expected_collectives("fsdp", work.params, N).keys() <= {
        k.removesuffix(" bytes") for k in equal
    }
    assert "images per second" in str(table)


def test_environment_names_versions():
    line = perf.environment()
    assert f"jax {jax.__version__}" in line and "UTC" in line
