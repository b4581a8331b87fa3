"""Measuring performance tips on the compiled program, and benchmarking strategies (chapter 6).

- ``op_counts`` / ``instruction_count``: what XLA's program is made of (fusions, dots, calls);
- ``saved_residuals``: what autodiff keeps from the forward pass for the backward pass, in
  bytes, read from ``jax.ad_checkpoint.print_saved_residuals`` (JAX's only public view of it);
- ``memory_row`` / ``memory_report``: compiled programs' memory per device (``memory_analysis()``).
  Read the *live* bytes (arguments + outputs + temporaries - aliased) and the temporaries: XLA's
  own peak figure on XLA:CPU counts arguments and outputs only, not the temporaries;
- ``time_per_call``: wall-clock seconds per call, for benchmarks only (never in tests);
- ``mfu``: flops utilisation, with ``PEAK_BF16_FLOPS`` for common accelerators;
- ``benchmark``: one table per strategy of ``zero`` (collectives measured against expected,
  memory, speed) for a ``Workload``, which ``benchmarks/strategies.py`` prints and chapter 6 shows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import io
import math
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.ad_checkpoint
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, compiled, sharding, zero
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.gradients import MLP, loss_fn
from jaxdist_lessons.models import transformer
from jaxdist_lessons.tables import Table

_OPCODE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[^\s=]+\s*=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9\-]*)\("
)


def op_counts(hlo_text: str) -> collections.Counter:
    """How many instructions of each opcode (``fusion``, ``dot``, ``all-reduce``, ...) an HLO text holds, in all computations."""
    return collections.Counter(
        m[1] for line in hlo_text.splitlines() if (m := _OPCODE.match(line))
    )


def instruction_count(hlo_text: str) -> int:
    """All instructions of an HLO text: the size of the program."""
    return sum(op_counts(hlo_text).values())


def entry_op_counts(hlo_text: str) -> collections.Counter:
    """Opcodes of the entry computation only: what runs at the top level, each fusion counted once."""
    lines, inside = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            lines.append(line)
    return op_counts("\n".join(lines))


# --- What autodiff saves ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array kept from the forward pass for the backward pass."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source: str

    @property
    def is_argument(self) -> bool:
        """Whether it is one of the function's inputs (kept anyway, so it costs nothing extra)."""
        return self.source.startswith("from the argument")


# ``f32[64,256] output of ...``; on Explicit axes a sharded dimension reads ``64@data`` (still the global size).
_RESIDUAL = re.compile(r"^(?P<dtype>[a-z][a-z0-9_]*)\[(?P<dims>[^\]]*)\]\s+(?P<source>.*)$")


def _short_dtype_bytes(name: str) -> int:
    """Bytes of a dtype in JAX's short spelling (``f32``, ``bf16``, ``i32``, ``bool``)."""
    if name == "bool":
        return 1
    # JAX says i32 and f8_e4m3fn where HLO says s32 and f8e4m3fn
    hlo_name = ("s" + name[1:] if name.startswith("i") else name).replace("_", "")
    if hlo_name not in comms.DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r} in print_saved_residuals output")
    return comms.DTYPE_BYTES[hlo_name]


def saved_residuals(fn: Callable, *args: Any) -> list[Residual]:
    """The residuals ``jax.vjp(fn, *args)`` keeps, parsed from ``jax.ad_checkpoint.print_saved_residuals``.

    Shapes and bytes are global: on a mesh, each device keeps its shard of them.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    found = []
    for line in filter(None, map(str.strip, out.getvalue().splitlines())):
        m = _RESIDUAL.match(line)
        if (
            m is None
        ):  # every line is a residual: one we cannot read must not be dropped silently
            raise ValueError(f"cannot read this line of print_saved_residuals: {line!r}")
        shape = tuple(int(re.match(r"\d+", d)[0]) for d in m["dims"].split(",") if d)
        nbytes = math.prod(shape) * _short_dtype_bytes(m["dtype"])
        found.append(Residual(m["dtype"], shape, nbytes, m["source"]))
    return found


def residual_bytes(fn: Callable, *args: Any) -> int:
    """Bytes of the residuals that are not inputs: the activations the backward pass needs stored."""
    return sum(r.nbytes for r in saved_residuals(fn, *args) if not r.is_argument)


# --- Memory and time --------------------------------------------------------------------------


MEMORY_HEADERS = ["arguments", "outputs", "temporaries", "aliased", "live", "XLA peak"]


def memory_row(stats: compiled.CompiledStats) -> list[int]:
    """A compiled program's memory per device, as a row under ``MEMORY_HEADERS``."""
    return [
        stats.argument_bytes,
        stats.output_bytes,
        stats.temp_bytes,
        stats.alias_bytes,
        stats.live_bytes,
        stats.peak_bytes,
    ]


