"""Sharded training: born-sharded state, N devices == 1 device, exact checkpoints across meshes."""

import dataclasses
import functools
import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import data, train
from jaxdist_lessons.mesh import mesh_shape
from jaxdist_lessons.models import resnet
from jaxdist_lessons.models.small import SmallCNN

N = jax.device_count()
# A two-stage ResNet: the same code paths as ResNet50 (BatchNorm, projections, rules), compiled in seconds.
MODEL = resnet.ResNet(
    stage_sizes=(1, 1), block_cls=resnet.BasicBlock, num_classes=10, width=0.25
)
TX = optax.adam(3e-3)
IMAGE = (32, 32, 3)
STRATEGIES = {
    "data parallel": (lambda devices: ((len(devices),), ("data",)), []),
    "hybrid": (
        lambda devices: (
            mesh_shape(len(devices), data=-1, tensor=min(2, len(devices))),
            ("data", "tensor"),
        ),
        resnet.partition_rules(),
    ),
}


def build(strategy, devices=None, tx=TX):
    devices = jax.devices() if devices is None else devices
    shape_names, rules = STRATEGIES[strategy]
    shape, names = shape_names(devices)
    auto = (AxisType.Auto,) * len(names)
    mesh = jax.make_mesh(shape, names, axis_types=auto, devices=devices)
    state = train.create_train_state(
        MODEL, tx, IMAGE, train.rule_shardings(mesh, rules), jax.random.key(0)
    )
    return mesh, train.shardings_of(state), state


@functools.cache
def compiled(strategy, one_device=False, optimizer="adam"):
    """Mesh, shardings, the initial state on the host, and the jitted steps: built once per strategy."""
    tx = TX if optimizer == "adam" else optax.sgd(0.1, momentum=0.9)
    mesh, shardings, state = build(
        strategy, devices=jax.devices()[:1] if one_device else None, tx=tx
    )
    return mesh, shardings, jax.device_get(state), train.make_steps(shardings, mesh)


def fresh(strategy, one_device=False, optimizer="adam"):
    """A new copy of the initial state (steps donate theirs), with the cached mesh, shardings and steps."""
    mesh, shardings, host_state, steps = compiled(strategy, one_device, optimizer)
    return mesh, shardings, jax.device_put(host_state, shardings), steps


@functools.cache
def source(split):
    return data.source(data.DIGITS, split)


def first_batch(mesh, global_batch=4 * N):
    return next(data.batches(source("train"), global_batch, mesh, seed=0, augment=True))


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_state_is_born_sharded_by_the_rules():
    mesh, shardings, state = build("hybrid")
    for (path, leaf), expected in zip(
        jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(shardings)
    ):
        assert leaf.sharding == expected, jax.tree_util.keystr(path)
    assert state.params["conv_init"]["kernel"].sharding.spec == P(
        None, None, None, "tensor"
    )
    # Adam's moments follow the parameters
    mu = state.opt_state[0].mu["conv_init"]["kernel"]
    assert mu.sharding.spec == P(None, None, None, "tensor")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_one_step_on_n_devices_equals_one_step_on_one_device(strategy):
    # SGD, not Adam: Adam's first step divides each gradient by its own magnitude, which turns float
    # rounding in a near-zero gradient into a full-size update of either sign.
    mesh, _, state, (train_step, _) = fresh(strategy, optimizer="sgd")
    one_mesh, _, one_state, (one_train_step, _) = fresh(
        strategy, one_device=True, optimizer="sgd"
    )
    batch = first_batch(mesh)
    one_batch = jax.device_put(
        jax.device_get(batch), jax.sharding.NamedSharding(one_mesh, P("data"))
    )
    new_state, metrics = train_step(state, batch)
    one_new_state, one_metrics = one_train_step(one_state, one_batch)
    np.testing.assert_allclose(
        float(metrics["loss"]), float(one_metrics["loss"]), rtol=1e-5
    )
    for part in ("params", "batch_stats", "opt_state"):
        for a, b in zip(
            host(getattr(new_state, part)), host(getattr(one_new_state, part))
        ):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=part)


