"""Memory arithmetic for training: state, activations, per-device shares, devices needed.

Everything here is plain Python on counts and bytes, so it runs instantly for a
175-billion-parameter model. Later chapters compare these numbers with what the
compiler reports (``jaxdist_lessons.compiled``). Chips' memory sizes are ``hardware``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from jaxdist_lessons import hardware, hlo, strategies
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.tables import Table, human_bytes

# The dtype names the arithmetic accepts: those a training run stores (their sizes are hlo's).
DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "fp8", "int8")

# Optimizer state slots kept per parameter.
OPTIMIZER_SLOTS: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}

# How weights, gradients, optimizer state and an optional fp32 master copy are stored.
PRECISIONS: dict[str, dict[str, int]] = {
    "fp32": {"params": 4, "grads": 4, "optimizer_slot": 4, "master": 0},
    "bf16": {"params": 2, "grads": 2, "optimizer_slot": 2, "master": 0},
    # bf16 weights and gradients for compute, fp32 master weights and optimizer state.
    "mixed": {"params": 2, "grads": 2, "optimizer_slot": 4, "master": 4},
}

STRATEGIES = strategies.among("replicated", "data", "zero1", "zero2", "fsdp", "tensor")


def _check_count(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < 0
        or math.isnan(value)
    ):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")


def _lookup(table: dict, key: str, what: str):
    if key not in table:
        raise ValueError(f"unknown {what} {key!r}; allowed: {', '.join(sorted(table))}")
    return table[key]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``'fp32'`` or ``'bfloat16'`` (one of ``DTYPES``)."""
    _lookup(dict.fromkeys(DTYPES), dtype, "dtype")
    return hlo.dtype_bytes(dtype)


def weights_bytes(num_params: float, dtype: str = "fp32") -> float:
    """Bytes to store ``num_params`` weights in ``dtype``: the article's "700 GB" for GPT-3."""
    _check_count("num_params", num_params)
    return num_params * dtype_bytes(dtype)


@dataclasses.dataclass(frozen=True)
class TrainingMemory:
    """Bytes of each part of training memory, on one device or in total."""

    params: float
    grads: float
    optimizer: float
    master: float = 0.0
    activations: float = 0.0

    @property
    def state(self) -> float:
        """Everything but the activations: what sharding the training state can divide."""
        return self.params + self.grads + self.optimizer + self.master

    @property
    def total(self) -> float:
        """State and activations together."""
        return self.state + self.activations

    def as_dict(self) -> dict[str, float]:
        """Every part by name, and the total."""
        return {**dataclasses.asdict(self), "total": self.total}


def training_state_bytes(
    num_params: float, optimizer: str = "adam", precision: str = "fp32"
) -> TrainingMemory:
    """Bytes of weights, gradients, optimizer state and master weights for one model
    copy."""
    _check_count("num_params", num_params)
    slots = _lookup(OPTIMIZER_SLOTS, optimizer, "optimizer")
    p = _lookup(PRECISIONS, precision, "precision")
    return TrainingMemory(
        params=num_params * p["params"],
        grads=num_params * p["grads"],
        optimizer=num_params * slots * p["optimizer_slot"],
        master=num_params * p["master"],
    )


def bytes_per_param(optimizer: str = "adam", precision: str = "fp32") -> int:
    """Bytes of training state per parameter: 16 for Adam in fp32 or mixed precision."""
    return int(training_state_bytes(1, optimizer, precision).state)


def per_device(
    memory: TrainingMemory, strategy: str, num_devices: int
) -> TrainingMemory:
    """The share of ``memory`` (for the global batch) that each of ``num_devices`` devices holds.

    - ``replicated``: one device does everything (``num_devices`` is ignored).
    - ``data``: every device keeps the whole state; the batch, so the activations, is split.
    - ``zero1`` / ``zero2`` / ``fsdp``: like ``data``, plus the optimizer state (and master weights),
      then the gradients, then the weights are split too (ZeRO stages 1, 2, 3).
    - ``tensor``: every weight is split, so all the state is; each device still sees the whole
      batch, and we keep the activations whole (an upper bound: how much of them tensor
      parallelism splits depends on the layer).
    """
    positive_int("num_devices", num_devices)
    n = 1 if strategy == "replicated" else num_devices
    split = _lookup(_SPLIT, strategy, "strategy")
    return TrainingMemory(
        **{
            field: value / n if field in split else value
            for field, value in dataclasses.asdict(memory).items()
        }
    )


