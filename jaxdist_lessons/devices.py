"""Choose the devices a chapter runs on: real accelerators, or simulated CPU devices.

Every notebook starts with ``setup()``. On a laptop or CI machine it asks XLA for
``num_devices`` CPU devices (8 unless ``JAXDIST_NUM_DEVICES`` says otherwise), so the
whole book runs without a GPU. On a GPU box or a Colab TPU with enough chips it uses them.

The number of CPU devices can only be chosen before JAX starts its backends (the first
``jax.devices()``, the first array). That is why ``setup()`` must come first.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.extend.backend
from jax._src import (
    xla_bridge,  # the only way to ask "has JAX started?" without starting it
)

from jaxdist_lessons._checks import positive_int

ENV_VAR = "JAXDIST_NUM_DEVICES"
DEFAULT_NUM_DEVICES = 8


class SetupError(RuntimeError):
    """``setup()`` was called after JAX started, and the devices present do not match."""


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What ``setup()`` chose: the platform, the device kind, how many, and whether simulated."""

    platform: str
    device_kind: str
    count: int
    simulated: bool

    def __str__(self) -> str:
        plural = "s" if self.count != 1 else ""
        if self.simulated:
            return (
                f"jaxdist: {self.count} simulated {self.platform.upper()} device{plural} "
                f"(device kind: {self.device_kind}; set {ENV_VAR} to change the count)"
            )
        return f"jaxdist: {self.count} {self.platform.upper()} device{plural} (device kind: {self.device_kind})"


def requested_num_devices(num_devices: int | None = None) -> int:
    """The number of simulated CPU devices asked for: the argument, else ``$JAXDIST_NUM_DEVICES``, else 8."""
    if num_devices is None:
        raw = os.environ.get(ENV_VAR, "").strip()
        if not raw:
            return DEFAULT_NUM_DEVICES
        try:
            num_devices = int(raw)
        except ValueError:
            raise ValueError(f"{ENV_VAR} must be a positive integer, got {raw!r}") from None
        return positive_int(ENV_VAR, num_devices)
    return positive_int("num_devices", num_devices)


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


def _satisfies(info: DeviceInfo, num_devices: int, min_devices: int) -> bool:
    if info.platform == "cpu":
        return info.count == num_devices
    return info.count >= min_devices


def setup(num_devices: int | None = None, min_devices: int = 1) -> DeviceInfo:
    """Use the accelerators if there are at least ``min_devices``, else ``num_devices`` simulated CPU devices.

    Call it once, first thing, before any other JAX call. It prints one line saying what
    it chose and returns the same facts as a ``DeviceInfo``.

    Raises:
        ValueError: ``num_devices``, ``min_devices`` or ``$JAXDIST_NUM_DEVICES`` is not a positive integer.
        SetupError: JAX had already started with devices that do not satisfy the request.
    """
    num_devices = requested_num_devices(num_devices)
    positive_int("min_devices", min_devices)

    if xla_bridge.backends_are_initialized():
        info = current_devices()
        if not _satisfies(info, num_devices, min_devices):
            raise SetupError(_too_late_message(info, num_devices, min_devices))
    else:
        info = _start(num_devices, min_devices)
    print(info)
    return info


def _start(num_devices: int, min_devices: int) -> DeviceInfo:
    """Start JAX's backends with ``num_devices`` CPU devices; fall back to CPU if accelerators are too few."""
    jax.config.update("jax_num_cpu_devices", num_devices)
    info = current_devices()
    if info.platform != "cpu" and info.count < min_devices:
        # Too few accelerators for this chapter: restart on the CPU alone.
        jax.extend.backend.clear_backends()
        jax.config.update("jax_platforms", "cpu")
        info = current_devices()
    return info


def _too_late_message(info: DeviceInfo, num_devices: int, min_devices: int) -> str:
    if info.platform != "cpu":  # too few accelerators, and too late to fall back to the CPU
        return (
            f"setup() needs {min_devices} devices, but JAX had already started with {info.count} "
            f"{info.platform} device(s), and can only switch to {num_devices} simulated CPU devices before "
            "its first operation. Fix: restart the Python kernel and call jaxdist_lessons.devices.setup() "
            f"before any other JAX call, or start Python with JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES={num_devices}."
        )
    return (
        f"setup() asked for {num_devices} CPU devices, but JAX had already started with "
        f"{info.count} {info.platform} device(s). The number of CPU devices can only be chosen "
        "before JAX's first operation (jax.devices(), creating an array, jit, ...). "
        "Fix: restart the Python kernel and call jaxdist_lessons.devices.setup() before any "
        "other JAX call, or start Python with the environment variable "
        f"JAX_NUM_CPU_DEVICES={num_devices} set."
    )
