"""Troubleshooting distributed JAX: checks that fail early and clearly, ``explain``, ``fits``, a compile counter.

Chapter 7 reproduces the errors readers really meet. This module holds what a reader can
reuse afterwards:

- ``check_batch`` raises a clear error before JAX does when a batch cannot be sharded, and
  ``pad_batch`` / ``drop_remainder`` are the two fixes;
- ``explain(exc)`` maps a known JAX error to its cause and fix, and says plainly when it
  does not know one;
- ``fits`` is an out-of-memory pre-flight: chapter 1's arithmetic against a device's memory;
- ``count_compiles`` counts traces and compilations through ``jax.monitoring``, so a
  recompile on every step shows up as a number (or an error) instead of a slow loop;
- ``DeepMLP`` and ``step_program`` / ``step_memory`` measure the out-of-memory levers with
  ``memory_analysis()``, on ``zero.make_step``'s data-parallel and FSDP steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import compiled, gradients, memory, zero
from jaxdist_lessons import sharding as sharding_lib
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.tables import human_bytes

# --- Batches that do not divide ------------------------------------------------------------


class BatchError(sharding_lib.ShardingError):
    """A batch that cannot be sharded as asked; raised before JAX sees it, and names the fix."""


def _batch_ways(mesh: Mesh, spec: P) -> int:
    """How many pieces ``spec`` cuts the leading (batch) dimension into."""
    return (
        math.prod(mesh.shape[a] for a in sharding_lib._entry_axes(spec[0]))
        if len(spec)
        else 1
    )


def batch_size(batch: Any) -> int:
    """The leading (batch) size that every array of ``batch`` shares; ``BatchError`` if they differ or there are none."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise BatchError("the batch has no arrays in it")
    sizes = {
        sharding_lib.path_name(path) or "batch": np.shape(leaf)[0]
        if np.ndim(leaf)
        else None
        for path, leaf in leaves
    }
    scalars = [name for name, size in sizes.items() if size is None]
    if scalars:
        raise BatchError(
            f"every array of a batch needs a leading (batch) axis; {', '.join(scalars)} "
            f"{'is a scalar' if len(scalars) == 1 else 'are scalars'}"
        )
    if len(set(sizes.values())) > 1:
        raise BatchError(
            f"the arrays of a batch must share their leading (batch) size, got {sizes}"
        )
    return next(iter(sizes.values()))


def check_batch(batch: Any, mesh: Mesh, spec: P) -> None:
    """Raise ``BatchError`` unless every array in ``batch`` can be sharded with ``spec`` on ``mesh``.

    Every leaf must share one leading (batch) size, and the mesh axes in ``spec[0]`` must
    divide it. Other problems (an axis name not in the mesh, a spec longer than an array's
    rank) raise ``sharding.ShardingError`` naming the leaf.
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise BatchError("the batch has no arrays in it")
    if len(spec):
        batch_size(batch)  # a replicated batch (P()) may hold scalars
    ways = _batch_ways(mesh, spec) if _names_ok(mesh, spec) else 1
    for path, leaf in leaves:
        name = sharding_lib.path_name(path) or "batch"
        size = np.shape(leaf)[0] if np.ndim(leaf) >= len(spec) > 0 else None
        if size is not None and ways > 1 and size % ways:
            down, up = size // ways * ways, -(-size // ways) * ways
            raise BatchError(
                f"{name}: a batch of {size} does not split over the {ways} devices of mesh axes "
                f"{spec[0]!r} (mesh {dict(mesh.shape)}). Fix: pad it to {up} and mask the padding "
                f"(troubleshoot.pad_batch), or drop the remainder to {down} "
                "(troubleshoot.drop_remainder, or drop_remainder=True in the input pipeline)"
            )
        sharding_lib.check_spec(np.shape(leaf), mesh, spec, name=name)


def _names_ok(mesh: Mesh, spec: P) -> bool:
    return all(
        axis in mesh.shape for entry in spec for axis in sharding_lib._entry_axes(entry)
    )


def pad_batch(batch: Any, multiple: int) -> tuple[Any, np.ndarray]:
    """Pad every array's leading axis with zeros to a multiple of ``multiple``; return it and a 0/1 mask.

    Weight the loss by the mask so that the padded examples count for nothing. Every array must
    share one leading size (``BatchError`` otherwise).
    """
    positive_int("multiple", multiple)
    size = batch_size(batch)
    padded = -(-size // multiple) * multiple
    pad = lambda x: np.concatenate(
        [np.asarray(x), np.zeros((padded - size, *np.shape(x)[1:]), np.asarray(x).dtype)]
    )
    mask = (np.arange(padded) < size).astype(np.float32)
    return jax.tree.map(pad, batch), mask


def drop_remainder(batch: Any, multiple: int) -> Any:
    """Keep the largest leading slice of every array whose size is a multiple of ``multiple``."""
    positive_int("multiple", multiple)
    size = batch_size(batch)
    if size < multiple:
        raise BatchError(
            f"a batch of {size} has no full slice of {multiple}: nothing would be left"
        )
    return jax.tree.map(lambda x: x[: size // multiple * multiple], batch)


# --- explain(): a known error's cause and fix ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What went wrong and what to do, for one error; ``known`` is False when ``explain`` has no entry."""

    title: str
    cause: str
    fix: str
    known: bool = True

    def __str__(self) -> str:
        return f"{self.title}\n  cause: {self.cause}\n  fix:   {self.fix}"

    __repr__ = __str__