# Which parts of training memory each strategy divides among the devices.
_SPLIT = {
    "replicated": set(),
    "data": {"activations"},
    "zero1": {"activations", "optimizer", "master"},
    "zero2": {"activations", "optimizer", "master", "grads"},
    "fsdp": {"activations", "optimizer", "master", "grads", "params"},
    "tensor": {"optimizer", "master", "grads", "params"},
}


# --- Parameter counts -----------------------------------------------------------------------


def transformer_layer_params(hidden: int, mlp_ratio: int = 4) -> int:
    """Parameters of one GPT-style layer: QKV and output projections, a 2-layer MLP, two
    LayerNorms.

    With ``mlp_ratio=4`` this is ``12 h^2 + 13 h``.
    """
    _check_count("hidden", hidden)
    # Q, K, V and output projections, with biases
    attention = 4 * hidden * hidden + 4 * hidden
    mlp = 2 * mlp_ratio * hidden * hidden + mlp_ratio * hidden + hidden
    layer_norms = 2 * 2 * hidden  # scale and bias, twice
    return attention + mlp + layer_norms


def transformer_params(
    num_layers: int, hidden: int, vocab_size: int, seq_len: int, mlp_ratio: int = 4
) -> int:
    """Parameters of a GPT-style decoder: layers, token and position embeddings, final LayerNorm.

    The output projection is tied to the token embedding, as in GPT-2 and GPT-3.
    """
    for name, value in dict(
        num_layers=num_layers, vocab_size=vocab_size, seq_len=seq_len
    ).items():
        _check_count(name, value)
    embeddings = vocab_size * hidden + seq_len * hidden
    return (
        num_layers * transformer_layer_params(hidden, mlp_ratio)
        + embeddings
        + 2 * hidden
    )


# --- Activations ------------------------------------------------------------------------------