def test_train_step_donates_the_state():
    mesh, _, state, (train_step, _) = fresh("data parallel")
    old_kernel = state.params["conv_init"]["kernel"]
    train_step(state, first_batch(mesh))
    assert old_kernel.is_deleted()


def test_loss_falls_within_a_few_steps_on_the_offline_data():
    mesh, _, state, (train_step, eval_step) = fresh("data parallel")
    state, history = train.fit(
        state,
        train_step,
        eval_step,
        lambda epoch: data.batches(source("train"), 8 * N, mesh, seed=0, epoch=epoch),
        None,
        epochs=1,
        steps_per_epoch=12,
        progress=False,
    )
    losses = [row["loss"] for row in history.train]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.15
    # below the loss of guessing uniformly among 10 classes
    assert np.mean(losses[-3:]) < np.log(10)


def test_evaluate_counts_every_example_once():
    mesh, _, state, (_, eval_step) = fresh("data parallel")
    test_set = source("test")
    result = train.evaluate(
        eval_step,
        state,
        data.batches(test_set, 16 * N, mesh, shuffle=False, drop_remainder=False),
    )
    assert 0.0 <= result["accuracy"] <= 1.0 and result["loss"] > 0
    counted = sum(
        float(eval_step(state, b)["count"])
        for b in data.batches(
            test_set, 16 * N, mesh, shuffle=False, drop_remainder=False
        )
    )
    assert counted == len(test_set)


def test_checkpoint_round_trip_across_meshes_is_exact_and_training_continues_identically(
    tmp_path,
):
    mesh, shardings, state, (train_step, _) = fresh("data parallel")
    with ocp.CheckpointManager(tmp_path / "ckpt") as checkpoints:
        state, _ = train.fit(
            state,
            train_step,
            None,
            lambda epoch: [first_batch(mesh)],
            None,
            epochs=1,
            checkpoints=checkpoints,
            progress=False,
        )
    saved = host(state)

    hybrid_mesh, hybrid_shardings, _, (hybrid_step, _) = fresh("hybrid")
    target = train.create_train_state(
        MODEL, TX, IMAGE, lambda shapes: hybrid_shardings, abstract=True
    )
    restored, step = train.restore_latest(
        str(tmp_path / "ckpt"), target, hybrid_shardings
    )
    for a, b in zip(host(restored), saved):
        np.testing.assert_array_equal(a, b)
    assert (
        restored.params["conv_init"]["kernel"].sharding
        == hybrid_shardings.params["conv_init"]["kernel"]
    )
    assert step == int(restored.step) == 1  # checkpoints are keyed by step
    signature = lambda tree: [
        (x.shape, x.dtype, x.weak_type)
        for x in jax.tree.leaves(jax.tree.map(jax.typeof, tree))
    ]
    # so the jitted steps do not compile again for it
    assert signature(restored) == signature(state)

    # Back on the original mesh, the restored state continues exactly like the original.
    again, _ = train.restore_latest(str(tmp_path / "ckpt"), target, shardings)
    batch = next(data.batches(source("train"), 4 * N, mesh, seed=0, epoch=1))
    _, from_original = train_step(state, batch)
    _, from_restored = train_step(again, batch)
    assert float(from_original["loss"]) == float(from_restored["loss"])
    # On the other mesh it continues with the same loss up to float rounding.
    _, from_hybrid = hybrid_step(
        restored,
        jax.device_put(
            jax.device_get(batch), jax.sharding.NamedSharding(hybrid_mesh, P("data"))
        ),
    )
    np.testing.assert_allclose(
        float(from_hybrid["loss"]), float(from_original["loss"]), rtol=1e-5
    )


def test_create_train_state_traces_init_once(monkeypatch):
    traced = []
    original = train.init_fn

    def counting(*args, **kwargs):
        init = original(*args, **kwargs)

        def init_and_count(rng):
            traced.append(1)
            return init(rng)

        return init_and_count

    monkeypatch.setattr(train, "init_fn", counting)
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
    train.create_train_state(MODEL, TX, IMAGE, train.rule_shardings(mesh, []))
    # jax.jit reuses the trace jax.eval_shape made: init is traced once.
    assert len(traced) == 1


