import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxdist_lessons import comms, pipeline
from jaxdist_lessons.mesh import make_mesh

N = jax.device_count()


def stage_fn(params, x):
    return jnp.tanh(x @ params["w"] + params["b"])


def stage_params(num_stages, width=8):
    return pipeline.stack_stages(
        lambda k: {
            "w": jax.random.normal(k, (width, width)) / width**0.5,
            "b": jnp.full((width,), 0.1),
        },
        jax.random.key(0),
        num_stages,
    )


@pytest.mark.parametrize(
    "stages, micro, expected", [(1, 4, 0.0), (2, 2, 1 / 3), (4, 4, 3 / 7), (8, 32, 7 / 39)]
)
def test_bubble_fraction_formula_and_schedule(stages, micro, expected):
    assert pipeline.bubble_fraction(stages, micro) == pytest.approx(expected)
    table = pipeline.schedule(stages, micro)
    assert len(table) == micro + stages - 1
    assert pipeline.idle_fraction(table) == pytest.approx(expected)
    for j in range(micro):  # microbatch j visits the stages in order, one tick apart
        assert [row.index(j) for row in table if j in row] == list(range(stages))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        pipeline.bubble_fraction(2, 0)
    mesh = make_mesh((N,), ("pipeline",), axis_types=AxisType.Explicit)
    with pytest.raises(ValueError, match=f"leading dimension of {N}"):
        pipeline.pipeline_apply(stage_fn, stage_params(N + 1), jnp.zeros((4, 8)), mesh, 2)
    with pytest.raises(
        ValueError, match="batch of 6 cannot be cut into 4 equal microbatches"
    ):
        pipeline.pipeline_apply(stage_fn, stage_params(N), jnp.zeros((6, 8)), mesh, 4)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_pipeline_equals_sequential_forward_and_gradients(axis_type):
    mesh = make_mesh((N,), ("pipeline",), axis_types=axis_type)
    params = stage_params(N)
    x = jax.random.normal(jax.random.key(1), (12, 8))
    piped = jax.jit(
        lambda p, x: pipeline.pipeline_apply(stage_fn, p, x, mesh, num_microbatches=4)
    )
    np.testing.assert_allclose(
        piped(params, x), pipeline.sequential_apply(stage_fn, params, x), atol=1e-6
    )

    def loss(apply):
        return lambda p: jnp.sum(apply(p) ** 2)

    want = jax.grad(loss(lambda p: pipeline.sequential_apply(stage_fn, p, x)))(params)
    got = jax.jit(jax.grad(loss(lambda p: piped(p, x))))(params)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_the_compiled_pipeline_passes_activations_in_a_loop():
    mesh = make_mesh((N,), ("pipeline",), axis_types=AxisType.Explicit)
    x = jnp.zeros((8, 8))
    text = comms.compiled_text(
        lambda p, x: pipeline.pipeline_apply(stage_fn, p, x, mesh, 4), stage_params(N), x
    )
    permutes = [c for c in comms.collectives(text) if c.kind == "collective-permute"]
    if N == 1:
        assert not permutes
        return
    # One permute in the loop body, of one microbatch (2 rows x 8 floats), run M + S - 1 times.
    assert len(permutes) == 1 and permutes[0].in_loop and permutes[0].bytes == 2 * 8 * 4
