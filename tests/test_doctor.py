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


def test_chapter_minimums_are_the_books():
    """Every page of _toc.yml, in its order, with the minimum its setup() cell asks for."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    toc = re.findall(r"(?:root|file): book/(\S+)", (root / "_toc.yml").read_text())
    pages = [p for p in toc if p != "glossary"]  # the glossary runs no code
    asked = {}
    for page in pages:
        text = (root / "book" / f"{page}.md").read_text()
        found = re.search(r"info = devices\.setup\(min_devices=(\d+)\)", text)
        assert found, page
        asked[page] = int(found[1])
    assert asked == doctor.CHAPTER_MIN_DEVICES


def test_chip_line_names_a_tpu_its_memory_and_peak():
    tpu = devices.DeviceInfo("tpu", "TPU v5 lite", 1, False)
    line = doctor.chip_line(tpu, 16_910_671_872)  # about what the borrowed v5e reports
    assert line == (
        "Chip: TPU v5e ('TPU v5 lite'), 16.9 GB (15.7 GiB) usable by JAX, "
        "16 GB on the datasheet; "
        "dense bfloat16 peak 197 TFLOP/s"
    )
    unknown = doctor.chip_line(devices.DeviceInfo("gpu", "Tesla T4", 1, False), None)
    assert unknown.startswith("Chip: 'Tesla T4' is not in hardware.CHIPS")


def test_chapters_on_one_chip_use_it_or_simulate():
    tpu = devices.DeviceInfo("tpu", "TPU v5 lite", 1, False)
    rows = {row[0]: row[2] for row in doctor.chapters_table(tpu, None).rows}
    assert rows["01_why_distribute"] == "1 TPU"
    assert rows["03_sharding"] == rows["09_flax_partitioning"] == "8 simulated CPU"


def test_missing_names_the_socket_a_job_needs():
    gaps = doctor.missing(socket_error="[Errno 97] Address family not supported")
    assert any(g.startswith("a TCP socket on the loopback ([Errno 97]") for g in gaps)
    assert not any("loopback" in g for g in doctor.missing(socket_error=""))
