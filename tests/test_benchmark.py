"""benchmark: timing, flops utilisation, and the strategy table (whose bytes agree with theory)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

from jaxdist_lessons import benchmark, zero

N = jax.device_count()


def test_mfu():
    assert benchmark.mfu(5e12, 0.01, 1e15) == pytest.approx(0.5)
    assert benchmark.mfu(1e12, 2.0, 1e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="must be positive"):
        benchmark.mfu(1.0, 0.0, 1e12)


def test_time_per_call_runs_the_call():
    calls = []
    seconds = benchmark.time_per_call(
        lambda: calls.append(1) or jnp.ones(1), calls=3, warmup=1
    )
    assert len(calls) == 4 and seconds >= 0
    with pytest.raises(ValueError, match="calls must be a positive integer"):
        benchmark.time_per_call(lambda: None, calls=0)


def test_benchmark_table_agrees_with_theory():
    work = benchmark.mlp_workload(N, width=64, depth=1, per_device_batch=4)
    table = benchmark.strategy_table(
        "fsdp",
        work,
        jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,)),
        calls=1,
    )
    equal = {row[0]: row[3] for row in table.rows if row[3]}
    assert equal and set(equal.values()) == {"yes"}
    assert zero.expected_collectives("fsdp", work.params, N).keys() <= {
        k.removesuffix(" bytes") for k in equal
    }
    assert "images per second" in str(table)


def test_environment_names_versions_and_xla_flags(monkeypatch):
    line = benchmark.environment()
    assert f"jax {jax.__version__}" in line and "UTC" in line
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert "; XLA_FLAGS=--xla_backend_optimization_level=0; " in benchmark.environment()
    monkeypatch.delenv("XLA_FLAGS")
    assert "XLA_FLAGS" not in benchmark.environment()


def test_strategy_comparison_tables_agree_with_theory():
    import optax

    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    work = benchmark.mlp_workload(N, width=8 * N, depth=1, per_device_batch=2)
    tx = optax.adam(1e-3)
    programs = benchmark.compile_strategies([work], tx, mesh)
    assert list(programs) == [("MLP", s) for s in zero.ZERO_STAGES]
    collectives = benchmark.collectives_table(programs, [work], N).values
    assert [row[5] for row in collectives] == ["yes"] * 3
    data_row = collectives[0]
    assert data_row[2:5] == [
        zero.expected_collectives("data", work.params, N)["all-reduce"],
        0,
        0,
    ]
    memory = {
        row[1]: row for row in benchmark.memory_table(programs, [work], tx, N).values
    }
    assert all(row[2] == row[3] for row in memory.values())  # held = theory
    assert memory["fsdp"][2] < memory["zero1"][2] < memory["data"][2]
    (ring,) = benchmark.ring_table([work], N).values
    assert ring[1] == pytest.approx(ring[2]) and 1.4 < ring[4] <= 1.5


def test_provenance_names_the_device_the_jax_and_the_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    record = benchmark.provenance()
    assert record["device_kind"] == jax.devices()[0].device_kind == "cpu"
    assert (record["platform"], record["jax_version"]) == ("cpu", jax.__version__)
    assert record["xla_flags"] == "--xla_backend_optimization_level=0"
    assert len(record["date"]) == 10 and record["date"].startswith("20")
