"""The environment check: a report that runs, and what it says setup() would choose."""

import re
import subprocess
import sys

from jaxdist_lessons import devices, doctor


def test_choices_table_for_one_gpu():
    gpu = devices.DeviceInfo("gpu", "Tesla T4", 1, False)
    rows = doctor.choices_table(gpu, None).rows
    assert rows[0] == ["1", "gpu", "1", "1 GPU, at least the 1 this chapter needs"]
    assert rows[1][:3] == ["2", "cpu", "8"]
    assert rows[2][:3] == ["8", "cpu", "8"]


def test_choices_table_shows_a_request_below_a_minimum_as_an_error():
    rows = doctor.choices_table(devices.DeviceInfo("cpu", "cpu", 1, True), 1).rows
    assert rows[0][:3] == ["1", "cpu", "1"]
    assert rows[1][3].startswith("this chapter needs at least 2 devices")


def test_command_line_prints_every_section():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist_lessons.doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for heading in [
        "Versions",
        "Platform: Linux",
        "Accelerator build of JAX: none (CPU only)",
        "JAX reports: 1 CPU device(s)",
        "What setup() would choose",
    ]:
        assert heading in out, out
    assert re.search(r"jax\s+0\.10\.2\s+0\.10\.2\s+yes", out)


def test_doctor_piped_into_head_ends_quietly():
    import subprocess
    import sys

    done = subprocess.run(
        f"set -o pipefail; {sys.executable} -m jaxdist_lessons.doctor | head -1",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "Versions\n", "")
