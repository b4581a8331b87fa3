"""oom: chapter 01_why_distribute's arithmetic as a pre-flight, and the out-of-memory levers measured on compiled steps."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, memory, oom, zero
from jaxdist_lessons.tables import human_bytes

N = jax.device_count()


@pytest.fixture(scope="module")
def auto():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def test_fits_uses_chapter_1_arithmetic():
    gpt3 = memory.transformer_params(
        num_layers=96, hidden=12288, vocab_size=50257, seq_len=2048
    )
    one = oom.fits(gpt3, 1, "H100 80GB")
    assert one.needed == 16 * gpt3 and not one.ok
    sharded = oom.fits(gpt3, 64, "H100 80GB", strategy="fsdp")
    assert sharded.needed == pytest.approx(16 * gpt3 / 64) and sharded.ok
    assert sharded.check() is sharded
    with pytest.raises(
        oom.OutOfMemoryError, match="does NOT fit in 80.0 GB.*Largest parts: optimizer"
    ):
        one.check()
    assert (
        oom.fits(1e9, 8, 40e9, strategy="data", activation_bytes=8e9).parts[
            "activations"
        ]
        == 1e9
    )
    with pytest.raises(ValueError, match="reports no memory limit"):
        oom.fits(1e6, 1, jax.devices()[0])
    with pytest.raises(ValueError, match="positive integer"):
        oom.fits(1e6, 0, 1e9)


def test_strategy_table_lists_fits_for_every_strategy():
    gpt3 = memory.transformer_params(
        num_layers=96, hidden=12288, vocab_size=50257, seq_len=2048
    )
    table = oom.strategy_table(gpt3, 64, "H100 80GB", title="GPT-3")
    assert [row[0] for row in table.rows] == list(memory.STRATEGIES)
    by_strategy = {row[0]: row for row in table.rows}
    fsdp = oom.fits(gpt3, 64, "H100 80GB", strategy="fsdp")
    assert by_strategy["fsdp"][1:] == [
        human_bytes(fsdp.needed),
        human_bytes(fsdp.budget),
        "yes",
    ]
    assert by_strategy["data"][3] == "no"  # 16 bytes per parameter on every device
    mixed = oom.strategy_table(gpt3, 64, "H100 80GB", precision="mixed")
    assert mixed.rows[0][1] == human_bytes(
        oom.fits(gpt3, 64, "H100 80GB", "replicated", precision="mixed").needed
    )


def test_compiled_fits_reads_the_compilers_figures(auto):
    stats = oom.step_memory(oom.Lever(per_device_batch=64), auto)
    fit = oom.compiled_fits(stats, 1e9)
    assert fit.needed == stats.live_bytes and fit.ok
    assert not oom.compiled_fits(stats, stats.live_bytes - 1).ok


def test_each_lever_lowers_what_it_should(auto):
    base = oom.step_memory(oom.Lever(), auto)
    half = oom.step_memory(oom.Lever(per_device_batch=512), auto)
    remat = oom.step_memory(oom.Lever(remat=True), auto)
    donated = oom.step_memory(oom.Lever(donate=True), auto)
    bf16 = oom.step_memory(oom.Lever(dtype="bfloat16"), auto)
    assert half.temp_bytes < base.temp_bytes and remat.temp_bytes < base.temp_bytes
    assert (
        donated.alias_bytes >= base.output_bytes - 1024
        and donated.live_bytes < base.live_bytes
    )
    # bf16 halves the state (XLA:CPU still computes bf16 matmuls in f32, so not the temporaries)
    assert bf16.output_bytes == pytest.approx(base.output_bytes / 2, rel=1e-3)
    if N > 1:
        lever = oom.Lever(shard_state=True)
        sharded = oom.step_memory(lever, auto)
        # the state (params and Adam's moments) is what the step outputs; only what zero.fsdp_spec cannot
        # split (Adam's step count, and the 10-way head's bias unless N divides 10) stays whole
        assert (
            base.output_bytes / N < sharded.output_bytes < base.output_bytes / N * 1.01
        )
        # the arguments are the state and this device's slice of the batch: the state is what zero's theory says
        batch_bytes = comms.tree_bytes(oom.lever_batch(lever, auto)) // N
        assert sharded.argument_bytes - batch_bytes == zero.expected_state_bytes(
            "fsdp", *oom.lever_state(lever), N
        )
        assert base.argument_bytes - batch_bytes == comms.tree_bytes(
            oom.lever_state(oom.Lever())
        )


def test_custom_prng_changes_the_key_type_not_the_memory(auto):
    shape = (16 * N, 256)
    plain, plain_type = oom.random_init_memory(shape, auto, P("data"))
    with jax.enable_custom_prng(True):
        custom, custom_type = oom.random_init_memory(shape, auto, P("data"))
    assert (plain_type, custom_type) == ("uint32[2]", "key<fry>[]")
    assert plain == custom


@pytest.mark.skipif(N < 4, reason="compares meshes of 2 and 4 devices")
def test_threefry_partitionable_keeps_temporaries_flat_as_devices_grow():
    temps = {}
    for k in (2, 4):
        submesh = jax.make_mesh(
            (k,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:k]
        )
        on, _ = oom.random_init_memory((16 * k, 256), submesh, P("data"))
        with jax.threefry_partitionable(False):
            off, _ = oom.random_init_memory((16 * k, 256), submesh, P("data"))
        temps[k] = on.temp_bytes, off.temp_bytes
    assert temps[2][0] == temps[4][0]  # partitionable: depends on the shard only
    assert temps[4][1] > temps[2][1] and temps[4][1] > temps[4][0]
    # on two devices the old scheme needs fewer temporaries
    assert temps[2][1] < temps[2][0]
    # the context manager restored the default
    assert jax.config.jax_threefry_partitionable


def test_threefry_partitionable_changes_the_numbers():
    draw = jax.jit(lambda key: jax.random.normal(key, (4 * N, 4)))
    new = draw(jax.random.key(0))
    with jax.threefry_partitionable(False):
        old = draw(jax.random.key(0))
    assert not np.array_equal(new, old)