def memory_report(programs: Mapping[str, jax.stages.Compiled], title: str = "") -> Table:
    """A table of compiled programs' memory per device, one row per program, under ``MEMORY_HEADERS``.

    "live" bounds what the program holds at once; "XLA peak" is ``peak_memory_in_bytes``, which on
    XLA:CPU leaves the temporaries out (see ``compiled.CompiledStats.peak_bytes``).
    """
    return Table(
        ["program", *MEMORY_HEADERS],
        [
            [name, *memory_row(compiled.stats(program))]
            for name, program in programs.items()
        ],
        title=title,
    )


def time_per_call(call: Callable[[], Any], calls: int = 10, warmup: int = 2) -> float:
    """Median wall-clock seconds of ``call()`` (its result blocked on), after ``warmup`` untimed calls."""
    positive_int("calls", calls)
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- Model flops utilisation -----------------------------------------------------------------------

# Dense (not sparse) bf16 peak per chip, keyed by the exact ``device_kind`` string JAX reports, with
# the source of each figure. The kinds are CUDA's device names for GPUs and the TPU runtime's names
# for TPUs: a TPU v5e reports "TPU v5 lite" and a TPU v5p reports "TPU v5" (JAX's own table,
# jax/_src/pallas/mosaic/tpu_info.py, chip_version_from_device_kind). A kind that is not here (an
# H100 NVL, a "TPU v4 lite", a CPU) gets no peak: a near-miss would give a wrong utilisation.
PEAK_BF16_FLOPS: dict[str, tuple[float, str]] = {
    "NVIDIA A100-SXM4-40GB": (
        312e12,
        "NVIDIA A100 datasheet, SXM: 312 TFLOPS BF16 Tensor Core, dense",
    ),
    "NVIDIA A100-SXM4-80GB": (
        312e12,
        "NVIDIA A100 datasheet, SXM: 312 TFLOPS BF16 Tensor Core, dense",
    ),
    "NVIDIA A100-PCIE-40GB": (
        312e12,
        "NVIDIA A100 datasheet, PCIe: 312 TFLOPS BF16 Tensor Core, dense",
    ),
    "NVIDIA A100 80GB PCIe": (
        312e12,
        "NVIDIA A100 datasheet, PCIe: 312 TFLOPS BF16 Tensor Core, dense",
    ),
    "NVIDIA H100 80GB HBM3": (
        989e12,
        "NVIDIA H100 datasheet, H100 SXM: 1,979 TFLOPS BF16 with sparsity, so 989 dense",
    ),
    "NVIDIA H100 PCIe": (
        756e12,
        "NVIDIA H100 datasheet, H100 PCIe: 1,513 TFLOPS BF16 with sparsity, so 756 dense",
    ),
    "NVIDIA H200": (
        989e12,
        (
            "NVIDIA H200 datasheet, H200 SXM: 1,979 TFLOPS BF16 with sparsity, so 989 dense"
            " (an H200 NVL, with a lower peak, may report the same name: pass its own)"
        ),
    ),
    "TPU v4": (
        275e12,
        "Google Cloud TPU v4 docs (cloud.google.com/tpu/docs/v4): 275 TFLOPS bf16 per chip",
    ),
    "TPU v5 lite": (
        197e12,
        "Google Cloud TPU v5e docs (cloud.google.com/tpu/docs/v5e): 197 TFLOPS bf16 per chip",
    ),
    "TPU v5": (
        459e12,
        "Google Cloud TPU v5p docs (cloud.google.com/tpu/docs/v5p): 459 TFLOPS bf16 per chip",
    ),
}


def peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device kind (``jax.devices()[0].device_kind``), matched exactly; ``None`` if unknown."""
    entry = PEAK_BF16_FLOPS.get(device_kind)
    return None if entry is None else entry[0]


def mfu(flops_per_device: float, seconds: float, peak_flops_per_device: float) -> float:
    """Flops utilisation: ``flops_per_device`` done in ``seconds``, over what the device could do in that time.

    It is *model* flops utilisation only if ``flops_per_device`` counts the model's flops. XLA's
    ``cost_analysis()`` counts the program's, recomputation under remat included: with it, this is
    hardware flops utilisation, which remat inflates.
    """
    if seconds <= 0 or peak_flops_per_device <= 0:
        raise ValueError(
            f"seconds and peak flops must be positive, got {seconds!r} and {peak_flops_per_device!r}"
        )
    return flops_per_device / (seconds * peak_flops_per_device)


# --- Workloads and the strategy benchmark ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model to benchmark: its loss, parameters, one global batch, and what one batch counts (items of ``unit``).

    ``model`` is the Flax module, so that shapes can be read from it rather than repeated.
    """

    name: str
    loss_fn: Callable[[Any, Any], jax.Array]
    params: Any
    batch: Any
    items: int
    unit: str
    model: Any = None


