"""jaxdist_lm's memory: the loss that never holds all the logits (loss.fused_cross_entropy,
step.head_loss), the evaluation step in micro-batches, out of memory in one line and the
largest batch that fits (compiled.py), and a peak that counts the compiled steps (metrics.py).

Float32 on the simulated CPU devices of conftest.py. The compiler's out-of-memory message is
XLA:TPU's, as a TPU v5e printed it (XLA:CPU never refuses a program for its size).
"""

import pathlib
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist_lm import (
    compiled,
    metrics,
    train,
)
from jaxdist_lm import loss as loss_lib
from jaxdist_lm.run_config import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

CLOSE = {"rtol": 2e-5, "atol": 2e-6}
# XLA:TPU's words for a program larger than the chip (the format of jax 0.10.2's libtpu)
TPU_OOM = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
    "space hbm. Used 16.31G of 15.75G hbm. Exceeded hbm capacity by 574.50M."
)
TPU_TEMPORARIES = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (18.67G) exceeds available HBM (15.75G)."
)


@pytest.mark.parametrize("chunks", [2, 4, 32])
def test_fused_cross_entropy_equals_the_whole_logits_and_their_gradients(chunks):
    """The loss and the gradients of the head's weight and of its input, chunk by chunk
    (columns c, c + chunks, ...), equal those of all the logits at once."""
    keys = jax.random.split(jax.random.key(0), 3)
    x_BTD = jax.random.normal(keys[0], (3, 32, 16))
    head = {"w": jax.random.normal(keys[1], (16, 50)) / 4}
    targets_BT = jax.random.randint(keys[2], (3, 32), 0, 50)
    logits = lambda head, x_BTD: x_BTD @ head["w"]

    def loss(head, x_BTD, chunks):
        return loss_lib.fused_cross_entropy(logits, head, x_BTD, targets_BT, chunks)

    whole = jax.value_and_grad(loss, argnums=(0, 1))(head, x_BTD, 1)
    fused = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
        head, x_BTD, chunks
    )
    np.testing.assert_allclose(fused[0], whole[0], **CLOSE)
    np.testing.assert_allclose(fused[1][0]["w"], whole[1][0]["w"], **CLOSE)
    np.testing.assert_allclose(fused[1][1], whole[1][1], **CLOSE)
    assert jax.jit(loss, static_argnums=2)(head, x_BTD, chunks) == pytest.approx(
        float(whole[0]), rel=1e-6
    )


@pytest.mark.parametrize(
    "tokens, length, vocab, devices, chunks",
    [
        (16 * 128, 128, 2048, 8, 1),  # tiny: 2 MB of logits a device, all at once
        (8 * 2048, 2048, 128_256, 1, 32),  # 1b: 8.4 GB, in chunks of 262 MB
        (16 * 2048, 2048, 32_768, 1, 16),  # 125m: 4.3 GB
        (8 * 2048, 2048, 128_256, 16, 2),
    ],
)
def test_loss_chunks_keep_a_devices_logits_within_the_budget(
    tokens, length, vocab, devices, chunks
):
    assert loss_lib.loss_chunks(tokens, length, vocab, devices) == chunks
    assert 4 * tokens * vocab / devices / chunks <= loss_lib.LOSS_CHUNK_BYTES