@dataclasses.dataclass(frozen=True)
class KnownError:
    """An entry of the catalogue: exception types, a pattern on the message, and cause and fix templates.

    The templates are filled from the pattern's named groups.
    """

    title: str
    types: tuple[type[BaseException], ...]
    pattern: str
    cause: str
    fix: str


class RecompileError(RuntimeError):
    """A jitted function compiled more often than allowed inside ``count_compiles(..., limit=...)``."""


_PMAP_FIX = (
    "reshape the batch to (devices, per_device, ...) (gradients.split_batch, after padding it to a "
    "multiple of the devices or dropping the remainder), replicate the parameters along a leading device "
    "axis, or better: use jax.jit with shardings"
)

# Patterns quote the real messages of jax 0.10.2: if an upgrade rewords one, the tests fail.
KNOWN_ERRORS: tuple[KnownError, ...] = (
    KnownError(  # before the general entry: pmap's IndivisibleError has another cause and fix
        "pmap: more rows than devices",
        (ValueError,),
        r"_internal_pmap_axis_name.*?implies that array axis 0 is partitioned (?P<ways>\d+) times, but the "
        r"dimension size is (?P<size>\d+)",
        "pmap maps its leading axis one row per device, so it takes at most {ways} rows (fewer run on the "
        "first devices); this array has {size}",
        _PMAP_FIX,
    ),
    KnownError(
        "batch does not divide by the devices (jit, device_put)",
        (ValueError,),
        r"implies that array axis (?P<axis>\d+) is partitioned (?P<ways>\d+) times, but (the dimension size is "
        r"|does not evenly divide the dimension size )(?P<size>\d+)",
        "array axis {axis} has size {size}, which {ways} devices cannot split evenly",
        "pad the batch to a multiple of {ways} and mask the padding (troubleshoot.pad_batch), or drop the "
        "remainder (drop_remainder=True in the input pipeline); check first with troubleshoot.check_batch",
    ),
    KnownError(
        "batch does not divide by the devices (shard_map)",
        (ValueError,),
        r"shard_map applied to the function .* not evenly divisible .*? but (?P<ways>\d+) does not evenly "
        r"divide (?P<size>\d+)",
        "an argument's axis of size {size} is mapped to mesh axes of size {ways} by in_specs",
        "pad the batch to a multiple of {ways} and mask the padding, or drop the remainder; or fix in_specs",
    ),
    KnownError(
        "pmap: more rows than devices",
        (ValueError,),
        r"cannot select an axis to squeeze out which has size not equal to one, got shape=(?P<shape>\([^)]*\))",
        "pmap maps its leading axis one row per device, so it takes at most as many rows as there are "
        "devices; this batch had a multiple of them, and each device got a block of shape {shape} instead "
        "of one row",
        _PMAP_FIX,
    ),
    KnownError(
        "spec names an axis the mesh does not have",
        (ValueError,),
        r"Resource axis: (?P<axis>\S+) of (?P<spec>.*) is not found in mesh: (?P<names>\(.*?\))",
        "the spec {spec} names mesh axis {axis!r}, but the mesh's axes are {names}",
        "use one of the mesh's axis names in the spec, or build the mesh with that axis",
    ),
    KnownError(
        "spec longer than the array's rank",
        (ValueError,),
        r"is only valid for values of rank at least (?P<need>\d+), but was applied to a value of rank (?P<rank>\d+)",
        "the spec has {need} entries, one per array dimension, but the array has rank {rank}",
        "give the spec at most {rank} entries (trailing dimensions may be left out: they are not split)",
    ),
    KnownError(
        "unbound axis name",
        (NameError,),
        r"(Found an unbound axis name|^unbound axis name): (?P<axis>[^\s.]+)",
        "a collective (psum, pmean, BatchNorm's axis_name...) names axis {axis!r}, but no enclosing pmap or "
        "shard_map binds that name; under jax.jit there are no named axes",
        "pass axis_name='{axis}' to pmap, or run the code inside jax.shard_map over a mesh with axis {axis!r}; "
        "under jit with shardings drop the collective (and BatchNorm's axis_name): the compiler inserts it",
    ),
    KnownError(
        "Explicit axes: output sharding is ambiguous",
        (),  # jax._src.core.ShardingTypeError, which jax does not export
        r"Please specify the output sharding via (the )?`out_sharding` parameter",
        "on a mesh with Explicit axes JAX will not guess how to shard this result (for example a matmul "
        "contracting over a sharded dimension)",
        "pass out_sharding=P(...) to the operation (jnp.matmul, jnp.einsum, lax.dot_general...), reshard an "
        "input first (jax.sharding.reshard), or make those mesh axes Auto",
    ),
    KnownError(
        "Explicit axes: illegally sharded result",
        (),
        r"produces an illegally sharded result: (?P<result>\S+)",
        "the result's type {result} would split two dimensions over the same mesh axis",
        "reshard one operand (jax.sharding.reshard) or pass out_sharding=P(...) to the operation",
    ),
    KnownError(
        "with_sharding_constraint on Explicit axes, without set_mesh",
        (ValueError,),
        r"with_sharding_constraint can only refer to Auto axes of the mesh",
        "with_sharding_constraint is a hint to the Auto-mode partitioner; outside jax.set_mesh it refuses "
        "a sharding on Explicit axes, which are part of the array's type",
        "use jax.sharding.reshard(x, P(...)) under jax.set_mesh(mesh), or make the mesh axes Auto",
    ),
    KnownError(
        "with_sharding_constraint on Explicit axes, under set_mesh",
        (AssertionError,),
        r"`with_sharding_constraint` acts as an assert when all axes of mesh are of type `Explicit`\. The array "
        r"sharding: (?P<have>.*?) did not match the sharding provided: (?P<want>.*?)\. Please use",
        "under jax.set_mesh on Explicit axes, with_sharding_constraint only checks that the array already has "
        "the sharding given; the array is sharded {have}, the constraint asked for {want}",
        "change the sharding with jax.sharding.reshard(x, {want}) (on Explicit axes a change of sharding is a "
        "change of type), or make the mesh axes Auto",
    ),
    KnownError(
        "donated buffer used again",
        (RuntimeError,),
        r"Array has been deleted with shape=(?P<type>\S+)\.",
        "the {type} array was donated to a jitted function (donate_argnums), which reused its memory for "
        "the output; the old Python name still points at the deleted buffer",
        "use only what the step returns: write state = step(state, batch), and never read the old state "
        "after the call",
    ),
    KnownError(
        "traced value used as a Python value",
        (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError),
        r"(Abstract tracer value encountered|Attempted boolean conversion|The __index__\(\) method was called)",
        "inside jit, shard_map or grad, arrays are tracers with a shape but no value; Python control "
        "flow (if, int(), slicing by a traced size) needs a value",
        "use jnp.where or lax.cond for branches, jax.debug.print to print, static_argnums for values that "
        "decide shapes, or move the check outside the traced function",
    ),
    KnownError(
        "leaked tracer",
        (jax.errors.UnexpectedTracerError,),
        r"Encountered an unexpected tracer",
        "a traced value escaped its function through a side effect (a global list, self.attribute, a "
        "closure) and was used after tracing ended",
        "return everything you need from the jitted function; run under jax.checking_leaks() to find "
        "where it leaked",
    ),
    KnownError(
        "recompiled on every step",
        (RecompileError,),
        r"compiled (?P<count>\d+) times",
        "a jitted function compiled {count} times: its arguments changed shape, dtype or sharding, or a "
        "static argument changed value, between calls",
        "keep shapes fixed (pad or drop the last batch), pass Python scalars as arrays, and run under "
        "jax.explain_cache_misses(True) to see what changed",
    ),
    KnownError(
        "device count chosen too late",
        (RuntimeError,),
        r"(jax_num_cpu_devices config should be updated before backends are initialized|"
        r"can only be chosen before JAX's first operation)",
        "the number of simulated CPU devices is read once, when JAX starts its backends (the first "
        "jax.devices(), array or jit); setting it later cannot change it, and XLA_FLAGS set later is "
        "silently ignored",
        "restart the Python kernel and call jaxdist_lessons.devices.setup() (or "
        "jax.config.update('jax_num_cpu_devices', N)) before anything else touches JAX",
    ),
    KnownError(
        "out of memory",
        (jax.errors.JaxRuntimeError,),
        # the CPU says "allocating N bytes" (chapter 7 raises it); on GPUs users report "while trying to
        # allocate N bytes" (e.g. github.com/jax-ml/jax/issues/13428), which nothing here raises (no GPU)
        r"RESOURCE_EXHAUSTED: Out of memory (while trying to allocate|allocating) (?P<size>\d+ bytes)",
        "one device was asked for {size} more than it had free",
        "check with troubleshoot.fits before running, then pick a lever: a smaller per-device batch, remat, "
        "sharded parameters and optimizer state (FSDP/ZeRO), donation of the state, bf16",
    ),
    KnownError(
        "mesh devices do not match the axis names",
        (ValueError,),
        r"Mesh requires the ndim of its first argument \(`devices`\) to equal the length of its second",
        "Mesh(devices, names) needs a device array with one dimension per axis name",
        "use jax.make_mesh(shape, names, axis_types=...) (or reshape the devices to the mesh shape)",
    ),
)


