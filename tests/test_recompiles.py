"""recompiles.count_compiles: counting the compilations JAX itself records, and a limit that raises."""

import jax
import jax.numpy as jnp
import pytest

from jaxdist_lessons import errors, recompiles


def test_count_compiles_sees_a_recompile_per_new_shape():
    @jax.jit
    def step(x):
        return (x * 2).sum()

    with recompiles.count_compiles(step) as counter:
        for size in (8, 8, 7, 6, 8):
            step(jnp.ones((size, 3)))
    assert (counter.traces, counter.compiles) == (3, 3)
    assert step._cache_size() == 3  # jax's own count agrees
    with recompiles.count_compiles(step) as counter:
        step(jnp.ones((8, 3)))
    assert counter.compiles == 0
    limit_error = pytest.raises(
        recompiles.RecompileError, match="step compiled 2 times \\(limit 1\\)"
    )
    with limit_error as info, recompiles.count_compiles(step, limit=1):
        step(jnp.ones((5, 3)))
        step(jnp.ones((4, 3)))
    assert errors.explain(info.value).title == "recompiled on every step"
    # the listener is gone once the block ends: later compilations are not counted
    step(jnp.ones((3, 3)))
    assert counter.compiles == 0