def transformer_layer_activation_bytes(
    seq_len: int, batch: int, hidden: int, heads: int, flash_attention: bool = False
) -> float:
    """Activation bytes one Transformer layer keeps for the backward pass, in 16-bit precision.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    eq. (1): ``s b h (34 + 5 a s / h)``, counting 2-byte activations and 1-byte dropout masks.
    The ``5 a s / h`` term is the attention scores and softmax; an attention kernel that
    recomputes them (FlashAttention) does not store it.
    """
    for name, value in dict(
        seq_len=seq_len, batch=batch, hidden=hidden, heads=heads
    ).items():
        _check_count(name, value)
    per_token = 34 * hidden + (0 if flash_attention else 5 * heads * seq_len)
    return seq_len * batch * per_token


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer of a network: its name, kind, trainable parameters and output elements per example."""

    name: str
    kind: str
    params: int
    output_elements: int


def _conv(name: str, c_in: int, c_out: int, k: int, size: int) -> list[Layer]:
    """A bias-free convolution followed by BatchNorm (scale and bias), as in ResNet."""
    out = size * size * c_out
    return [
        Layer(f"{name}/conv", "conv", k * k * c_in * c_out, out),
        Layer(f"{name}/bn", "bn", 2 * c_out, out),
    ]


def _relu(name: str, elements: int) -> Layer:
    return Layer(f"{name}/relu", "relu", 0, elements)


def resnet_layers(
    stage_sizes: Iterable[int] = (3, 4, 6, 3),
    bottleneck: bool = True,
    num_classes: int = 1000,
    image_size: int = 224,
    base_width: int = 64,
) -> list[Layer]:
    """The layers of a ResNet v1.5 (stride in the 3x3 convolution), with parameters and output sizes.

    ``(3, 4, 6, 3)`` with bottleneck blocks is ResNet50; ``(2, 2, 2, 2)`` with basic blocks is ResNet18.
    ``base_width`` is the stem's channel count (64 in the published models; the first stage widens from it).
    """
    stage_sizes = tuple(stage_sizes)
    if not stage_sizes or any(s < 1 for s in stage_sizes):
        raise ValueError(
            f"stage_sizes must be positive block counts, got {stage_sizes!r}"
        )
    if image_size < 32 or image_size % 32:
        raise ValueError(
            f"image_size must be a positive multiple of 32, got {image_size!r}"
        )
    size = image_size // 2
    layers = _conv("stem", 3, base_width, 7, size) + [
        _relu("stem", size * size * base_width)
    ]
    size //= 2
    layers.append(Layer("stem/maxpool", "pool", 0, size * size * base_width))
    c_in, expansion = base_width, (4 if bottleneck else 1)
    for stage, blocks in enumerate(stage_sizes):
        c_mid = base_width * 2**stage
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            name = f"stage{stage + 1}/block{block + 1}"
            in_size, size = size, size // stride
            c_out = c_mid * expansion
            if bottleneck:
                layers += _conv(f"{name}/conv1", c_in, c_mid, 1, in_size) + [
                    _relu(f"{name}/1", in_size**2 * c_mid)
                ]
                layers += _conv(f"{name}/conv2", c_mid, c_mid, 3, size) + [
                    _relu(f"{name}/2", size**2 * c_mid)
                ]
                layers += _conv(f"{name}/conv3", c_mid, c_out, 1, size)
            else:
                layers += _conv(f"{name}/conv1", c_in, c_mid, 3, size) + [
                    _relu(f"{name}/1", size**2 * c_mid)
                ]
                layers += _conv(f"{name}/conv2", c_mid, c_out, 3, size)
            if stride != 1 or c_in != c_out:
                layers += _conv(f"{name}/projection", c_in, c_out, 1, size)
            layers += [
                Layer(f"{name}/add", "add", 0, size**2 * c_out),
                _relu(f"{name}/out", size**2 * c_out),
            ]
            c_in = c_out
    layers.append(Layer("head/avgpool", "pool", 0, c_in))
    layers.append(
        Layer("head/dense", "dense", c_in * num_classes + num_classes, num_classes)
    )
    return layers


def resnet_params(**kwargs) -> int:
    """Trainable parameters of a ResNet (``resnet_layers`` arguments): 25,557,032 for ResNet50."""
    return sum(layer.params for layer in resnet_layers(**kwargs))


def resnet_activation_bytes(
    batch: int, image_size: int = 224, dtype: str = "fp32", **kwargs
) -> float:
    """Estimated activation bytes a ResNet keeps for backprop: every layer's output, stored once.

    Each convolution, BatchNorm, ReLU, residual add and pooling output is counted; the compiler
    may fuse some of them away or keep a few more, so treat this as an estimate.
    """
    _check_count("batch", batch)
    elements = sum(
        layer.output_elements
        for layer in resnet_layers(image_size=image_size, **kwargs)
    )
    return batch * elements * dtype_bytes(dtype)


# --- Devices ---------------------------------------------------------------------------------


def devices_needed(
    total_bytes: float, accelerator: str, usable_fraction: float = 1.0
) -> int:
    """The fewest chips called ``accelerator`` (``hardware.CHIPS``) whose memory holds ``total_bytes``,
    if it is split evenly (FSDP).

    ``usable_fraction`` leaves room for the runtime; for example JAX preallocates 75% of a GPU.
    """
    _check_count("total_bytes", total_bytes)
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction!r}")
    capacity = hardware.chip(accelerator).memory_bytes * usable_fraction
    return max(1, math.ceil(total_bytes / capacity))


# --- Tables -----------------------------------------------------------------------------------


def per_param_table() -> Table:
    """Bytes of training state per parameter, for every precision and optimizer."""
    rows = []
    for precision in PRECISIONS:
        for optimizer in OPTIMIZER_SLOTS:
            one = training_state_bytes(1, optimizer, precision)
            rows.append(
                [precision, optimizer, *dataclasses.astuple(one)[:4], one.state]
            )
    headers = ["weights", "grads", "optimizer state", "master", "bytes / param"]
    return Table(
        ["precision", "optimizer", *headers],
        rows,
        title="Training state per parameter, in bytes",
    )


def shares_table(shares: Mapping[str, TrainingMemory], title: str = "") -> Table:
    """Each strategy's share of training memory on one device (``per_device``'s results), part by part."""
    parts = [
        "weights",
        "grads",
        "optimizer",
        "master",
        "activations",
        "total per device",
    ]
    rows = [[s, *map(human_bytes, m.as_dict().values())] for s, m in shares.items()]
    return Table(["strategy", *parts], rows, title=title)


def devices_needed_table(totals: Mapping[str, float], title: str = "") -> Table:
    """The fewest chips that hold each total, one row per memory size in ``hardware.CHIPS``.

    Chips with the same memory need the same count, so they share a row (``hardware.by_memory``:
    each chip once, its PCIe card left out); the last column is the memory's source.
    """
    rows = []
    for chips in hardware.by_memory().values():
        sources = dict.fromkeys(c.sources["memory"].split(": ")[0] for c in chips)
        rows.append(
            [
                " / ".join(c.name for c in chips),
                chips[0].memory_label,
                *(devices_needed(total, chips[0].name) for total in totals.values()),
                ", ".join(sources),
            ]
        )
    return Table(["accelerator", "memory", *totals, "source"], rows, title=title)
