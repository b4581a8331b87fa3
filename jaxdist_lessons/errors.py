"""The error catalogue: known distributed-JAX errors, each with its cause and fix (chapter 07_troubleshooting).

``explain(exc)`` matches an exception against ``KNOWN_ERRORS`` (exception types and a pattern
on the real message of jax 0.10.2) and fills in the cause and the fix from the message; for
an error it does not know, it says so plainly. ``caught(fn, ...)`` returns the exception a call
raises, so that a chapter can pass it on. ``catalogue()`` reproduces every error chapter 07_troubleshooting meets,
one call each, for ``explain_calls`` to tabulate. The tests raise every entry and compare the
messages, so a JAX upgrade that rewords one fails a test before a reader meets the new text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import devices, recompiles
from jaxdist_lessons.mesh import devices_for_axis, mesh_shape
from jaxdist_lessons.recompiles import RecompileError
from jaxdist_lessons.tables import Table


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
        "pad the batch to a multiple of {ways} and mask the padding (sharding.pad_batch), or drop the "
        "remainder (drop_remainder=True in the input pipeline); check first with sharding.check_batch",
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
        # the CPU says "allocating N bytes" (chapter 07_troubleshooting raises it); on GPUs users report "while trying to
        # allocate N bytes" (e.g. github.com/jax-ml/jax/issues/13428), which nothing here raises (no GPU)
        r"RESOURCE_EXHAUSTED: Out of memory (while trying to allocate|allocating) (?P<size>\d+ bytes)",
        "one device was asked for {size} more than it had free",
        "check with oom.fits before running, then pick a lever: a smaller per-device batch, remat, "
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
    except Exception as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised nothing")


def explain(exc: BaseException) -> Explanation:
    """The cause and fix of a known distributed-JAX error; ``known=False`` and a plain
    "I don't know" otherwise."""
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
        "explain() has no entry for this error, so it cannot say the cause: "
        f"{first_line}",
        "read the message from its last line up; search it in the JAX GitHub issues "
        "and the JAX docs' 'Errors' page (docs.jax.dev/en/latest/errors.html)",
        known=False,
    )


def explain_calls(calls: Mapping[str, Callable[[], Any]], title: str = "") -> Table:
    """Run each call and explain what it raises: what was done, the exception, ``explain``'s title."""
    rows = []
    for what, call in calls.items():
        exc = caught(call)
        rows.append([what, type(exc).__name__, explain(exc).title])
    return Table(["what we did", "exception", "explain() says"], rows, title=title)


def catalogue() -> dict[str, Callable[[], Any]]:
    """Chapter 07_troubleshooting's errors, one call each that raises it: what was done -> a call with no arguments.

    Built on all devices (at least 2: one device divides every batch); the batch has ``4n + 1``
    rows, one more than a multiple of the ``n`` devices. Pass it to ``explain_calls``.
    """
    n = jax.device_count()
    if n < 2:
        raise ValueError(f"the catalogue needs at least 2 devices, got {n}")
    auto = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    data = NamedSharding(auto, P("data"))
    explicit_data = NamedSharding(
        jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,)), P("data")
    )
    # a 'tensor' axis of 2: on an odd count, all devices but one
    pairs = devices_for_axis(2)
    hybrid = jax.make_mesh(
        mesh_shape(len(pairs), data=-1, tensor=2),
        ("data", "tensor"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=pairs,
    )
    x = jax.device_put(
        np.ones((4 * len(pairs), 16), np.float32),
        NamedSharding(hybrid, P("data", "tensor")),
    )
    w = jax.device_put(
        np.ones((16, 32), np.float32), NamedSharding(hybrid, P("tensor", None))
    )
    batch = np.ones((4 * n + 1, 3), np.float32)
    placed = jax.device_put(np.ones((4 * n, 3), np.float32), data)
    norm = nn.BatchNorm(use_running_average=False, axis_name="data")
    norm_variables = norm.init(jax.random.key(0), batch[:n])
    per_device_sum = jax.shard_map(
        lambda v: v.sum(keepdims=True),
        mesh=auto,
        in_specs=P("data"),
        out_specs=P("data"),
    )

    def constrained_under_set_mesh():
        with jax.set_mesh(hybrid):
            return jax.jit(
                lambda v: jax.lax.with_sharding_constraint(v, P("data", None))
            )(x)

    def donated_again():
        state = jax.device_put(jnp.ones((n, 4)), data)
        jax.jit(lambda s: s * 0.9, donate_argnums=0)(state)
        return state + 1

    def leaked():
        leaks = []
        jax.jit(lambda v: leaks.append(v) or v)(jnp.ones(3))
        return leaks[0] + 1

    def recompiled():
        @jax.jit
        def mean_of_tokens(tokens):
            return tokens.mean()

        with recompiles.count_compiles(mean_of_tokens, limit=1):
            for length in (3, 5):
                mean_of_tokens(jnp.zeros((n, length), jnp.int32))

    return {
        "device_put a batch of 4n+1": lambda: jax.device_put(batch, data),
        "jit in_shardings, same batch": lambda: jax.jit(lambda v: v, in_shardings=data)(
            batch
        ),
        "make_array_from_process_local_data": lambda: (
            jax.make_array_from_process_local_data(data, batch)
        ),
        "device_put on an Explicit mesh": lambda: jax.device_put(batch, explicit_data),
        "shard_map, same batch": lambda: per_device_sum(batch),
        "pmap, 4n+1 rows (more than n)": lambda: jax.pmap(lambda v: v.sum())(batch),
        "pmap, 2n rows not reshaped": lambda: jax.pmap(lambda v: v.sum())(
            batch[: 2 * n]
        ),
        "spec names a missing axis": lambda: NamedSharding(auto, P("tensor")),
        "spec longer than the rank": lambda: jax.device_put(
            np.zeros(n, np.float32), NamedSharding(auto, P("data", None))
        ),
        "pmap without axis_name": lambda: jax.pmap(lambda v: jax.lax.pmean(v, "data"))(
            np.ones((n, 3))
        ),
        "BatchNorm axis_name under jit": lambda: jax.jit(
            lambda v, b: norm.apply(v, b, mutable=["batch_stats"])
        )(norm_variables, placed),
        "Explicit matmul, no out_sharding": lambda: jax.jit(lambda a, b: a @ b)(x, w),
        "with_sharding_constraint, Explicit": lambda: jax.jit(
            lambda v: jax.lax.with_sharding_constraint(
                v, NamedSharding(hybrid, P("data", None))
            )
        )(x),
        "the same under jax.set_mesh": constrained_under_set_mesh,
        "donated buffer used again": donated_again,
        "Python if on a tracer": lambda: jax.shard_map(
            lambda v: v if jax.lax.axis_index("data") == 0 else -v,
            mesh=auto,
            in_specs=P("data"),
            out_specs=P("data"),
        )(placed),
        "int() of a tracer": lambda: jax.jit(lambda v: v[: int(v.sum())])(jnp.ones(4)),
        "leaked tracer": leaked,
        "recompile on every step": recompiled,
        "device count set too late": lambda: jax.config.update(
            "jax_num_cpu_devices", 2 * n
        ),
        "setup() after JAX started": lambda: devices.setup(2 * n),
        "out of memory": lambda: jnp.zeros((2**15, 2**15, 2**15), jnp.float32),
    }