def caught(fn: Callable, *args: Any, **kwargs: Any) -> BaseException:
    """The exception ``fn(*args, **kwargs)`` raises (after waiting for its result); ``AssertionError`` if none."""
    try:
        jax.block_until_ready(fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - catching everything is the point
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised nothing")


def explain(exc: BaseException) -> Explanation:
    """The cause and fix of a known distributed-JAX error; ``known=False`` and a plain "I don't know" otherwise."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"explain() takes an exception, got {type(exc).__name__}")
    message = str(exc)
    for entry in KNOWN_ERRORS:
        if entry.types and not isinstance(exc, entry.types):
            continue
        match = re.search(entry.pattern, message, flags=re.DOTALL)
        if match:
            groups = match.groupdict()
            return Explanation(
                entry.title, entry.cause.format(**groups), entry.fix.format(**groups)
            )
    first_line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    return Explanation(
        f"unknown {type(exc).__name__}",
        f"explain() has no entry for this error, so it cannot say the cause: {first_line}",
        "read the message from its last line up; search it in the JAX GitHub issues and the JAX docs' "
        "'Errors' page (docs.jax.dev/en/latest/errors.html)",
        known=False,
    )


# --- fits(): the out-of-memory pre-flight --------------------------------------------------


class OutOfMemoryError(RuntimeError):
    """``Fit.check()`` found that the bytes needed per device exceed the device's memory."""


def device_budget(device: Any, usable_fraction: float = 1.0) -> float:
    """A device's memory in bytes: a number, an accelerator name from ``memory.ACCELERATORS``, or a jax device.

    A jax device must report ``memory_stats()`` (GPUs and TPUs do; the CPU does not).
    """
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction!r}")
    if isinstance(device, str):
        return memory.accelerator(device).memory_bytes * usable_fraction
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
    """Chapter 1's arithmetic as a pre-flight: does training ``num_params`` with ``strategy`` fit per device?

    ``devices`` is a mesh (all its devices share the work) or a count; ``budget`` is bytes, an
    accelerator name or a jax device (``device_budget``); ``activation_bytes`` are for the
    global batch and are split as the strategy splits them.
    """
    count = devices.size if isinstance(devices, Mesh) else positive_int("devices", devices)
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


