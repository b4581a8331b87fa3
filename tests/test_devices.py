"""devices.setup() must act before JAX starts, so each case runs in a fresh interpreter."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from jaxdist_lessons import devices


def run_python(
    code: str, drop_prefix: str | None = None, **env: str
) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, without the device-count variables (nor any
    variable starting with ``drop_prefix``), plus ``env``."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "JAXDIST_NUM_DEVICES",
            "JAX_NUM_CPU_DEVICES",
            "XLA_FLAGS",
            "JAX_PLATFORMS",
        )
        and not (drop_prefix and k.startswith(drop_prefix))
    }
    # the suite is about simulated devices, even on a GPU box
    clean["JAX_PLATFORMS"] = "cpu"
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
    assert "jaxdist: 8 simulated CPU devices (kind: cpu;" in proc.stdout


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


def test_prints_exactly_one_line():
    proc = run_python("from jaxdist_lessons import devices; devices.setup(3)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "jaxdist: 3 simulated CPU devices (kind: cpu; JAXDIST_NUM_DEVICES sets the count)"
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


@pytest.mark.parametrize("name", ["num_devices", "JAXDIST_NUM_DEVICES"])
def test_a_count_above_the_bound_is_refused_before_jax_starts(name, monkeypatch):
    too_many = devices.MAX_SIMULATED_DEVICES + 1
    monkeypatch.setenv("JAXDIST_NUM_DEVICES", str(too_many))
    with pytest.raises(
        devices.SetupError,
        match=rf"^{name}={too_many} asks for more than 1024 simulated devices, the most this "
        r"book allows: XLA:CPU creates every device when JAX starts .* Ask for 1024 or fewer\.$",
    ):
        devices.requested_num_devices(too_many if name == "num_devices" else None)
    monkeypatch.setenv("JAXDIST_NUM_DEVICES", "1024")
    assert devices.requested_num_devices() == 1024


def test_a_huge_count_fails_at_once_in_a_fresh_process():
    # Before the bound, JAXDIST_NUM_DEVICES=100000 hung for minutes creating CPU devices.
    proc = run_python(
        "from jaxdist_lessons import devices; devices.setup()",
        JAXDIST_NUM_DEVICES="100000",
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "jaxdist_lessons.devices.SetupError: JAXDIST_NUM_DEVICES=100000 asks for more than "
        "1024 simulated devices, the most this book allows: XLA:CPU creates every device when "
        "JAX starts and runs each sharded operation on all of them, which takes minutes with "
        "a few thousand. Ask for 1024 or fewer."
    )
    assert proc.stdout == ""


def test_a_minimum_above_the_bound_is_refused():
    with pytest.raises(
        devices.SetupError, match=r"^min_devices=2000 asks for more than 1024"
    ):
        devices.setup(min_devices=2000)


def test_requested_num_devices(monkeypatch):
    monkeypatch.delenv("JAXDIST_NUM_DEVICES", raising=False)
    assert devices.requested_num_devices() is None
    monkeypatch.setenv("JAXDIST_NUM_DEVICES", " 2 ")
    assert devices.requested_num_devices() == 2
    assert devices.requested_num_devices(5) == 5


def test_in_process_setup_matches_the_running_backend():
    # conftest.py called setup() first; a second call with the same request succeeds.
    count = devices.current_devices().count
    info = devices.setup(num_devices=count)
    assert info == devices.current_devices()
    assert info.count == count


# --- The choice itself: a pure function of the devices JAX reports, the request, the minimum ---

CPU = devices.DeviceInfo("cpu", "cpu", 1, True)
ONE_GPU = devices.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 1, False)
FOUR_GPUS = devices.DeviceInfo("gpu", "NVIDIA A100-SXM4-40GB", 4, False)
EIGHT_GPUS = devices.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 8, False)
ONE_TPU = devices.DeviceInfo("tpu", "TPU v5 lite", 1, False)
EIGHT_TPUS = devices.DeviceInfo("tpu", "TPU v4", 8, False)


def chosen(available, requested=None, min_devices=1):
    choice = devices.choose(available, requested, min_devices)
    return choice.platform, choice.count, choice.simulated


@pytest.mark.parametrize(
    "available, requested, min_devices, expected",
    [
        # No accelerator: simulated CPU devices, 8 unless asked otherwise.
        (CPU, None, 1, ("cpu", 8, True)),
        (CPU, 3, 1, ("cpu", 3, True)),
        (CPU, 1, 1, ("cpu", 1, True)),
        (CPU, 6, 2, ("cpu", 6, True)),
        # Enough accelerators: all of them, whatever count is asked for the CPU.
        (ONE_GPU, None, 1, ("gpu", 1, False)),
        (ONE_GPU, 5, 1, ("gpu", 1, False)),
        (FOUR_GPUS, None, 2, ("gpu", 4, False)),
        (FOUR_GPUS, None, 4, ("gpu", 4, False)),
        (EIGHT_GPUS, None, 8, ("gpu", 8, False)),
        (ONE_TPU, None, 1, ("tpu", 1, False)),
        (EIGHT_TPUS, None, 2, ("tpu", 8, False)),
        # Too few accelerators: simulated CPU devices instead.
        (ONE_GPU, None, 2, ("cpu", 8, True)),
        (ONE_GPU, 4, 2, ("cpu", 4, True)),
        (FOUR_GPUS, None, 8, ("cpu", 8, True)),
        (ONE_TPU, None, 2, ("cpu", 8, True)),
        (EIGHT_TPUS, None, 16, ("cpu", 16, True)),
    ],
    ids=lambda v: getattr(v, "device_kind", v),
)
def test_choose(available, requested, min_devices, expected):
    assert chosen(available, requested, min_devices) == expected


def test_choose_says_why_it_falls_back_to_the_cpu():
    choice = devices.choose(ONE_GPU, None, 2)
    assert choice.reason == (
        "1 GPU is fewer than the 2 devices this chapter needs: simulated CPU devices instead"
    )
    assert devices.choose(FOUR_GPUS, None, 8).reason.startswith(
        "4 GPUs are fewer than the 8"
    )
    assert devices.choose(EIGHT_TPUS, None, 2).reason == (
        "8 TPUs, at least the 2 this chapter needs"
    )


@pytest.mark.parametrize("available", [CPU, ONE_GPU, EIGHT_GPUS, ONE_TPU])
def test_a_request_below_the_minimum_is_an_error(available):
    with pytest.raises(
        devices.SetupError,
        match=r"^this chapter needs at least 4 devices, but JAXDIST_NUM_DEVICES=2 asks for 2 "
        r"devices\. Ask for 4 or more",
    ):
        devices.choose(available, 2, 4)


def test_setup_stops_below_the_chapter_minimum():
    proc = run_python(
        "from jaxdist_lessons import devices; devices.setup(min_devices=2)",
        JAXDIST_NUM_DEVICES="1",
    )
    assert proc.returncode == 1
    assert (
        "SetupError: this chapter needs at least 2 devices, but JAXDIST_NUM_DEVICES=1"
        in (proc.stderr)
    )
    assert "jax" not in proc.stdout


def test_setup_meets_the_minimum_by_default():
    assert result_line(run_python(SHOW.format(args="min_devices=2"))) == [
        "cpu",
        "8",
        "True",
        "8",
    ]
    assert result_line(run_python(SHOW.format(args="min_devices=12"))) == [
        "cpu",
        "12",
        "True",
        "12",
    ]


def test_compiled_programs_are_kept_in_the_checkouts_build_folder(tmp_path):
    checkout = tmp_path / "book_checkout"
    (checkout / "book").mkdir(parents=True)
    (checkout / "_config.yml").write_text("title: x\n")
    cache = devices.compilation_cache_dir({}, root=checkout)
    assert cache == checkout / "_build" / "jax_cache"
    # JAX's own variable wins, 0 turns it off, and outside a checkout there is none.
    assert (
        devices.compilation_cache_dir({"JAX_COMPILATION_CACHE_DIR": "/x"}, checkout)
        is None
    )
    assert (
        devices.compilation_cache_dir({"JAXDIST_COMPILATION_CACHE": "0"}, checkout)
        is None
    )
    assert devices.compilation_cache_dir({}, root=tmp_path) is None


def test_the_tests_compile_through_the_persistent_cache():
    import jax

    assert (
        jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]
    )
    # The limit devices.setup() sets: every writer of a folder needs the same kind.
    assert jax.config.jax_compilation_cache_max_size == devices.CACHE_MAX_BYTES


def test_setup_sets_the_caches_folder_and_its_size_limit():
    # No JAX_COMPILATION_CACHE_* variable: setup() chooses the checkout's folder.
    code = """
        import jax
        from jaxdist_lessons import devices
        devices.setup(num_devices=2)
        print(jax.config.jax_compilation_cache_dir)
        print(jax.config.jax_compilation_cache_max_size)
    """
    proc = run_python(code, drop_prefix="JAX_COMPILATION_CACHE")
    assert proc.returncode == 0, proc.stderr
    folder, limit = proc.stdout.splitlines()[-2:]
    assert folder == str(devices.compilation_cache_dir({}))
    assert int(limit) == devices.CACHE_MAX_BYTES


def save_and_restore(path, value):
    """Save ``value`` with Orbax and restore it: the restored array, and how many jit(slice)
    programs the save compiled (one per shape, for the replicas' parts)."""
    import jax
    import orbax.checkpoint as ocp

    from jaxdist_lessons import recompiles

    with (
        recompiles.count_compiles("slice") as slicing,
        ocp.StandardCheckpointer() as checkpointer,
    ):
        checkpointer.save(path, {"x": value})
    target = {
        "x": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
    }
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, target)["x"]
    return restored, slicing.compiles


def test_simulated_devices_have_orbax_write_a_replicated_array_once(tmp_path):
    """setup() (tests/conftest.py ran it) registers Orbax's ArrayHandler without
    replica-parallel saving: a replicated array is written whole, and no program is compiled
    to slice it. Orbax's default on CPU slices it among the 8 replicas, compiling a slice
    program for it. Both restore it exactly."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    # A shape no other test saves, so that no slice program for it is compiled already.
    value = jax.device_put(
        np.arange(24 * 56, dtype=np.float32).reshape(24, 56), NamedSharding(mesh, P())
    )
    ours = ocp.type_handlers.get_type_handler(jax.Array)
    restored, slices = save_and_restore(tmp_path / "ours", value)
    assert slices == 0
    np.testing.assert_array_equal(restored, value)
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(), override=True
    )
    try:
        restored, slices = save_and_restore(tmp_path / "default", value)
    finally:
        ocp.type_handlers.register_type_handler(jax.Array, ours, override=True)
    assert slices >= 1
    np.testing.assert_array_equal(restored, value)
