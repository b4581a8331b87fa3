"""Out of memory, before it happens: does a training setup fit a device, and which levers help (chapter 07_troubleshooting).

- ``fits`` is chapter 01_why_distribute's arithmetic as a pre-flight: the bytes one device needs for a model,
  a strategy and a precision, against a chip's memory; ``compiled_fits`` does the same with the
  compiler's own figures for a program that exists;
- ``Lever`` and ``step_program`` / ``step_memory`` measure the levers (a smaller per-device
  batch, remat, sharded state, donation, bf16) on one Adam step of ``models.mlp.DeepMLP``, built
  with ``zero.make_step``'s data-parallel and FSDP steps, with ``memory_analysis()``;
- ``random_init_memory`` measures what the PRNG flags do to a sharded random initialisation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import compiled, gradients, hardware, memory, zero
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.models import mlp
from jaxdist_lessons.tables import Table, human_bytes


class OutOfMemoryError(RuntimeError):
    """``Fit.check()`` found that the bytes needed per device exceed the device's memory."""


def device_budget(device: Any, usable_fraction: float = 1.0) -> float:
    """A device's memory in bytes: a number, a chip name from ``hardware.CHIPS``, or a jax device.

    A jax device must report ``memory_stats()`` (GPUs and TPUs do; the CPU does not).
    """
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction!r}")
    if isinstance(device, str):
        return hardware.chip(device).memory_bytes * usable_fraction
    if isinstance(device, (int, float)) and not isinstance(device, bool):
        if device <= 0:
            raise ValueError(f"a device budget must be positive, got {device!r}")
        return float(device) * usable_fraction
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"{device} reports no memory limit (the CPU never does): pass the budget in bytes "
            "or an accelerator name such as 'H100 80GB'"
        )
    return stats["bytes_limit"] * usable_fraction


@dataclasses.dataclass(frozen=True)
class Fit:
    """Bytes one device needs against its budget, with the parts that make up the need."""

    needed: float
    budget: float
    parts: dict[str, float]
    what: str = ""

    @property
    def ok(self) -> bool:
        """Whether the need fits in the budget."""
        return self.needed <= self.budget

    @property
    def headroom(self) -> float:
        """Budget left over (negative when it does not fit)."""
        return self.budget - self.needed

    def __str__(self) -> str:
        verdict = "fits" if self.ok else "does NOT fit"
        return (
            f"{self.what + ': ' if self.what else ''}{human_bytes(self.needed)} per device {verdict} in "
            f"{human_bytes(self.budget)} (headroom {human_bytes(self.headroom)})"
        )

    def check(self) -> Fit:
        """``self`` if it fits; otherwise ``OutOfMemoryError`` with the largest parts and the levers."""
        if self.ok:
            return self
        parts = ", ".join(
            f"{k} {human_bytes(v)}"
            for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1])
            if v
        )
        raise OutOfMemoryError(
            f"{self}. Largest parts: {parts}. Levers: a smaller per-device batch or remat (activations), "
            "sharding the parameters, gradients and optimizer state (zero1/zero2/fsdp), donating the "
            "state to the step, bf16"
        )


def fits(
    num_params: float,
    devices: Mesh | int,
    budget: Any,
    strategy: str = "data",
    optimizer: str = "adam",
    precision: str = "fp32",
    activation_bytes: float = 0.0,
    usable_fraction: float = 1.0,
) -> Fit:
    """Chapter 01_why_distribute's arithmetic as a pre-flight: does training ``num_params`` with ``strategy`` fit per device?

    ``devices`` is a mesh (all its devices share the work) or a count; ``budget`` is bytes, an
    accelerator name or a jax device (``device_budget``); ``activation_bytes`` are for the
    global batch and are split as the strategy splits them.
    """
    count = (
        devices.size if isinstance(devices, Mesh) else positive_int("devices", devices)
    )
    state = memory.training_state_bytes(num_params, optimizer, precision)
    total = dataclasses.replace(state, activations=float(activation_bytes))
    share = memory.per_device(total, strategy, count)
    parts = {k: v for k, v in share.as_dict().items() if k != "total"}
    return Fit(
        share.total,
        device_budget(budget, usable_fraction),
        parts,
        what=f"{strategy} over {count} device{'s' if count > 1 else ''}, {optimizer}, {precision}",
    )


