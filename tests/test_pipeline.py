import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxdist_lessons import comms, pipeline

N = jax.device_count()


def sequential_loss(stage_fn, loss_fn, stage_params, x, y):
    """The reference: ``loss_fn`` of the model without a pipeline, on the whole batch."""
    return loss_fn(pipeline.sequential_apply(stage_fn, stage_params, x), y)


def stage_fn(params, x):
    return jnp.tanh(x @ params["w"] + params["b"])


def loss_fn(out, y):
    return jnp.sum((out - y) ** 2)


def stage_params(num_stages, width=8):
    return pipeline.stack_stages(
        lambda k: {
            "w": jax.random.normal(k, (width, width)) / width**0.5,
            "b": jnp.full((width,), 0.1),
        },
        jax.random.key(0),
        num_stages,
    )


def pipe_mesh(stages, axis_type=AxisType.Explicit):
    return jax.make_mesh(
        (stages,),
        ("pipeline",),
        axis_types=(axis_type,),
        devices=jax.devices()[:stages],
    )


@pytest.mark.parametrize(
    "stages, micro, expected",
    [(1, 4, 0.0), (2, 2, 1 / 3), (4, 4, 3 / 7), (8, 32, 7 / 39)],
)
def test_gpipe_and_1f1b_idle_the_same_share_and_differ_in_memory(
    stages, micro, expected
):
    assert pipeline.bubble_fraction(stages, micro) == pytest.approx(expected)
    gpipe = pipeline.gpipe_schedule(stages, micro)
    ofob = pipeline.one_f_one_b_schedule(stages, micro)
    for table in (gpipe, ofob):
        assert len(table) == 2 * (micro + stages - 1)
        assert pipeline.idle_fraction(table) == pytest.approx(expected)
    assert pipeline.in_flight(gpipe) == [micro] * stages
    assert pipeline.in_flight(ofob) == [min(stages - d, micro) for d in range(stages)]
    # microbatch m on device d at tick m + d
    for t, row in enumerate(gpipe[: micro + stages - 1]):
        assert [op and (op.kind, op.micro) for op in row] == [
            ("F", t - d) if 0 <= t - d < micro else None for d in range(stages)
        ]


def test_1f1b_alternates_after_warm_up():
    table = pipeline.one_f_one_b_schedule(4, 6)
    device_1 = [f"{op.kind}{op.micro}" for op in (row[1] for row in table) if op]
    assert device_1 == [
        "F0",
        "F1",
        "F2",
        "B0",
        "F3",
        "B1",
        "F4",
        "B2",
        "F5",
        "B3",
        "B4",
        "B5",
    ]