def mlp_workload(
    num_devices: int,
    width: int = 256,
    depth: int = 3,
    per_device_batch: int = 32,
    in_features: int = 64,
    classes: int = 10,
) -> Workload:
    """An MLP classifier on random inputs; its last bias (``classes`` values) rarely divides over the devices."""
    model = MLP(features=(*[width] * depth, classes))
    batch_size = per_device_batch * num_devices
    images = jax.random.normal(jax.random.key(1), (batch_size, 1, 1, in_features))
    labels = jax.random.randint(jax.random.key(2), (batch_size,), 0, classes)
    params = jax.jit(model.init)(jax.random.key(0), images[:1])["params"]
    return Workload(
        "MLP",
        lambda p, b: loss_fn(model, p, {}, b)[0],
        params,
        (images, labels),
        batch_size,
        "images",
        model,
    )


def transformer_workload(
    num_devices: int,
    num_layers: int = 2,
    hidden: int = 64,
    num_heads: int = 4,
    vocab_size: int = 256,
    seq_len: int = 64,
    per_device_batch: int = 4,
) -> Workload:
    """A small decoder on random tokens; ``items`` counts the tokens predicted per step."""
    model = transformer.Decoder(
        vocab_size=vocab_size,
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        max_len=seq_len,
    )
    tokens = transformer.random_tokens(
        jax.random.key(1), per_device_batch * num_devices, seq_len + 1, vocab_size
    )
    params = jax.jit(model.init)(jax.random.key(0), tokens[:1, :-1])["params"]
    return Workload(
        "Transformer",
        lambda p, b: transformer.next_token_loss(model, p, b),
        params,
        tokens,
        tokens.shape[0] * seq_len,
        "tokens",
        model,
    )


def benchmark(
    strategy: str,
    work: Workload,
    mesh: Mesh,
    tx: optax.GradientTransformation | None = None,
    calls: int = 5,
    axis: str = "data",
) -> Table:
    """One table for one strategy: collective bytes measured and expected, memory per device, step time, throughput."""
    tx = optax.adam(1e-3) if tx is None else tx
    step = zero.make_step(
        strategy,
        work.loss_fn,
        tx,
        mesh,
        work.params,
        jax.eval_shape(tx.init, work.params),
        axis=axis,
    )
    params, opt_state = zero.place(strategy, work.params, tx.init(work.params), mesh, axis)
    batch = jax.device_put(work.batch, NamedSharding(mesh, P(axis)))
    program = step.lower(params, opt_state, batch).compile()
    return benchmark_compiled(
        strategy, work, program, (params, opt_state), batch, mesh.shape[axis], calls
    )


def benchmark_compiled(
    strategy: str,
    work: Workload,
    program: jax.stages.Compiled,
    state: tuple[Any, Any],
    batch: Any,
    num_devices: int,
    calls: int = 5,
) -> Table:
    """``benchmark`` for a step already compiled by ``zero.make_step``; it donates (so consumes) ``state``."""
    n = num_devices
    measured = {
        kind: row["bytes"] for kind, row in comms.summary(program.as_text()).items()
    }
    expected = zero.expected_collectives(strategy, work.params, n)
    rows = [
        [
            f"{kind} bytes",
            measured.get(kind, 0),
            expected.get(kind, 0),
            "yes" if measured.get(kind, 0) == expected.get(kind, 0) else "NO",
        ]
        for kind in sorted(set(measured) | set(expected))
    ]
    held = max(sharding.bytes_per_device(state).values())
    expected_held = zero.expected_state_bytes(strategy, work.params, state[1], n)
    rows.append(
        [
            "params + optimizer state per device",
            held,
            expected_held,
            "yes" if held == expected_held else "NO",
        ]
    )
    stats = compiled.stats(program)
    rows += [
        ["temporaries per device", stats.temp_bytes, "", ""],
        [
            "live bytes per device (args + outputs + temps - aliased)",
            stats.live_bytes,
            "",
            "",
        ],
        [
            "ring bytes sent per device",
            "",
            zero.ring_bytes_sent(strategy, work.params, n),
            "",
        ],
    ]
    current = list(state)

    def call():
        current[0], current[1], loss = program(current[0], current[1], batch)
        return loss

    seconds = time_per_call(call, calls=calls)
    rows += [
        ["step time (ms)", seconds * 1e3, "", ""],
        [f"{work.unit} per second", work.items / seconds, "", ""],
    ]
    return Table(
        ["", "measured", "expected", "equal"],
        rows,
        title=f"{work.name}, {strategy}, {n} {jax.devices()[0].platform.upper()} devices",
    )


def environment() -> str:
    """One line naming the machine, the versions and the date, to print beside a benchmark table."""
    device = jax.devices()[0]
    return (
        f"{len(jax.devices())} x {device.device_kind} ({device.platform}); host {platform.machine()} "
        f"{platform.processor() or platform.system()}; python {platform.python_version()}, jax {jax.__version__}, "
        f"flax {flax.__version__}, optax {optax.__version__}, numpy {np.__version__}; "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )
