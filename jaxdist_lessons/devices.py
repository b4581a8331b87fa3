"""Choose the devices a chapter runs on: real accelerators, or simulated CPU devices.

Every chapter starts with ``setup(min_devices=k)``, where ``k`` is the fewest devices its lesson
needs. The choice is made by one pure function, ``choose``, from three facts: the devices JAX
reports, the count asked for (the ``num_devices`` argument, else ``$JAXDIST_NUM_DEVICES``), and
the chapter's minimum:

- with at least ``k`` accelerators (GPUs, TPU chips), the chapter uses all of them;
- with fewer, or none, it asks XLA for simulated CPU devices: the count asked for, else 8
  (or ``k`` if that is more), and says why;
- a count asked for below ``k`` is an error that says the chapter needs at least ``k`` devices.

The number of CPU devices can only be chosen before JAX starts its backends (the first
``jax.devices()``, the first array). That is why ``setup()`` must come first. Whether JAX has
started is read from JAX's public configuration: ``jax.config.update("jax_num_cpu_devices", n)``
raises ``RuntimeError`` once the backends are up, unless ``n`` is the count already set.

Simulated devices are capped at ``MAX_SIMULATED_DEVICES``: XLA:CPU makes every device on start,
and the time grows faster than the count (on a 2-core machine, with jax 0.10.2: 1024 devices
start in 2 s, 8192 in 40 s, 16384 in over two minutes; a sharded sum over 1024 takes 20 s, over
4096 more than two minutes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import jax
import jax.extend.backend

from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.versions import version_warning

ENV_VAR = "JAXDIST_NUM_DEVICES"
# In a checkout of the book, compiled programs are kept in _build/jax_cache (JAX's persistent
# compilation cache): running a chapter again, or the tests after the build, reads them back
# instead of compiling again. JAX_COMPILATION_CACHE_DIR chooses another folder;
# JAXDIST_COMPILATION_CACHE=0 turns it off.
CACHE_ENV_VAR = "JAXDIST_COMPILATION_CACHE"
MIN_CACHED_SECONDS = 0.2
CACHE_MAX_BYTES = 4 * 1024**3
DEFAULT_NUM_DEVICES = 8
# more would take minutes to start (see the module docstring)
MAX_SIMULATED_DEVICES = 1024


class SetupError(RuntimeError):
    """The devices cannot be what the chapter needs: too few asked for, or JAX started too early."""


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """A set of devices: the platform, the device kind, how many, and whether simulated."""

    platform: str
    device_kind: str
    count: int
    simulated: bool

    def __str__(self) -> str:
        plural = "s" if self.count != 1 else ""
        if self.simulated:
            return (
                f"jaxdist: {self.count} simulated {self.platform.upper()} device{plural} "
                f"(kind: {self.device_kind}; {ENV_VAR} sets the count)"
            )
        return (
            f"jaxdist: {self.count} {self.platform.upper()} device{plural} "
            f"(device kind: {self.device_kind})"
        )


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``choose`` decided: the platform to use, how many devices, and why."""

    platform: str
    count: int
    simulated: bool
    reason: str


def requested_num_devices(num_devices: int | None = None) -> int | None:
    """The device count asked for: the argument, else ``$JAXDIST_NUM_DEVICES``, else ``None``."""
    if num_devices is not None:
        return _within_bound("num_devices", positive_int("num_devices", num_devices))
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_VAR} must be a positive integer, got {raw!r}") from None
    return _within_bound(ENV_VAR, positive_int(ENV_VAR, value))


def _within_bound(name: str, count: int) -> int:
    """``count`` if it is at most ``MAX_SIMULATED_DEVICES``; otherwise ``SetupError``."""
    if count > MAX_SIMULATED_DEVICES:
        raise SetupError(
            f"{name}={count} asks for more than {MAX_SIMULATED_DEVICES} simulated devices, the "
            "most this book allows: XLA:CPU creates every device when JAX starts and runs "
            "each sharded operation on all of them, which takes minutes with a few thousand. "
            f"Ask for {MAX_SIMULATED_DEVICES} or fewer."
        )
    return count


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def choose(
    available: DeviceInfo,
    requested: int | None,
    min_devices: int = 1,
    requested_by: str = ENV_VAR,
) -> Choice:
    """Decide the devices from what JAX reports (``available``), the count asked for, the minimum.

    ``available`` describes JAX's default backend before any choice: a CPU, or accelerators.
    ``requested_by`` names where ``requested`` came from, for the error message.

    Raises:
        SetupError: ``requested`` is below ``min_devices``.
    """
    positive_int("min_devices", min_devices)
    if requested is not None:
        positive_int("requested", requested)
        if requested < min_devices:
            raise SetupError(
                f"this chapter needs at least {min_devices} devices, but {requested_by}="
                f"{requested} asks for {_plural(requested, 'device')}. Ask for "
                f"{min_devices} or more (or unset {ENV_VAR} to get "
                f"{simulated_count(None, min_devices)})."
            )
    simulated = simulated_count(requested, min_devices)
    if available.platform == "cpu":
        return Choice(
            "cpu", simulated, True, "no accelerator found: simulated CPU devices"
        )
    accelerators = _plural(available.count, available.platform.upper())
    if available.count >= min_devices:
        return Choice(
            available.platform,
            available.count,
            False,
            f"{accelerators}, at least the {min_devices} this chapter needs",
        )
    return Choice(
        "cpu",
        simulated,
        True,
        f"{accelerators} {'is' if available.count == 1 else 'are'} fewer than the "
        f"{min_devices} devices this chapter needs: simulated CPU devices instead",
    )


def current_devices() -> DeviceInfo:
    """Describe the devices JAX is using now (this starts JAX's backends if needed)."""
    devices = jax.devices()
    platform = devices[0].platform
    return DeviceInfo(
        platform=platform,
        device_kind=devices[0].device_kind,
        count=len(devices),
        simulated=platform == "cpu",
    )


def setup(num_devices: int | None = None, min_devices: int = 1) -> DeviceInfo:
    """Use the accelerators if there are at least ``min_devices``, else simulated CPU devices.

    Call it once, first thing, before any other JAX call. It prints one line saying what it
    chose and why, and returns the devices as a ``DeviceInfo``.

    Raises:
        ValueError: ``num_devices``, ``min_devices`` or ``$JAXDIST_NUM_DEVICES`` is not a
            positive integer.
        SetupError: the count asked for is below ``min_devices`` or above
            ``MAX_SIMULATED_DEVICES``, or JAX had already started with devices that do not
            satisfy the request.
    """
    requested = requested_num_devices(num_devices)
    requested_by = "num_devices" if num_devices is not None else ENV_VAR
    cache = compilation_cache_dir(os.environ)
    if cache is not None and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache))
        # JAX keeps only programs that took a second or more; a chapter's take less.
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs", MIN_CACHED_SECONDS
        )
        # With a size limit JAX locks the folder and keeps an access time beside each
        # entry. Every writer needs one: once one sets a limit (conftest.py does),
        # JAX's eviction fails on any entry written without its access time.
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    _within_bound("min_devices", positive_int("min_devices", min_devices))
    if requested is not None and requested < min_devices:
        choose(DeviceInfo("cpu", "cpu", 0, True), requested, min_devices, requested_by)

    started = _start(requested, min_devices, requested_by)
    if started is None:  # JAX had started already: keep its devices if they will do
        info = current_devices()
        if not _satisfies(info, requested, min_devices):
            raise SetupError(_too_late_message(info, requested, min_devices))
        print(info)
        if info.simulated:
            save_replicated_arrays_from_one_replica()
        return info
    info, choice, available = started
    if info.simulated:
        save_replicated_arrays_from_one_replica()
    # On a machine without accelerators the line says enough; with them, it also says why.
    print(info if available.platform == "cpu" else f"{info}. Why: {choice.reason}")
    warning = version_warning()
    if warning:
        print(warning)
    return info


def save_replicated_arrays_from_one_replica() -> None:
    """Have Orbax write each replicated array whole, from one replica.

    Orbax's own default does so only when ``JAX_PLATFORMS`` names a GPU platform; elsewhere
    the replicas share the writing of a replicated array (``use_replica_parallel``), each
    slicing out its part with a program compiled for that array's shape. Simulated CPU
    devices share one machine, so there the slicing is all cost: chapter 05_resnet50's first save
    compiles hundreds of slicing programs (``benchmarks/orbax_saves.py`` times both ways).
    ``setup`` calls this when it simulates CPU devices, as chapter 08_multi_host's demo does.
    """
    import orbax.checkpoint as ocp

    default = ocp.type_handlers.get_type_handler(jax.Array)
    handler = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False,
        # Orbax's default handler keeps its array metadata (typed PRNG keys, among other
        # things) in a store that Orbax does not export: keep the same one.
        array_metadata_store=getattr(default, "_array_metadata_store", None),
    )
    absl = logging.getLogger("absl")  # Orbax logs every override as a warning
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)


def compilation_cache_dir(
    environ: dict[str, str] | os._Environ, root: pathlib.Path | None = None
) -> pathlib.Path | None:
    """Where ``setup`` keeps compiled programs: ``_build/jax_cache`` of the book's checkout.

    None when the package runs outside a checkout (installed from a wheel, as on Colab), when
    ``$JAX_COMPILATION_CACHE_DIR`` already tells JAX where, or when
    ``$JAXDIST_COMPILATION_CACHE`` is ``0``.
    """
    if environ.get(CACHE_ENV_VAR, "1") == "0" or environ.get(
        "JAX_COMPILATION_CACHE_DIR"
    ):
        return None
    root = root or pathlib.Path(__file__).resolve().parents[1]
    if not ((root / "_config.yml").is_file() and (root / "book").is_dir()):
        return None
    return root / "_build" / "jax_cache"


def simulated_count(requested: int | None, min_devices: int) -> int:
    """How many CPU devices to simulate: those requested, or the default (at least the
    chapter's minimum)."""
    return requested if requested is not None else max(DEFAULT_NUM_DEVICES, min_devices)


def _satisfies(info: DeviceInfo, requested: int | None, min_devices: int) -> bool:
    if info.platform == "cpu":
        return info.count == simulated_count(requested, min_devices)
    return info.count >= min_devices


def _start(
    requested: int | None, min_devices: int, requested_by: str
) -> tuple[DeviceInfo, Choice, DeviceInfo] | None:
    """Start JAX's backends as ``choose`` decides; restart on the CPU if accelerators are too few.

    Returns ``None``, starting nothing, if JAX had started already with another CPU count.
    """
    cpu_count = simulated_count(requested, min_devices)
    # The CPU device count must be set before the first backend starts, whatever is chosen;
    # once JAX has started, JAX refuses a new count with a RuntimeError.
    try:
        jax.config.update("jax_num_cpu_devices", cpu_count)
    except RuntimeError:
        return None
    available = current_devices()
    choice = choose(available, requested, min_devices, requested_by)
    if choice.simulated and available.platform != "cpu":
        jax.extend.backend.clear_backends()
        jax.config.update("jax_platforms", "cpu")
    return current_devices(), choice, available


def _too_late_message(info: DeviceInfo, requested: int | None, min_devices: int) -> str:
    wanted = simulated_count(requested, min_devices)
    # too few accelerators, and too late to fall back to the CPU
    if info.platform != "cpu":
        return (
            f"this chapter needs at least {min_devices} devices, but JAX had already started "
            f"with {info.count} {info.platform} device(s), and can only switch to {wanted} "
            "simulated CPU devices before its first operation. Fix: restart the Python kernel "
            "and call jaxdist_lessons.devices.setup() before any other JAX call, or start "
            f"Python with JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES={wanted}."
        )
    return (
        f"setup() asked for {wanted} CPU devices, but JAX had already started with "
        f"{info.count} {info.platform} device(s). The number of CPU devices can only be chosen "
        "before JAX's first operation (jax.devices(), creating an array, jit, ...). "
        "Fix: restart the Python kernel and call jaxdist_lessons.devices.setup() before any "
        "other JAX call, or start Python with the environment variable "
        f"JAX_NUM_CPU_DEVICES={wanted} set."
    )
