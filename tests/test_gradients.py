"""The four forms of a data-parallel step agree, and the compiler sends exactly what theory says."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, gradients, train
from jaxdist_lessons.models.small import MLP, SmallCNN

N = jax.device_count()
STEPS = 3


@functools.cache
def mesh():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))


def make_batches(k=STEPS, per_device=4):
    batches = []
    for i in range(k):
        images = jax.random.normal(jax.random.key(i), (per_device * N, 8, 8, 3))
        labels = jax.random.randint(jax.random.key(100 + i), (per_device * N,), 0, 10)
        batches.append({"images": images, "labels": labels})
    return batches


def place(state, batch):
    """The state replicated and the batch split by rows over ``data``."""
    return (
        jax.device_put(state, NamedSharding(mesh(), P())),
        jax.device_put(batch, NamedSharding(mesh(), P("data"))),
    )


MODELS = {"mlp": MLP(), "cnn": SmallCNN()}
TX = optax.sgd(0.1, momentum=0.9)


def init_state(model):
    """The state on device 0, from where each form moves it."""
    one = jax.make_mesh(
        (1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1]
    )
    no_rules = train.rule_shardings(one, [])
    return train.create_train_state(model, TX, (8, 8, 3), no_rules, jax.random.key(7))


def run(form, model, state, batches):
    """``len(batches)`` steps of one form: the final state and each step's metrics."""
    step, history = gradients.form_step(form, model, TX, mesh()), []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(metrics)
    return state, history


@functools.cache
def runs(model_name):
    model = MODELS[model_name]
    batches = make_batches()
    state = init_state(model)
    return {form: run(form, model, state, batches) for form in gradients.FORMS}, state


def assert_trees_close(a, b, what):
    a, b = jax.device_get(a), jax.device_get(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6, err_msg=what
        )


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("form", ["pmap", "jit", "shard_map"])
def test_every_form_matches_one_device_step_by_step(model_name, form):
    results, _ = runs(model_name)
    reference_state, reference_history = results["one device"]
    state, history = results[form]
    for k, (metrics, expected) in enumerate(zip(history, reference_history)):
        assert_trees_close(
            metrics["grads"], expected["grads"], f"{form} grads at step {k}"
        )
        np.testing.assert_allclose(
            float(metrics["loss"]), float(expected["loss"]), rtol=1e-6
        )
    assert_trees_close(
        state.params, reference_state.params, f"{form} params after {STEPS} steps"
    )
    assert_trees_close(
        state.opt_state,
        reference_state.opt_state,
        f"{form} momentum after {STEPS} steps",
    )
    assert_trees_close(
        state.batch_stats,
        reference_state.batch_stats,
        f"{form} batch stats after {STEPS} steps",
    )


def test_the_cnn_really_has_batch_statistics_that_move():
    results, initial = runs("cnn")
    stats = results["one device"][0].batch_stats["BatchNorm_0"]
    assert not np.allclose(
        np.asarray(stats["mean"]),
        np.asarray(initial.batch_stats["BatchNorm_0"]["mean"]),
    )


def test_batchnorm_without_axis_name_under_pmap_gives_local_statistics():
    model, batch = SmallCNN(), make_batches(1)[0]
    state = init_state(model)
    # no axis_name
    local = jax.pmap(
        lambda s, b: gradients.loss_fn(model, s.params, s.batch_stats, b)[1]
    )
    stats = local(gradients.replicate(state), gradients.split_batch(batch))
    means = np.asarray(stats["BatchNorm_0"]["mean"])
    assert not np.allclose(means[0], means[1])  # each device used only its slice


@pytest.mark.parametrize("model_name", list(MODELS))
def test_shard_map_trap_gives_n_times_the_gradient(model_name):
    (results, state) = runs(model_name)
    true_grads = results["one device"][1][0]["grads"]
    placed_state, batch = place(state, make_batches(1)[0])
    trapped = gradients.shard_map_trap_grads(MODELS[model_name], mesh())(
        placed_state, batch
    )
    for t, g in zip(
        jax.tree.leaves(jax.device_get(trapped)), jax.tree.leaves(true_grads)
    ):
        np.testing.assert_allclose(
            np.asarray(t), N * np.asarray(g), rtol=1e-5, atol=1e-6 * N
        )