def strategy_table(
    num_params: float, devices: Mesh | int, budget: Any, title: str = "", **kwargs: Any
) -> Table:
    """``fits`` for every strategy of ``memory.STRATEGIES``: the need per device, the budget, and whether it fits.

    ``kwargs`` go to ``fits`` (optimizer, precision, activation_bytes...).
    """
    rows = []
    for strategy in memory.STRATEGIES:
        fit = fits(num_params, devices, budget, strategy=strategy, **kwargs)
        rows.append(
            [
                strategy,
                human_bytes(fit.needed),
                human_bytes(fit.budget),
                "yes" if fit.ok else "no",
            ]
        )
    return Table(["strategy", "needed per device", "budget", "fits"], rows, title=title)


def compiled_fits(
    stats: compiled.CompiledStats, budget: Any, usable_fraction: float = 1.0
) -> Fit:
    """The compiler's own figures for one device (arguments, outputs, temporaries, less aliasing) against a budget."""
    parts = {
        "arguments": stats.argument_bytes,
        "outputs": stats.output_bytes - stats.alias_bytes,
        "temporaries": stats.temp_bytes,
    }
    return Fit(
        stats.live_bytes,
        device_budget(budget, usable_fraction),
        parts,
        what="compiled program",
    )


@dataclasses.dataclass(frozen=True)
class Lever:
    """One training setup: per-device batch, remat, sharded state, donation, dtype."""

    per_device_batch: int = 1024
    remat: bool = False
    shard_state: bool = False
    donate: bool = False
    dtype: str = "float32"

    @property
    def strategy(self) -> str:
        """The ``zero`` strategy of the step: ``fsdp`` (state sharded by ``zero.fsdp_spec``) or ``data``."""
        return "fsdp" if self.shard_state else "data"


LEVER_OPTIMIZER = optax.adam(1e-3)


def lever_state(lever: Lever, width: int = 128, depth: int = 8) -> tuple[Any, Any]:
    """The shapes (``ShapeDtypeStruct``s, nothing allocated) of ``DeepMLP``'s parameters and Adam state."""
    dtype = jnp.dtype(lever.dtype)
    model = mlp.DeepMLP(width, depth, lever.remat, dtype)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.ones((1, width), dtype))["params"]
    )
    return params, jax.eval_shape(LEVER_OPTIMIZER.init, params)


def lever_batch(
    lever: Lever, mesh: Mesh, axis: str = "data", width: int = 128
) -> tuple[Any, Any]:
    """The shapes of one global batch (inputs, labels): ``per_device_batch`` rows for each device of ``axis``."""
    global_batch = (
        positive_int("per_device_batch", lever.per_device_batch) * mesh.shape[axis]
    )
    return (
        jax.ShapeDtypeStruct((global_batch, width), jnp.dtype(lever.dtype)),
        jax.ShapeDtypeStruct((global_batch,), jnp.int32),
    )


def step_program(
    lever: Lever, mesh: Mesh, axis: str = "data", width: int = 128, depth: int = 8
) -> jax.stages.Compiled:
    """Compile (never run) one Adam step of ``DeepMLP`` set up as ``lever`` says, with
    ``zero.make_step``."""
    model = mlp.DeepMLP(width, depth, lever.remat, jnp.dtype(lever.dtype))
    params, opt_state = lever_state(lever, width, depth)
    step = zero.make_step(
        lever.strategy,
        lambda p, batch: gradients.loss_fn(model, p, {}, batch)[0],
        LEVER_OPTIMIZER,
        mesh,
        params,
        opt_state,
        axis=axis,
        donate=lever.donate,
    )

    def placed(tree: Any, specs: Any) -> Any:
        return jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, spec)
            ),
            tree,
            specs,
        )

    return step.lower(
        placed(params, zero.param_specs(lever.strategy, params, mesh, axis)),
        placed(opt_state, zero.opt_state_specs(lever.strategy, opt_state, mesh, axis)),
        placed(lever_batch(lever, mesh, axis, width), (P(axis), P(axis))),
    ).compile()


def step_memory(
    lever: Lever, mesh: Mesh, axis: str = "data", width: int = 128, depth: int = 8
) -> compiled.CompiledStats:
    """The compiler's figures per device for ``step_program``: arguments, outputs, temporaries, aliasing."""
    return compiled.stats(step_program(lever, mesh, axis, width, depth))


def random_init_memory(
    shape: Sequence[int], mesh: Mesh, spec: P
) -> tuple[compiled.CompiledStats, str]:
    """Compile a sharded ``jax.random.normal`` init under the current PRNG flags: its figures and its key's type."""
    # the legacy constructor: its type is what jax_enable_custom_prng changes
    key = jax.random.PRNGKey(0)
    init = jax.jit(
        lambda k: jax.random.normal(k, tuple(shape)),
        out_shardings=NamedSharding(mesh, spec),
    )
    return compiled.compiled_stats(init, key), str(jax.typeof(key))