def test_the_recipes_step_in_chunks_gives_the_steps_of_all_the_logits(monkeypatch):
    """The training step with the loss cut into 8 chunks (a budget of 1/8 of the tiny
    model's logits) gives the losses and gradient norms of the whole logits, on
    sequence=4,tensor=2 (a ring, the vocabulary split: no axis splits the batch)."""
    argv = ["--model", "tiny", "--mesh", "sequence=4,tensor=2", "--seq-len", "64"]
    args = train.parse_args([*argv, "--global-batch", "8", "--steps", "3"])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 2048, (8, 65), dtype=np.int32) for _ in range(2)]
    runs, used, fused = [], [], loss_lib.fused_cross_entropy

    def spy(*args, **kwargs):  # the chunks the step asks for
        used.append(args[4])
        return fused(*args, **kwargs)

    monkeypatch.setattr(loss_lib, "fused_cross_entropy", spy)
    for budget in (2**40, 4 * 8 * 64 * 2048 // 8 // 8):
        monkeypatch.setattr(loss_lib, "LOSS_CHUNK_BYTES", budget)
        mesh, _, _, step, shapes, init = train.setup(args)
        runs.append(steps_on(step, shapes, init, mesh, batches))
    assert sorted(set(used)) == [1, 8]
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


def steps_on(step, shapes, init, mesh, batches) -> np.ndarray:
    """Each batch's loss and gradient norm, one step after another from init."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(train.BATCH))
    with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
        state = jax.jit(init, out_shardings=jax.tree.map(lambda s: s.sharding, shapes))(
            jax.random.key(0)
        )
        out = []
        for batch in batches:
            state, m = step(state, jax.device_put(batch, sharding))
            out.append([float(m["loss"]), float(m["grad_norm"])])
    return np.array(out)


def test_the_evaluation_step_in_micro_batches_gives_the_loss_of_the_whole_batch():
    """--grad-accum 4's evaluation step (four micro-batches, one after another) gives
    the held-out loss of the whole batch at once, and needs fewer temporaries."""
    argv = ["--model", "tiny", "--mesh", "data=2,fsdp=4", "--global-batch", "32"]
    losses, temporaries = [], []
    batch = np.random.default_rng(1).integers(0, 2048, (32, 129), dtype=np.int32)
    for accum in ("1", "4"):
        args = train.parse_args([*argv, "--grad-accum", accum])
        mesh, model, _, _, shapes, init = train.setup(args)
        eval_step = train.held_out_step(args, mesh, model, shapes)
        lowered = compiled.lower_step(eval_step, shapes, args, mesh)
        temporaries.append(lowered.compile().memory_analysis().temp_size_in_bytes)
        sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(train.BATCH)
        )
        with jax.set_mesh(mesh), nn.logical_axis_rules(train.RULES):
            state = jax.jit(
                init, out_shardings=jax.tree.map(lambda s: s.sharding, shapes)
            )(jax.random.key(0))
            losses.append(float(eval_step(state, jax.device_put(batch, sharding))))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert temporaries[1] < temporaries[0]


def test_needed_bytes_reads_the_tpu_compilers_total():
    """Two forms of XLA:TPU's message: a total, or (jax 0.10.2's libtpu, as the TPU v5e
    printed it) the temporaries alone, to which the program's arguments are added."""
    assert compiled.needed_bytes(TPU_OOM) == round(16.31 * 2**30)
    assert compiled.needed_bytes(TPU_TEMPORARIES, 9_887_000_000) == (
        round(18.67 * 2**30) + 9_887_000_000
    )
    assert (
        compiled.needed_bytes("RESOURCE_EXHAUSTED: Attempting to allocate 1.00G")
        is None
    )


def test_most_rows_follows_a_straight_line_through_two_sizes():
    # 4 GB fixed and 1 GB a row: 8 rows need 12 GB, 4 rows 8 GB; 15.75 GB holds 11
    assert compiled.most_rows((8, 4), (12 * 10**9, 8 * 10**9), 15_750_000_000) == 11
    assert compiled.most_rows((8, 4), (5 * 10**9, 5 * 10**9), 10**10) == 0


def fake_shapes(weights: int, moments: int, memory_kind: str = "device"):
    """A state's shapes: float32 weights and Adam's two moments of that many values."""
    device = jax.devices()[0]
    one = lambda n, kind: jax.ShapeDtypeStruct(
        (n,),
        jnp.float32,
        sharding=jax.sharding.SingleDeviceSharding(device, memory_kind=kind),
    )
    return SimpleNamespace(
        params={"w": one(weights, "device")}, opt_state=[one(moments, memory_kind)] * 2
    )


def oom_args(**flags) -> RunConfig:
    args = dict(global_batch=16, grad_accum=1, offload=frozenset(), remat="dots")
    return RunConfig(**(args | flags))


def test_out_of_memory_is_one_line_with_what_it_needs_and_flags_that_fit(monkeypatch):
    """1b's numbers: 1.24 G float32 weights (4.94 GB, their gradient as much, Adam's
    moments 9.9 GB) do not fit 15.75 GB: the line says so, names bfloat16 moments and
    the optimizer's offload, and ends with XLA's own words. A small model whose
    activations overflow: four times the accumulation fits, the gradients' float32 sum
    counted."""
    monkeypatch.setattr(compiled, "memory_limit", lambda: 15_750_000_000)
    state = fake_shapes(1_235_814_400, 1_235_814_400)
    line = compiled.out_of_memory(TPU_OOM, state, oom_args(), None)
    assert "\n" not in line
    assert line.startswith(
        "out of memory: the step needs 17.51 GB a device, the device has 15.75 GB "
        "(weights, gradients and optimizer state 19.77 GB); try --moments bfloat16"
    )
    assert "--offload optimizer" in line and "--remat full" in line
    assert line.endswith(f"[{TPU_OOM}]")
    small = fake_shapes(250_000_000, 250_000_000)  # 1 GB weights, 2 GB of moments
    line = compiled.out_of_memory(TPU_TEMPORARIES, small, oom_args(remat="full"), None)
    # 18.67 GiB of temporaries + 3 GB of arguments; 4 GB of state, 5 with the sum; the
    # rest, 19.05 GB: halved, 14.5 GB in all, over 90% of 15.75 GB; quartered, 9.8 GB
    assert "needs 23.05 GB a device" in line and "try --grad-accum 4 [" in line


