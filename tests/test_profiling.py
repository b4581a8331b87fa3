"""A real jax.profiler trace of a sharded step, read back: the operations it ran, compute apart from collectives."""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, profiling

N = jax.device_count()


@pytest.fixture(scope="module")
def traced():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
    grad = jax.jit(
        jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w))),
        in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))),
    )
    # placed first: unplaced inputs would add a slicing program to every step
    w = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((N * 16, 64)), NamedSharding(mesh, P("data")))
    log_dir = profiling.capture(grad, w, x, steps=2)
    return log_dir, comms.compiled_text(grad, w, x)


def test_the_profiler_writes_a_chrome_trace_and_an_xplane(traced):
    log_dir, _ = traced
    files = profiling.trace_files(log_dir)
    assert set(files) == {"trace.json.gz", "xplane.pb"}
    with gzip.open(files["trace.json.gz"], "rt") as f:
        assert "traceEvents" in json.load(f)
    assert "ui.perfetto.dev" in profiling.perfetto_instructions(log_dir)
    assert str(files["trace.json.gz"]) in profiling.perfetto_instructions(log_dir)


def test_every_device_ran_every_op_of_the_compiled_program_each_step(traced):
    log_dir, hlo_text = traced
    events = profiling.read_trace(log_dir)
    assert {e.device for e in events} == set(range(N))
    assert all(e.duration_us >= 0 and e.module == "jit__lambda" for e in events)
    per_device = {d: sorted(e.op for e in events if e.device == d) for d in range(N)}
    assert all(ops == per_device[0] for ops in per_device.values())
    collectives = [e for e in events if e.kind == "collective"]
    if N > 1:
        # the gradient all-reduce the compiler inserted: once per device per step, as the HLO says
        assert len(collectives) == 2 * N * len(comms.collectives(hlo_text))
        assert all(e.op.startswith("all-reduce") for e in collectives)
    totals = profiling.time_by_kind(events)
    assert totals["compute"] > 0 and totals["compute"] + totals[
        "collective"
    ] == pytest.approx(sum(e.duration_us for e in events))


def test_the_xplane_holds_the_same_operations(traced):
    from_json = profiling.read_trace(traced[0])
    from_xplane = profiling.read_xplane(traced[0])
    key = lambda e: (e.device, e.op, round(e.duration_us, 3))
    assert sorted(map(key, from_json)) == sorted(map(key, from_xplane))


def test_op_table_sums_over_devices_and_steps(traced):
    events = profiling.read_trace(traced[0])
    rows = profiling.op_table(events)
    assert len(rows[0]) == len(profiling.OP_TABLE_HEADERS)
    assert sum(r[3] for r in rows) == len(events)
    assert np.isclose(sum(r[4] for r in rows), sum(e.duration_us for e in events) / 1e3)
    assert [r[4] for r in rows] == sorted((r[4] for r in rows), reverse=True)


def test_op_kind_names_collectives_sync_and_async():
    for op in (
        "all-reduce",
        "all-reduce.3",
        "all-gather-start.1",
        "reduce-scatter",
        "collective-permute-done",
    ):
        assert profiling.op_kind(op) == "collective"
    for op in (
        "dot.1",
        "multiply_add_fusion",
        "all-reduce-fusion-like-name",
        "transpose_copy_fusion",
    ):
        assert profiling.op_kind(op) == "compute"
    # every kind comms reads from a compiled program is a collective in a trace too
    assert all(
        profiling.op_kind(f"{kind}-done.2") == "collective" for kind in comms.KINDS
    )


def test_missing_traces_are_reported_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no profile under"):
        profiling.trace_files(tmp_path)
    # A run with only one of the two files: each reader names the file it needs.
    run = tmp_path / "plugins" / "profile" / "2026_01_01"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(b"")
    with pytest.raises(
        FileNotFoundError,
        match=r"has no \*\.trace\.json\.gz \(it has host\.xplane\.pb\)",
    ):
        profiling.read_trace(tmp_path)
    (run / "host.xplane.pb").unlink()
    (run / "host.trace.json.gz").write_bytes(b"")
    with pytest.raises(
        FileNotFoundError,
        match=r"has no \*\.xplane\.pb \(it has host\.trace\.json\.gz\)",
    ):
        profiling.read_xplane(tmp_path)
    with pytest.raises(ValueError, match="positive integer"):
        profiling.capture(jnp.sin, jnp.ones(2), steps=0)