@pytest.mark.parametrize(
    "stages, micro, virtual", [(4, 8, 2), (4, 4, 3), (8, 16, 2), (3, 6, 2)]
)
def test_interleaved_divides_the_bubble_by_v(stages, micro, virtual):
    table = pipeline.interleaved_schedule(stages, micro, virtual)
    # ticks of one virtual stage
    assert len(table) == 2 * (virtual * micro + stages - 1)
    assert pipeline.idle_fraction(table) == pytest.approx(
        pipeline.bubble_fraction(stages, micro, virtual)
    )
    ops = {(op.kind, op.micro, op.stage) for row in table for op in row if op}
    assert len(ops) == 2 * micro * stages * virtual  # every op once
    assert {op.stage % stages for row in table for op in row[1:2] if op} == {1}
    # device 0 holds 2 (S - 1) + (v - 1) S + 1 chunks at its peak (Megatron's warm-up, plus one)
    assert pipeline.in_flight(table)[0] == min(
        2 * (stages - 1) + (virtual - 1) * stages + 1, micro * virtual
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        pipeline.bubble_fraction(2, 0)
    with pytest.raises(
        ValueError, match=r"microbatches \(6\) in groups of the stages \(4\)"
    ):
        pipeline.interleaved_schedule(4, 6, 2)
    mesh = pipe_mesh(N)
    with pytest.raises(ValueError, match=f"leading dimension of {N}"):
        pipeline.gpipe_loss(
            stage_fn,
            loss_fn,
            stage_params(N + 1),
            jnp.zeros((4, 8)),
            jnp.zeros((4, 8)),
            mesh,
            2,
        )
    with pytest.raises(
        ValueError, match="batch of 6 cannot be cut into 4 equal microbatches"
    ):
        pipeline.one_f_one_b_grads(
            stage_fn,
            loss_fn,
            stage_params(N),
            jnp.zeros((6, 8)),
            jnp.zeros((6, 8)),
            mesh,
            4,
        )


def interleaved(layers, batch, micro, virtual=2, mesh=None):
    x = jnp.zeros((batch, 8))
    return pipeline.interleaved_grads(
        stage_fn,
        loss_fn,
        stage_params(layers),
        x,
        x,
        mesh or pipe_mesh(4),
        micro,
        virtual,
    )


def test_interleaved_rejects_what_megatron_does():
    with pytest.raises(
        ValueError,
        match=r"interleaved 1F1B needs microbatches \(6\) in groups of the stages \(4\)",
    ):
        interleaved(8, 12, 6)
    with pytest.raises(
        ValueError,
        match=r"leading dimensions \[12\] \(layers\) must be one number that 4 stages x 2 "
        r"virtual stages = 8 chunks divide",
    ):
        interleaved(12, 8, 4)
    with pytest.raises(
        ValueError, match="batch of 6 cannot be cut into 4 equal microbatches"
    ):
        interleaved(8, 6, 4)
    with pytest.raises(ValueError, match="virtual must be a positive integer, got 0"):
        interleaved(8, 8, 4, virtual=0)


@pytest.mark.parametrize(
    "stages, micro, axis_type",
    [
        (4, 4, AxisType.Explicit),
        (8, 4, AxisType.Auto),
        (8, 12, AxisType.Explicit),
        (6, 3, AxisType.Explicit),
    ],
)
def test_gpipe_and_1f1b_equal_the_sequential_loss_and_gradients(
    stages, micro, axis_type
):
    mesh = pipe_mesh(stages, axis_type)
    params = stage_params(stages)
    x = jax.random.normal(jax.random.key(1), (micro * 3, 8))
    y = jax.random.normal(jax.random.key(2), (micro * 3, 8))
    want, want_g = jax.value_and_grad(
        lambda p: sequential_loss(stage_fn, loss_fn, p, x, y)
    )(params)
    gpipe = jax.jit(
        jax.value_and_grad(
            lambda p: pipeline.gpipe_loss(stage_fn, loss_fn, p, x, y, mesh, micro)
        )
    )
    ofob = jax.jit(
        lambda p: pipeline.one_f_one_b_grads(stage_fn, loss_fn, p, x, y, mesh, micro)
    )
    for loss, grads in (gpipe(params), ofob(params)):
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(grads)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_the_compiled_gpipe_sends_one_microbatch_per_tick_and_no_output():
    x = jnp.zeros((8, 8))
    text = comms.compiled_text(
        lambda p, x: pipeline.gpipe_loss(stage_fn, loss_fn, p, x, x, pipe_mesh(4), 4),
        stage_params(4),
        x,
    )
    found = comms.collectives(text)
    permutes = [c for c in found if c.kind == "collective-permute"]
    # One permute in the loop body, of one microbatch (2 rows x 8 floats), run M + S - 1 times;
    # the only other collective sums 4 per-stage losses (a scalar each).
    assert len(permutes) == 1 and permutes[0].in_loop and permutes[0].bytes == 2 * 8 * 4
    assert all(c.bytes <= 4 * 4 for c in found if c.kind != "collective-permute")


@pytest.mark.parametrize(
    "shape, micro, virtual, axis_type",
    [
        ((4,), 8, 2, AxisType.Explicit),
        ((8,), 8, 2, AxisType.Auto),
        ((6,), 6, 2, AxisType.Explicit),
        ((2, 3), 3, 3, AxisType.Explicit),  # a data axis beside the pipeline
    ],
)
def test_interleaved_equals_the_sequential_loss_and_gradients(
    shape, micro, virtual, axis_type
):
    names = ("data", "pipeline")[-len(shape) :]
    mesh = jax.make_mesh(
        shape,
        names,
        axis_types=(axis_type,) * len(names),
        devices=jax.devices()[: np.prod(shape)],
    )
    layers = shape[-1] * virtual
    params = stage_params(layers)
    x = jax.random.normal(jax.random.key(1), (micro * 3, 8))
    y = jax.random.normal(jax.random.key(2), (micro * 3, 8))
    want, want_g = jax.value_and_grad(
        lambda p: sequential_loss(stage_fn, loss_fn, p, x, y)
    )(params)
    loss, grads = jax.jit(
        lambda p: pipeline.interleaved_grads(
            stage_fn, loss_fn, p, x, y, mesh, micro, virtual
        )
    )(params)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(grads)):
        assert b.shape == a.shape
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stages, virtual", [(2, 3), (4, 2), (8, 2), (3, 2)])
def test_interleaved_pools_hold_the_schedule_s_in_flight_count(stages, virtual):
    for micro in (stages, 2 * stages, 4 * stages):
        table = pipeline.interleaved_schedule(stages, micro, virtual)
        _, inputs, grads = pipeline.slot_tables(table)
        assert inputs == max(pipeline.in_flight(table))
        assert grads <= stages


def test_interleaved_compiled_memory_follows_its_in_flight_count():
    """Temporaries rise from M = 4 to M = 8 by the 3 chunk inputs the schedule adds, then stay."""
    width, rows, mesh = 128, 32, pipe_mesh(4)
    params = pipeline.stack_stages(
        lambda k: {"w": jax.random.normal(k, (width, width)), "b": jnp.zeros(width)},
        jax.random.key(0),
        8,
    )

    def temp_bytes(micro):
        x = jnp.zeros((micro * rows, width))
        run = lambda p, x: pipeline.interleaved_grads(
            stage_fn, loss_fn, p, x, x, mesh, micro, 2
        )
        return (
            jax.jit(run).lower(params, x).compile().memory_analysis().temp_size_in_bytes
        )

    flights = {
        m: pipeline.in_flight(pipeline.interleaved_schedule(4, m, 2))[0]
        for m in (4, 8, 16)
    }
    assert flights == {4: 8, 8: 11, 16: 11}
    temps = {m: temp_bytes(m) for m in flights}
    micro_bytes = rows * width * 4
    assert (temps[8] - temps[4]) / micro_bytes == pytest.approx(3, abs=0.02)
    assert abs(temps[16] - temps[8]) < 0.02 * micro_bytes
