"""devices.setup() must act before JAX starts, so each case runs in a fresh interpreter."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from jaxdist_lessons import devices


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("JAXDIST_NUM_DEVICES", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS")
    }
    clean["JAX_PLATFORMS"] = (
        "cpu"  # the suite is about simulated devices, even on a GPU box
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=120,
    )


SHOW = """
from jaxdist_lessons import devices
info = devices.setup({args})
import jax
print("RESULT", info.platform, info.count, info.simulated, jax.device_count())
"""


def result_line(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("RESULT")][
        0
    ].split()[1:]


def test_default_is_eight_simulated_cpu_devices():
    proc = run_python(SHOW.format(args=""))
    assert result_line(proc) == ["cpu", "8", "True", "8"]
    assert "jaxdist: 8 simulated CPU devices (device kind: cpu" in proc.stdout


def test_environment_variable_sets_the_count():
    assert result_line(run_python(SHOW.format(args=""), JAXDIST_NUM_DEVICES="4")) == [
        "cpu",
        "4",
        "True",
        "4",
    ]


def test_argument_overrides_environment_variable():
    assert result_line(
        run_python(SHOW.format(args="num_devices=2"), JAXDIST_NUM_DEVICES="4")
    ) == ["cpu", "2", "True", "2"]


def test_min_devices_above_the_accelerators_falls_back_to_cpu():
    assert result_line(run_python(SHOW.format(args="min_devices=64"))) == [
        "cpu",
        "8",
        "True",
        "8",
    ]


def test_prints_exactly_one_line():
    proc = run_python("from jaxdist_lessons import devices; devices.setup(3)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "jaxdist: 3 simulated CPU devices (device kind: cpu; set JAXDIST_NUM_DEVICES to change the count)"
    ]


def test_too_late_raises_an_error_that_says_how_to_fix_it():
    proc = run_python("""
        import jax
        jax.numpy.zeros(3)  # starts the backend with 1 CPU device
        from jaxdist_lessons import devices
        devices.setup()
    """)
    assert proc.returncode == 1
    assert (
        "SetupError: setup() asked for 8 CPU devices, but JAX had already started with 1 cpu device(s)"
        in proc.stderr
    )
    assert (
        "restart the Python kernel and call jaxdist_lessons.devices.setup() before any other JAX call"
        in proc.stderr
    )
    assert "JAX_NUM_CPU_DEVICES=8" in proc.stderr


def test_too_late_is_fine_when_the_devices_present_satisfy_the_request():
    proc = run_python("""
        import jax
        jax.config.update("jax_num_cpu_devices", 4)
        jax.devices()
        from jaxdist_lessons import devices
        devices.setup(4)
        devices.setup(4)  # re-running a notebook's first cell
        print("RESULT", jax.device_count())
    """)
    assert result_line(proc) == ["4"]


def test_the_fix_named_in_the_error_works():
    proc = run_python(
        """
        import jax
        jax.devices()
        from jaxdist_lessons import devices
        devices.setup()
        print("RESULT", jax.device_count())
    """,
        JAX_NUM_CPU_DEVICES="8",
    )
    assert result_line(proc) == ["8"]


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "2.5"])
def test_bad_environment_variable(raw, monkeypatch):
    monkeypatch.setenv("JAXDIST_NUM_DEVICES", raw)
    with pytest.raises(
        ValueError,
        match=rf"^JAXDIST_NUM_DEVICES must be a positive integer, got '?{re.escape(raw)}'?$",
    ):
        devices.requested_num_devices()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8"])
def test_bad_arguments(bad):
    with pytest.raises(ValueError, match="num_devices must be a positive integer"):
        devices.setup(num_devices=bad)
    with pytest.raises(ValueError, match="min_devices must be a positive integer"):
        devices.setup(num_devices=8, min_devices=bad)


def test_requested_num_devices(monkeypatch):
    monkeypatch.delenv("JAXDIST_NUM_DEVICES", raising=False)
    assert devices.requested_num_devices() == 8
    monkeypatch.setenv("JAXDIST_NUM_DEVICES", " 2 ")
    assert devices.requested_num_devices() == 2
    assert devices.requested_num_devices(5) == 5


def test_in_process_setup_matches_the_running_backend():
    # conftest.py called setup() first; a second call with the same request succeeds.
    info = devices.setup()
    assert info == devices.current_devices()
    assert info.count == devices.requested_num_devices()