# --- A compile counter ---------------------------------------------------------------------

# jax.monitoring events that jax 0.10.2 records with a fun_name for every trace and compile.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileCounter:
    """Function names traced and compiled while the counter listened, in order."""

    name: str | None = None
    traced: list[str] = dataclasses.field(default_factory=list)
    compiled: list[str] = dataclasses.field(default_factory=list)

    @property
    def traces(self) -> int:
        """Traces of the watched function (of every function when no name was given)."""
        return len(self.traced) if self.name is None else self.traced.count(self.name)

    @property
    def compiles(self) -> int:
        """Backend compilations of the watched function (of every function when no name was given)."""
        return (
            len(self.compiled)
            if self.name is None
            else self.compiled.count(f"jit({self.name})")
        )

    def _listen(self, event: str, duration: float, fun_name: str = "", **_: Any) -> None:
        if event == TRACE_EVENT:
            self.traced.append(fun_name)
        elif event == COMPILE_EVENT:
            self.compiled.append(fun_name)


def _function_name(fn: Callable | str | None) -> str | None:
    if fn is None or isinstance(fn, str):
        return fn
    name = getattr(fn, "__name__", None)
    if name is None:
        raise TypeError(
            f"cannot tell the name of {fn!r}: pass the function's name as a string"
        )
    return name


