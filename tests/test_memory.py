"""Memory arithmetic against values worked by hand (and a real Flax layer)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxdist_lessons import hardware, memory

GPT3 = dict(num_layers=96, hidden=12288, vocab_size=50257, seq_len=2048)


def test_article_gpt3_weights_fp32_is_700_gb():
    assert memory.weights_bytes(175e9, "fp32") == 700e9
    assert memory.weights_bytes(175e9, "fp32") / hardware.GiB == pytest.approx(
        651.925, abs=1e-3
    )


@pytest.mark.parametrize(
    "optimizer, precision, per_param",
    [
        ("adam", "fp32", 16),  # 4 weights + 4 grads + 2 x 4 moments
        # 2 bf16 weights + 2 bf16 grads + 4 fp32 master + 2 x 4 moments
        ("adam", "mixed", 16),
        ("adam", "bf16", 8),
        ("momentum", "fp32", 12),
        ("sgd", "fp32", 8),
        ("sgd", "mixed", 8),
    ],
)
def test_bytes_per_param(optimizer, precision, per_param):
    assert memory.bytes_per_param(optimizer, precision) == per_param


def test_gpt3_training_with_adam_is_2_8_tb():
    state = memory.training_state_bytes(175e9, "adam", "fp32")
    assert (state.params, state.grads, state.optimizer, state.master) == (
        700e9,
        700e9,
        1400e9,
        0,
    )
    assert state.total == 2.8e12
    mixed = memory.training_state_bytes(175e9, "adam", "mixed")
    assert (mixed.params, mixed.grads, mixed.optimizer, mixed.master) == (
        350e9,
        350e9,
        1400e9,
        700e9,
    )
    assert mixed.total == 2.8e12


def test_gpt3_parameter_count_by_hand():
    # 96 x (12 h^2 + 13 h) + vocab x h + positions x h + final LayerNorm 2h, with h = 12288
    by_hand = (
        96 * (12 * 150_994_944 + 13 * 12288) + 50257 * 12288 + 2048 * 12288 + 2 * 12288
    )
    assert by_hand == 174_604_259_328
    assert memory.transformer_params(**GPT3) == by_hand


class GPTLayer(nn.Module):
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x))
        h = nn.Dense(4 * self.hidden)(nn.LayerNorm()(x))
        return x + nn.Dense(self.hidden)(nn.gelu(h))


def test_transformer_layer_params_match_a_flax_layer():
    hidden = 256
    variables = jax.eval_shape(
        GPTLayer(hidden, heads=8).init, jax.random.key(0), jnp.ones((1, 16, hidden))
    )
    counted = sum(x.size for x in jax.tree.leaves(variables))
    assert (
        memory.transformer_layer_params(hidden)
        == counted
        == 12 * hidden**2 + 13 * hidden
    )


def test_transformer_layer_activations_gpt3():
    # s b h (34 + 5 a s / h) = 2048 * 12288 * (34 + 80)
    assert (
        memory.transformer_layer_activation_bytes(2048, 1, 12288, 96)
        == 2048 * 12288 * 114
        == 2_868_903_936
    )
    assert (
        memory.transformer_layer_activation_bytes(
            2048, 1, 12288, 96, flash_attention=True
        )
        == 2048 * 12288 * 34
    )
    assert (
        memory.transformer_layer_activation_bytes(2048, 8, 12288, 96)
        == 8 * 2_868_903_936
    )


@pytest.mark.parametrize(
    "stage_sizes, bottleneck, published",
    [
        ((2, 2, 2, 2), False, 11_689_512),  # ResNet18
        ((3, 4, 6, 3), False, 21_797_672),  # ResNet34
        ((3, 4, 6, 3), True, 25_557_032),  # ResNet50
        ((3, 4, 23, 3), True, 44_549_160),  # ResNet101
        ((3, 8, 36, 3), True, 60_192_808),  # ResNet152
    ],
)
def test_resnet_parameter_counts_match_the_published_ones(
    stage_sizes, bottleneck, published
):
    assert (
        memory.resnet_params(
            stage_sizes=stage_sizes, bottleneck=bottleneck, num_classes=1000
        )
        == published
    )


def test_resnet50_head_and_stem_by_hand():
    layers = memory.resnet_layers()
    assert layers[-1].params == 2048 * 1000 + 1000
    stem = layers[:4]  # conv 7x7/2, BatchNorm, ReLU at 112x112x64; max-pool to 56x56x64
    assert [layer.output_elements for layer in stem] == [112 * 112 * 64] * 3 + [
        56 * 56 * 64
    ]
    assert stem[0].params == 7 * 7 * 3 * 64 and stem[1].params == 2 * 64


def test_resnet_activations_scale_with_batch_resolution_and_dtype():
    one = memory.resnet_activation_bytes(1, 224, "fp32")
    assert memory.resnet_activation_bytes(32, 224, "fp32") == 32 * one
    assert memory.resnet_activation_bytes(1, 224, "bf16") == one / 2
    # every feature map is (image_size / stride)^2 pixels, except the 1x1 head
    assert memory.resnet_activation_bytes(1, 448, "fp32") == pytest.approx(
        4 * one, rel=1e-4
    )


def test_per_device_shares_of_a_7b_model_on_8_devices():
    state = memory.training_state_bytes(7e9, "adam", "fp32")
    full = memory.TrainingMemory(**{**state.__dict__, "activations": 80e9})
    assert memory.per_device(full, "replicated", 8).total == 112e9 + 80e9
    assert memory.per_device(full, "data", 8).as_dict() == {
        "params": 28e9,
        "grads": 28e9,
        "optimizer": 56e9,
        "master": 0,
        "activations": 10e9,
        "total": 122e9,
    }
    assert memory.per_device(full, "zero1", 8).total == 28e9 + 28e9 + 7e9 + 10e9
    assert memory.per_device(full, "zero2", 8).total == 28e9 + 3.5e9 + 7e9 + 10e9
    assert memory.per_device(full, "fsdp", 8).total == 14e9 + 10e9
    assert memory.per_device(full, "tensor", 8).total == 14e9 + 80e9


def test_devices_needed():
    adam = memory.training_state_bytes(175e9).total
    assert memory.devices_needed(adam, "H100 80GB") == 35
    assert memory.devices_needed(adam, "A100 40GB") == 70
    assert memory.devices_needed(700e9, "H100 80GB") == 9  # 8.75
    assert memory.devices_needed(adam, "TPU v4") == 82  # 2.8e12 / 32 GiB = 81.5
    assert memory.devices_needed(adam, "H100 80GB", usable_fraction=0.75) == 47
    assert memory.devices_needed(1, "TPU v5e") == 1
    assert memory.devices_needed(adam, "TPU v5p") == 28  # 2.8e12 / 95 GiB = 27.4


def test_devices_needed_table_has_one_row_per_memory_size_and_each_chip_once():
    table = memory.devices_needed_table(
        {"Adam": memory.training_state_bytes(175e9).total}
    )
    names = [row[0] for row in table.values]
    assert names == [
        "TPU v5e",
        "TPU v6e",  # 32 GB, a little less than a v4's 32 GiB
        "TPU v4",
        "A100 40GB",
        "A100 80GB / H100 80GB",  # the same memory, the same count: one row
        "TPU v5p",
        "H200 141GB",
        "B200",
    ]
    # a PCIe card is its SXM chip's twin
    assert not any("PCIe" in name for name in names)
    assert [row[2] for row in table.values] == [175, 88, 82, 70, 35, 28, 20, 16]
    # no two rows alike
    assert len({tuple(row[1:3]) for row in table.values}) == len(names)
    assert table.values[4][-1] == (
        "https://www.nvidia.com/en-us/data-center/a100/, "
        "https://www.nvidia.com/en-us/data-center/h100/"
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: memory.weights_bytes(-1),
            "num_params must be a non-negative number, got -1",
        ),
        (
            lambda: memory.weights_bytes(10, "fp64"),
            "unknown dtype 'fp64'; allowed: bf16, bfloat16, float16, float32, fp16, fp32, fp8, int8",
        ),
        (
            lambda: memory.training_state_bytes(10, "adagrad"),
            "unknown optimizer 'adagrad'; allowed: adam, momentum, sgd",
        ),
        (
            lambda: memory.training_state_bytes(10, precision="fp64"),
            "unknown precision 'fp64'; allowed: bf16, fp32, mixed",
        ),
        (
            lambda: memory.per_device(memory.training_state_bytes(1), "pipeline", 8),
            "unknown strategy 'pipeline'; allowed: data, fsdp, replicated, tensor, zero1, zero2",
        ),
        (
            lambda: memory.per_device(memory.training_state_bytes(1), "data", 0),
            "num_devices must be a positive integer, got 0",
        ),
        (
            lambda: memory.devices_needed(1e9, "V100"),
            "unknown accelerator 'V100'; allowed: A100 40GB, A100 40GB PCIe, A100 80GB, A100 80GB PCIe, B200, H100 80GB, H100 PCIe, H200 141GB, TPU v4, TPU v5e, TPU v5p, TPU v6e",
        ),
        (
            lambda: memory.devices_needed(1e9, "TPU v4", usable_fraction=0),
            "usable_fraction must be in (0, 1], got 0",
        ),
        (
            lambda: memory.resnet_layers(image_size=100),
            "image_size must be a positive multiple of 32, got 100",
        ),
        (
            lambda: memory.transformer_layer_activation_bytes(-5, 1, 8, 2),
            "seq_len must be a non-negative number, got -5",
        ),
    ],
)
def test_bad_input_names_what_is_allowed(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message
