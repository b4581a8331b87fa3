"""Measuring speed: wall-clock time per call, flops utilisation, and the strategy benchmark (chapter 06_performance).

- ``time_per_call``: median wall-clock seconds per call, for benchmarks only (never in tests);
- ``mfu``: flops utilisation against a chip's peak (``hardware.peak_flops``);
- ``strategy_table``: one table per strategy of ``zero`` for a ``Workload``: collective bytes
  measured against expected, memory per device, step time and throughput. ``benchmarks/``
  prints them on real hardware; chapter 06_performance shows them on simulated devices.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, compiled, sharding, zero
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.gradients import loss_fn
from jaxdist_lessons.models import transformer
from jaxdist_lessons.models.small import MLP
from jaxdist_lessons.tables import Table


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


def _placed(
    strategy: str, params: Any, opt_state: Any, mesh: Mesh, axis: str = "data"
) -> tuple[Any, Any]:
    """New copies of the state, sharded as ``strategy`` keeps it (``zero.copy_to``)."""
    specs = zero.state_specs(strategy, params, opt_state, mesh, axis)
    return zero.copy_to((params, opt_state), specs, mesh)


def strategy_table(
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
    params, opt_state = _placed(strategy, work.params, tx.init(work.params), mesh, axis)
    batch = jax.device_put(work.batch, NamedSharding(mesh, P(axis)))
    program = step.lower(params, opt_state, batch).compile()
    return compiled_strategy_table(
        strategy, work, program, (params, opt_state), batch, mesh.shape[axis], calls
    )


def compiled_strategy_table(
    strategy: str,
    work: Workload,
    program: jax.stages.Compiled,
    state: tuple[Any, Any],
    batch: Any,
    num_devices: int,
    calls: int = 5,
) -> Table:
    """``strategy_table`` for a step already compiled by ``zero.make_step``; it donates (so consumes) ``state``."""
    n = num_devices
    measured = comms.bytes_by_kind(program.as_text())
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


def compile_strategies(
    works: Sequence[Workload], tx: optax.GradientTransformation, mesh: Mesh
) -> dict[tuple[str, str], tuple[jax.stages.Compiled, tuple[Any, Any]]]:
    """Each workload's step under each of ``zero.ZERO_STAGES``, compiled, with its placed state.

    Keys are ``(work.name, strategy)``; the state is what the donating program consumes when it runs.
    """
    programs = {}
    for work in works:
        batch = jax.device_put(work.batch, NamedSharding(mesh, P("data")))
        opt_shape = jax.eval_shape(tx.init, work.params)
        for strategy in zero.ZERO_STAGES:
            step = zero.make_step(
                strategy, work.loss_fn, tx, mesh, work.params, opt_shape
            )
            state = _placed(strategy, work.params, tx.init(work.params), mesh)
            programs[work.name, strategy] = (step.lower(*state, batch).compile(), state)
    return programs


def collectives_table(
    programs: Mapping[tuple[str, str], tuple[jax.stages.Compiled, Any]],
    works: Sequence[Workload],
    num_devices: int,
) -> Table:
    """Collective bytes per device of each program of ``compile_strategies``, against ``zero``'s theory."""
    rows = []
    for (name, strategy), (program, _) in programs.items():
        params = next(w.params for w in works if w.name == name)
        measured = comms.bytes_by_kind(program.as_text())
        expected = zero.expected_collectives(strategy, params, num_devices)
        rows.append(
            [
                name,
                strategy,
                *(measured.get(kind, 0) for kind in comms.KINDS[:3]),
                "yes" if measured == expected else f"no: {expected}",
                zero.ring_bytes_sent(strategy, params, num_devices),
            ]
        )
    headers = [
        "model",
        "strategy",
        *comms.KINDS[:3],
        "= theory",
        "ring bytes sent per device",
    ]
    title = f"Collective bytes per device, read from the compiled programs ({num_devices} devices)"
    return Table(headers, rows, title=title)


def ring_table(works: Sequence[Workload], num_devices: int) -> Table:
    """Ring bytes each device sends per step: data parallel, ``make_step``'s FSDP, and FSDP gathering again."""
    rows = []
    for work in works:
        data_bytes = zero.ring_bytes_sent("data", work.params, num_devices)
        ours = zero.ring_bytes_sent("fsdp", work.params, num_devices)
        again = zero.regathering_fsdp_ring_bytes(work.params, num_devices)
        rows.append([work.name, data_bytes, ours, again, again / data_bytes])
    headers = [
        "model",
        "data parallel",
        "this FSDP step",
        "FSDP gathering again in backward",
    ]
    title = f"Ring bytes sent per device per step, {num_devices} devices"
    return Table([*headers, "that / data parallel"], rows, title=title)


def memory_table(
    programs: Mapping[tuple[str, str], tuple[jax.stages.Compiled, Any]],
    works: Sequence[Workload],
    tx: optax.GradientTransformation,
    num_devices: int,
) -> Table:
    """State per device (held and theory's), compiled arguments, temporaries and live bytes of each program."""
    rows = []
    for (name, strategy), (program, state) in programs.items():
        params = next(w.params for w in works if w.name == name)
        stats = compiled.stats(program)
        expected = zero.expected_state_bytes(
            strategy, params, jax.eval_shape(tx.init, params), num_devices
        )
        held = max(sharding.bytes_per_device(state).values())
        row = [name, strategy, held, expected, stats.argument_bytes]
        rows.append([*row, stats.temp_bytes, stats.live_bytes])
    headers = ["model", "strategy", "state per device", "theory", "compiled arguments"]
    title = f"Adam state, {num_devices} devices (bytes per device)"
    return Table([*headers, "temporaries", "live"], rows, title=title)


def environment() -> str:
    """One line naming the machine, the versions, XLA_FLAGS (when set) and the date, to print
    beside a benchmark table."""
    device = jax.devices()[0]
    flags = os.environ.get("XLA_FLAGS", "").strip()
    return (
        f"{len(jax.devices())} x {device.device_kind} ({device.platform}); host {platform.machine()} "
        f"{platform.processor() or platform.system()}; python {platform.python_version()}, jax {jax.__version__}, "
        f"flax {flax.__version__}, optax {optax.__version__}, numpy {np.__version__}; "
        + (f"XLA_FLAGS={flags}; " if flags else "")
        + f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    )


def provenance() -> dict[str, str]:
    """Where and when numbers were measured, as the fields of a benchmark's data file: the
    date (UTC), the first device's kind and platform, the JAX version and ``XLA_FLAGS``."""
    device = jax.devices()[0]
    return {
        "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}",
        "device_kind": device.device_kind,
        "platform": device.platform,
        "jax_version": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