@contextlib.contextmanager
def count_compiles(
    fn: Callable | str | None = None, limit: int | None = None
) -> Iterator[CompileCounter]:
    """Count the traces and compilations of ``fn`` (a jitted function or its name; all if None) in the block.

    Functions are matched by name, as ``jax.monitoring`` reports them: two functions called
    ``step`` count together.

    With ``limit``, raise ``RecompileError`` on leaving the block if ``fn`` compiled more often.
    """
    if limit is not None:
        positive_int("limit", limit)
    counter = CompileCounter(_function_name(fn))
    jax.monitoring.register_event_duration_secs_listener(counter._listen)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(counter._listen)
    if limit is not None and counter.compiles > limit:
        raise RecompileError(
            f"{counter.name or 'the block'} compiled {counter.compiles} times (limit {limit}): its arguments "
            "changed shape, dtype or sharding between calls, or a static argument changed value. Fix: keep "
            "shapes fixed (pad or drop the last batch); run under jax.explain_cache_misses(True) to see "
            "what changed"
        )


# --- Out-of-memory levers, measured ---------------------------------------------------------


class _Block(nn.Module):
    width: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.gelu(nn.Dense(self.width, dtype=self.dtype, param_dtype=self.dtype)(x))


class DeepMLP(nn.Module):
    """``depth`` Dense+GELU blocks then a 10-way head; ``remat`` recomputes each block in the backward pass.

    Not ``gradients.MLP``: the remat lever needs a module per block (``nn.remat`` of a whole model
    recomputes it all at once and, measured, keeps the same temporaries), GELU's backward pass needs
    its input (so remat has activations to save), and the bf16 lever needs bf16 parameters.
    """

    width: int = 128
    depth: int = 8
    remat: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, train: bool = True
    ) -> jax.Array:  # train: as gradients.loss_fn calls it
        block = nn.remat(_Block) if self.remat else _Block
        for _ in range(self.depth):
            x = block(self.width, self.dtype)(x)
        return nn.Dense(10, dtype=self.dtype, param_dtype=self.dtype)(x)


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
    model = DeepMLP(width, depth, lever.remat, dtype)
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
    """Compile (never run) one Adam step of ``DeepMLP`` set up as ``lever`` says, with ``zero.make_step``."""
    model = DeepMLP(width, depth, lever.remat, jnp.dtype(lever.dtype))
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
    key = jax.random.PRNGKey(
        0
    )  # the legacy constructor: its type is what jax_enable_custom_prng changes
    init = jax.jit(
        lambda k: jax.random.normal(k, tuple(shape)),
        out_shardings=NamedSharding(mesh, spec),
    )
    return compiled.compiled_stats(init, key), str(jax.typeof(key))