def test_a_step_that_does_not_fit_stops_the_recipe_in_one_line(monkeypatch, capsys):
    """train.py's main: the compiler's RESOURCE_EXHAUSTED becomes exit status 2 and one
    line on stderr, not a traceback (the same path as a TPU's, with the error raised
    where the first step compiles)."""

    def refuse(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(TPU_OOM)

    monkeypatch.setattr(train, "train", refuse)
    with pytest.raises(SystemExit) as stop:
        train.main(["--model", "tiny", "--mesh", "data=8", "--steps", "1"])
    assert stop.value.code.startswith("out of memory: the step needs 17.51 GB a device")


def test_peak_memory_counts_the_compiled_steps_where_memory_stats_leaves_them_out():
    """A TPU's memory_stats() left the program's temporaries out (1.54 GB at a batch of
    16 and of 64): the line gives the larger of it and a compiled step's arguments,
    temporaries and new outputs."""

    class Device:
        def memory_stats(self):
            return {"peak_bytes_in_use": 1_540_000_000, "bytes_limit": 16_910_000_000}

    step = SimpleNamespace(
        argument_size_in_bytes=4_000_000_000,
        temp_size_in_bytes=9_000_000_000,
        output_size_in_bytes=4_000_000_000,
        alias_size_in_bytes=3_900_000_000,
    )
    assert compiled.program_total(step) == 13_100_000_000
    assert metrics.peak_memory([Device()], [compiled.program_total(step)]) == (
        "peak memory per device 13.10 GB (of 16.91 GB JAX may use; memory_stats() "
        "1.54 GB, the compiled step 13.10 GB)"
    )
    assert metrics.peak_memory([Device()]) == (
        "peak memory per device 1.54 GB (of 16.91 GB JAX may use; memory_stats() 1.54 GB)"
    )
    assert train.steps_memory([None], None, None, None) == []  # XLA:CPU counts nothing


def test_the_head_loss_chunks_the_vocabulary_of_a_1b_batch():
    """fused_cross_entropy at 1b's vocabulary, a batch of 8 x 2,048 on one device: 32
    chunks; the temporaries of its gradient are under a quarter of all the logits'
    (XLA:CPU measured 22.1 GB whole, 4.7 GB in 32 chunks)."""
    x = jax.ShapeDtypeStruct((8, 2048, 2048), jnp.bfloat16)
    head = {"w": jax.ShapeDtypeStruct((2048, 128_256), jnp.bfloat16)}
    targets = jnp.zeros((8, 2048), jnp.int32)

    def temporaries(chunks: int) -> int:
        def loss(head, x):
            logits = lambda h, x: x @ h["w"]
            return loss_lib.fused_cross_entropy(logits, head, x, targets, chunks)

        program = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(head, x).compile()
        return program.memory_analysis().temp_size_in_bytes

    chunks = loss_lib.loss_chunks(8 * 2048, 2048, 128_256, 1)
    assert chunks == 32
    assert temporaries(chunks) < temporaries(1) / 4


def test_compile_only_names_the_largest_batch_that_fits(monkeypatch, capsys):
    """Where the devices say how much memory JAX may use (a GPU's or a TPU's; faked
    here), --compile-only compiles the step at the batch asked for and at half of it and
    names the largest --global-batch within that memory, on the straight line through
    the two totals: here room for 3.5 rows a device more than 8, so 11 a device."""
    argv = ["--model", "tiny", "--mesh", "data=8", "--seq-len", "128"]
    totals = {}
    for batch in (64, 32):
        args = train.parse_args([*argv, "--global-batch", str(batch)])
        mesh, _, _, step, shapes, _ = train.setup(args)
        totals[batch] = compiled.step_bytes(step, shapes, args, mesh)
    limit = int(totals[64] + 3.5 * (totals[64] - totals[32]) / 4)
    monkeypatch.setattr(compiled, "memory_limit", lambda: limit)
    train.main([*argv, "--global-batch", "64", "--compile-only"])
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (
        f"the largest batch that fits ({limit / 1e9:.2f} GB): --global-batch 88 "
        "--grad-accum 1"
    )