@pytest.mark.skipif(N < 4 or N % 2, reason="a data x fsdp mesh of 2 x N/2")
def test_each_collective_of_the_trace_is_put_on_the_mesh_axes_it_spans():
    """A step that all-gathers over fsdp and all-reduces over data: the trace's collectives,
    attributed by the compiled program's replica groups, are the program's own, axis by
    axis (same kinds, same ops); a collective never shows more exposed time than time."""
    mesh = jax.make_mesh(
        (2, N // 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2
    )

    def step(w_block, x_block):
        w = jax.lax.all_gather(w_block, "fsdp", tiled=True)
        return jax.lax.psum(jnp.tanh(x_block @ w).sum(0, keepdims=True), "data")

    # check_vma=False: the gathered weights are the same on every device
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P("fsdp"), P("data")),
            out_specs=P(),
            check_vma=False,
        )
    )
    w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("fsdp")))
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("data")))
    text = comms.compiled_text(fn, w, x)
    axes = profiling.collective_axes(text, mesh)
    compiled = {}
    for c in comms.collectives(text):
        kind, axis = axes[c.name]
        compiled.setdefault(axis, {}).setdefault(kind, set()).add(c.name)
    assert set(compiled) == {"data", "fsdp"}
    assert compiled["fsdp"].keys() == {"all-gather"}
    assert compiled["data"].keys() == {"all-reduce"}
    events = profiling.read_trace(profiling.capture(fn, w, x, steps=2))
    seen = profiling.time_by_axis(events, axes)
    assert {a: r["ops"] for a, r in seen.items() if a != "compute"} == compiled
    for axis in compiled:
        assert 0 <= seen[axis]["exposed_us"] <= seen[axis]["time_us"]
    assert seen["compute"]["time_us"] > 0


@pytest.mark.skipif(N < 4 or N % 2, reason="a data x fsdp mesh of 2 x N/2")
def test_collective_bytes_are_split_by_the_axes_they_cross():
    """Three gathers over fsdp inside a scan, one all-reduce over data after it: each axis
    gets its own kind, the loop's bytes three times, and the axes add up to the recipe's
    count of the whole program."""
    from jaxdist_lm import compiled as lm_compiled

    mesh = jax.make_mesh(
        (2, N // 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2
    )

    def step(ws_block, x_block):
        def layer(x, w_block):
            w = jax.lax.all_gather(w_block, "fsdp", tiled=True)
            return jnp.tanh(x @ w), None

        x, _ = jax.lax.scan(layer, x_block, ws_block)
        return jax.lax.psum(x.sum(0, keepdims=True), "data")  # the program's ROOT

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(None, "fsdp"), P("data")),
            out_specs=P(),
            check_vma=False,
        )
    )
    ws = jax.device_put(jnp.ones((3, 32, 32)), NamedSharding(mesh, P(None, "fsdp")))
    x = jax.device_put(jnp.ones((8, 32)), NamedSharding(mesh, P("data")))
    text = comms.compiled_text(fn, ws, x)
    by_axis = profiling.collective_bytes_by_axis(text, mesh)
    assert by_axis == {
        "data": {"all-reduce": 4 * 32},
        "fsdp": {"all-gather": 3 * 4 * 32 * 32},
    }
    whole = lm_compiled.collective_bytes(text)
    assert {k: sum(a.get(k, 0) for a in by_axis.values()) for k in whole} == whole


@pytest.mark.skipif(N < 4 or N % 2, reason="a mesh of 2 x N/2 over reordered devices")
def test_collective_axes_number_devices_in_the_meshs_order():
    """A mesh over devices in another order than their ids (as a TPU slice's mesh is):
    the groups of a psum over `b` number the devices by their place in the mesh, and
    still read as `b`."""
    order = [*range(0, N, 2), *range(1, N, 2)]
    devices = np.array(jax.devices())[order].reshape(2, N // 2)
    mesh = jax.sharding.Mesh(devices, ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    total = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "b"),
            mesh=mesh,
            in_specs=P("a", "b"),
            out_specs=P("a"),
        )
    )
    x = jax.device_put(jnp.ones((2, N)), NamedSharding(mesh, P("a", "b")))
    text = comms.compiled_text(total, x)
    assert set(profiling.collective_axes(text, mesh).values()) == {("all-reduce", "b")}