def compiled_steps(model):
    batch = make_batches(1)[0]
    state = init_state(model)
    placed_state, placed_batch = place(state, batch)
    texts = {
        "jit": comms.compiled_text(
            gradients.jit_data_parallel_step(model, TX, mesh()),
            placed_state,
            placed_batch,
        ),
        "shard_map": comms.compiled_text(
            gradients.shard_map_step(model, TX, mesh()), placed_state, placed_batch
        ),
        "pmap": comms.compiled_text(
            gradients.pmap_step(model, TX),
            gradients.replicate(state),
            gradients.split_batch(batch),
        ),
    }
    return state, texts


LOSS_BYTES = 4  # the step also returns the mean loss, one f32 all-reduced


@pytest.mark.parametrize("features", [(32, 10), (256, 256, 256, 10)])
def test_mlp_all_reduce_bytes_are_the_parameter_bytes(features):
    state, texts = compiled_steps(MLP(features=features))
    params_bytes = comms.data_parallel_bytes(state.params)
    for form, text in texts.items():
        found = comms.collectives(text)
        assert {c.kind for c in found} == {"all-reduce"}, form
        assert comms.total_bytes(text, "all-reduce") == params_bytes + LOSS_BYTES, form
        assert all(c.group_size == N for c in found), form


def test_gradient_only_program_all_reduces_exactly_the_parameter_bytes():
    model, batch = MLP(), make_batches(1)[0]
    state = init_state(model)
    placed_state, placed_batch = place(state, batch)
    grad_fn = jax.jit(jax.grad(lambda p, b: gradients.loss_fn(model, p, {}, b)[0]))
    text = comms.compiled_text(grad_fn, placed_state.params, placed_batch)
    assert (
        comms.total_bytes(text)
        == comms.total_bytes(text, "all-reduce")
        == comms.data_parallel_bytes(state.params)
    )


def test_cnn_extra_all_reduces_are_batchnorm_statistics_and_the_loss():
    # Golden values for jax 0.10.2 on CPU. If XLA changes how it reduces BatchNorm, re-derive them:
    # print comms.collectives(text) for each form and account for every op.
    state, texts = compiled_steps(SmallCNN(channels=8))
    params_bytes, c = comms.data_parallel_bytes(state.params), 8
    forward_stats = 2 * c * 4  # mean and mean of squares, per channel
    backward_extra = {"jit": c * 4, "shard_map": c * 4, "pmap": 2 * c * 4}
    for form, text in texts.items():
        found = comms.collectives(text)
        assert {x.kind for x in found} == {"all-reduce"}, form
        expected = params_bytes + forward_stats + backward_extra[form] + LOSS_BYTES
        assert comms.total_bytes(text) == expected, form
        # The forward statistics travel on their own, before the backward pass needs them.
        assert found[0].elements == 2 * c and found[0].bytes == forward_stats, form


def test_pmap_is_the_legacy_api():
    assert jax.pmap.__doc__.startswith(
        "Old way of doing parallel map. Use :py:func:`jax.shard_map` instead."
    )


def test_bad_input():
    with pytest.raises(
        ValueError,
        match="a batch of 10 rows does not split into 4 equal device slices: "
        "make the batch a multiple of 4",
    ):
        gradients.split_batch(
            {"images": jnp.zeros((10, 2)), "labels": jnp.zeros(10)}, 4
        )
    with pytest.raises(
        ValueError,
        match="unknown form 'pjit'; allowed: one device, pmap, jit, shard_map",
    ):
        gradients.form_step("pjit", MLP(), TX)
    with pytest.raises(ValueError, match="form 'jit' needs a mesh"):
        gradients.form_step("jit", MLP(), TX)