def test_a_second_equal_run_reuses_the_first_runs_traces():
    """Two equal models built apart, and Adam at one rate asked for twice, give one
    ``init``, so their states have one tree structure and a second run (resumed, or
    continued) finds the first run's traces. Another Adam object would not."""
    again = MODEL.clone()  # a module object of its own, equal to MODEL
    assert again == MODEL and again is not MODEL
    assert train.adam(3e-3) is train.adam(3e-3)
    init = train.init_fn(MODEL, train.adam(3e-3), IMAGE)
    assert train.init_fn(again, train.adam(3e-3), list(IMAGE)) is init
    state = jax.eval_shape(init, jax.random.key(0))
    other = train.init_fn(again, optax.adam(3e-3), IMAGE)
    assert jax.tree.structure(jax.eval_shape(other, jax.random.key(0))) != (
        jax.tree.structure(state)
    )


def test_fit_rejects_bad_lengths():
    with pytest.raises(ValueError, match="epochs must be >= 0, got -1"):
        train.fit(None, None, None, lambda e: [], None, epochs=-1)
    with pytest.raises(
        ValueError, match="steps_per_epoch must be a positive integer or None, got 0"
    ):
        train.fit(None, None, None, lambda e: [], None, epochs=1, steps_per_epoch=0)
    with pytest.raises(ValueError, match="resuming at a step needs steps_per_epoch"):
        train.fit(None, None, None, lambda e: [], None, epochs=1, first_step=3)


# --- The orchestrator -------------------------------------------------------------------------

SMALL = dict(
    model="SmallCNN",
    model_kwargs={"channels": 4},
    preprocess=data.Preprocess(channels=1),
    global_batch=4 * N,
    steps_per_epoch=3,
    progress=False,
)


def test_config_is_plain_values():
    config = train.Config(**SMALL)
    assert "model='SmallCNN', model_kwargs={'channels': 4}" in repr(config)
    assert config.make_model() == SmallCNN(channels=4)
    with pytest.raises(ValueError, match="unknown model 'ResNet51'"):
        train.build_model("ResNet51")


def test_train_and_evaluate_checkpoints_every_epoch_by_step_and_resumes_exactly(
    tmp_path, capsys
):
    config = train.Config(**SMALL, epochs=2)
    whole = train.train_and_evaluate(config, str(tmp_path / "whole"))
    assert whole.first_step == 0 and len(whole.history.train) == 6
    assert [row["epoch"] for row in whole.history.eval] == [0, 1]
    assert sorted(os.listdir(tmp_path / "whole")) == ["3", "6"]  # steps done
    assert "epoch 2: losses" in capsys.readouterr().out

    # Stopped after one epoch, then started again with the same workdir: it resumes at step 3.
    train.train_and_evaluate(
        dataclasses.replace(config, epochs=1), str(tmp_path / "split")
    )
    resumed = train.train_and_evaluate(config, str(tmp_path / "split"))
    assert resumed.first_step == 3 and len(resumed.history.train) == 3
    assert f"resumed from {tmp_path / 'split' / '3'}" in capsys.readouterr().out
    losses = [row["loss"] for row in resumed.history.train]
    assert losses == [row["loss"] for row in whole.history.train[3:]]
    for a, b in zip(host(resumed.state), host(whole.state)):
        np.testing.assert_array_equal(a, b)
    # Done already: a third call trains nothing.
    again = train.train_and_evaluate(config, str(tmp_path / "split"))
    assert again.first_step == 6 and again.history.train == []


def test_a_stop_mid_epoch_saves_that_step_and_resumes_there(tmp_path):
    config = train.Config(**SMALL, epochs=2, evaluate=False)
    whole = train.train_and_evaluate(config)
    stopped = train.train_and_evaluate(config, str(tmp_path), lambda step: step == 4)
    assert stopped.history.stopped and len(stopped.history.train) == 4
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]
    rest = train.train_and_evaluate(config, str(tmp_path))
    assert rest.first_step == 4
    losses = [r["loss"] for r in stopped.history.train + rest.history.train]
    assert losses == [r["loss"] for r in whole.history.train]


def test_rules_are_one_kind():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="rules mix regex rules"):
        train.rule_shardings(mesh, [("kernel$", P("tensor")), ("mlp", "tensor")])
