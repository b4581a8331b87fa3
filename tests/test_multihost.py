"""Multi-process JAX for real: several launched processes, each with simulated CPU devices, joined over gloo.

The launched jobs run ``jaxdist_lessons.multihost_demo`` through ``python -m jaxdist_lessons.launch``.
Every layout of 8 devices (2 processes x 4, 4 x 2, 1 x 8) must give the same all-reduce and the
same training losses. The helpers that need no second process are tested in this process.
"""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, launch, multihost, multihost_demo

LAYOUTS = [(2, 4), (4, 2), (1, 8)]  # processes x devices per process: 8 devices each time
TRAIN = ["--epochs", "2", "--steps-per-epoch", "2"]


def launch_demo(num_processes, devices_per_process, out, *args, timeout=120):
    cmd = [
        sys.executable,
        "-m",
        "jaxdist_lessons.launch",
        "-n",
        str(num_processes),
        "-d",
        str(devices_per_process),
        "--timeout",
        str(timeout),
        "-m",
        "jaxdist_lessons.multihost_demo",
        "--out",
        str(out),
        *args,
    ]
    start = time.monotonic()
    result = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=timeout + 30
    )
    return result, time.monotonic() - start


def reports(out, num_processes):
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(num_processes)]


def demo_pids():
    """Process ids of running multihost_demo processes (to check that none is left behind)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"jaxdist_lessons.multihost_demo" in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Each layout's per-process reports from one launch of ``hello train``."""
    out = {}
    for p, d in LAYOUTS:
        directory = tmp_path_factory.mktemp(f"layout{p}x{d}")
        result, _ = launch_demo(p, d, directory, "hello", "train", *TRAIN)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        out[(p, d)] = (result, reports(directory, p))
    return out


# --- Real processes -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}x{layout[1]}")
def test_every_process_sees_every_device_and_the_all_reduce_crosses_them(layouts, layout):
    num_processes, per_process = layout
    result, ranks = layouts[layout]
    global_ids = ranks[0]["hello"]["global_device_ids"]
    assert len(global_ids) == 8
    for i, report in enumerate(ranks):
        hello = report["hello"]
        assert (hello["process_index"], hello["process_count"]) == (i, num_processes)
        assert hello["global_device_ids"] == global_ids
        assert len(hello["local_device_ids"]) == per_process
        assert (
            hello["local_device_ids"] == global_ids[i * per_process : (i + 1) * per_process]
        )
        assert hello["contributed"] == [
            float(k + 1) for k in range(i * per_process, (i + 1) * per_process)
        ]
        assert (
            hello["psum_on_my_devices"] == [36.0] * per_process
        )  # 1 + 2 + ... + 8 on every device
        assert hello["all_reduce_group_size"] == 8
        assert hello["process_indices_gathered"] == list(range(num_processes))
    assert (
        f"[0] process 0 of {num_processes}: {per_process} local and 8 global CPU devices"
        in result.stdout
    )
    # gloo's connection messages (written by C++ to file descriptor 1) went to stderr, outside our lines
    assert "[Gloo]" not in result.stdout and "[Gloo]" in result.stderr


def test_training_losses_do_not_depend_on_the_layout(layouts):
    losses = {}
    for layout, (_, ranks) in layouts.items():
        per_rank = [r["train"]["losses"] for r in ranks]
        assert all(losses == per_rank[0] for losses in per_rank), (
            "processes disagree on the loss"
        )
        assert len(per_rank[0]) == 4
        losses[layout] = per_rank[0]
    reference = losses[(1, 8)]
    for layout, values in losses.items():
        # The same program on the same 8 devices; only the all-reduce's summation order may differ.
        np.testing.assert_allclose(values, reference, rtol=1e-6, err_msg=str(layout))
    assert reference[-1] < reference[0]


def test_the_launched_runs_match_this_process(layouts):
    here = multihost_demo.train_digits(
        epochs=2, steps_per_epoch=2
    )  # jax.device_count() devices, one process
    assert here["process_count"] == 1
    np.testing.assert_allclose(
        here["losses"], layouts[(1, 8)][1][0]["train"]["losses"], rtol=1e-5
    )


def test_a_killed_process_stops_the_job_and_the_checkpoint_resumes_it(layouts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    before = set(demo_pids())
    args = ["train", *TRAIN, "--checkpoint-dir", str(checkpoints)]
    result, _ = launch_demo(
        2, 4, tmp_path / "killed", *args, "--fail-rank", "1", "--fail-at-epoch", "1"
    )
    assert result.returncode == 128 + 9, result.stderr[-3000:]
    assert "launch: rank 1 (on localhost) was killed by SIGKILL" in result.stderr
    assert "[1] epoch 2: process 1 fails (kill)" in result.stderr
    assert set(demo_pids()) <= before
    assert multihost.latest_step(str(checkpoints)) == 2  # epoch 1's two steps

    # The restart need not use the same layout: one process of 8 devices reads the 2-process checkpoint.
    result, _ = launch_demo(1, 8, tmp_path / "resumed", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"[0] resumed from {checkpoints / '2'}" in result.stdout
    resumed = reports(tmp_path / "resumed", 1)[0]["train"]
    uninterrupted = layouts[(2, 4)][1][0]["train"]["losses"]
    assert resumed["first_step"] == 2
    np.testing.assert_allclose(resumed["losses"], uninterrupted[2:], rtol=1e-6)
    assert multihost.latest_step(str(checkpoints)) == 4


def listening(port):
    """Local addresses with a socket listening on TCP ``port``, from /proc/net/tcp and tcp6 (hex, as the kernel writes them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_local_device_ids_reach_jax_distributed_initialize(tmp_path):
    # On a GPU, jax.distributed.initialize turns local_device_ids into jax_cuda_visible_devices; on the CPU too.
    result, _ = launch_demo(
        2, 1, tmp_path, "--local-device-ids", "1,3", "hello", timeout=60
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for report in reports(tmp_path, 2):
        assert report["hello"]["joined_by"] == "launcher"
        assert report["hello"]["cuda_visible_devices"] == "1,3"


def run_as_slurm(out, ntasks, *args, timeout=60):
    """``multihost_demo`` started ``ntasks`` times with the variables srun sets, without our launcher."""
    port = launch.free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    jobs = []
    for rank in range(ntasks):
        env = {
            **base,
            **multihost_demo.simulated_slurm_env(rank, ntasks, port),
            "JAXDIST_NUM_DEVICES": "1",
        }
        jobs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxdist_lessons.multihost_demo",
                    "--out",
                    str(out),
                    *args,
                    "hello",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [job.communicate(timeout=timeout)[0] for job in jobs]
    return [job.returncode for job in jobs], outputs


@pytest.mark.parametrize("ids, expected", [(None, ["0", "1"]), ("0,1", ["0,1", "0,1"])])
def test_on_slurm_jax_gives_each_process_one_gpu_unless_told(tmp_path, ids, expected):
    codes, outputs = run_as_slurm(
        tmp_path, 2, *(["--local-device-ids", ids] if ids else [])
    )
    assert codes == [0, 0], outputs
    hellos = [report["hello"] for report in reports(tmp_path, 2)]
    assert [h["joined_by"] for h in hellos] == ["SlurmCluster"] * 2
    assert [h["process_index"] for h in hellos] == [0, 1] and hellos[0][
        "psum_on_my_devices"
    ] == [3.0]
    # Without local_device_ids, task i drives GPU SLURM_LOCALID = i only: one process per GPU.
    assert [h["cuda_visible_devices"] for h in hellos] == expected


def test_the_coordinator_listens_on_loopback_only(tmp_path):
    port = launch.free_port()
    cmd = [
        sys.executable,
        "-m",
        "jaxdist_lessons.launch",
        "-n",
        "2",
        "-d",
        "1",
        "--timeout",
        "60",
        "--coordinator",
        f"127.0.0.1:{port}",
        "-m",
        "jaxdist_lessons.multihost_demo",
        "hello",
    ]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = set()
    while job.poll() is None:
        seen.update(listening(port))
        time.sleep(0.05)
    assert job.returncode == 0
    # 127.0.0.1 as /proc writes it for IPv4, or IPv4-mapped IPv6; never 0.0.0.0 nor [::]
    assert seen and seen <= {"0100007F", "0000000000000000FFFF00000100007F"}, seen


@pytest.mark.parametrize("how, status", [("raise", 1), ("hang", launch.EXIT_TIMEOUT)])
def test_a_failing_or_hung_process_does_not_hang_the_job(tmp_path, how, status):
    before = set(demo_pids())
    timeout = 10 if how == "hang" else 120
    result, elapsed = launch_demo(
        2,
        1,
        tmp_path,
        "train",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "1",
        "--fail-rank",
        "1",
        "--fail-at-epoch",
        "0",
        "--fail-how",
        how,
        timeout=timeout,
    )
    assert result.returncode == status, result.stderr[-3000:]
    if how == "raise":
        # fail_fast: the exception ends the process at once, not after the 300 s shutdown barrier
        assert "RuntimeError: process 1 raised at epoch 1" in result.stderr
        assert elapsed < 60
    else:
        # JAX catches SIGTERM (for preemption), so the launcher's SIGKILL after the grace period ends it
        assert f"launch: timed out after {timeout} s" in result.stderr
        assert elapsed < timeout + 15
    assert set(demo_pids()) <= before


def test_without_fail_fast_an_exception_waits_for_the_shutdown_barrier(tmp_path):
    result, elapsed = launch_demo(
        2,
        1,
        tmp_path,
        "--shutdown-timeout",
        "5",
        "--no-fail-fast",
        "train",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "1",
        "--fail-rank",
        "1",
        "--fail-at-epoch",
        "0",
        "--fail-how",
        "raise",
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "RuntimeError: process 1 raised at epoch 1" in output
    # The raising process waited in shutdown() for the others, which waited for it, until the barrier's timeout.
    assert "Shutdown barrier" in output and "Barrier timed out" in output
    assert elapsed < 120


# --- In this process ------------------------------------------------------------------------------


def test_launcher_settings_from_the_environment():
    env = {
        launch.ENV_COORDINATOR: "127.0.0.1:1234",
        launch.ENV_NUM_PROCESSES: "4",
        launch.ENV_PROCESS_ID: "3",
    }
    assert multihost.launcher_settings(env) == multihost.LauncherSettings(
        "127.0.0.1:1234", 4, 3, "127.0.0.1:1234"
    )
    assert (
        multihost.launcher_settings(
            {**env, launch.ENV_COORDINATOR_BIND: "0.0.0.0:1234"}
        ).bind
        == "0.0.0.0:1234"
    )
    assert multihost.launcher_settings({}) is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({launch.ENV_PROCESS_ID: ""}, "are set but \\['JAXDIST_PROCESS_ID'\\] are not"),
        ({launch.ENV_PROCESS_ID: "4"}, "JAXDIST_PROCESS_ID=4 must be in 0..3"),
        (
            {launch.ENV_NUM_PROCESSES: "four"},
            "JAXDIST_NUM_PROCESSES must be a non-negative integer, got 'four'",
        ),
    ],
)
def test_bad_launcher_settings(change, message):
    env = {
        launch.ENV_COORDINATOR: "127.0.0.1:1234",
        launch.ENV_NUM_PROCESSES: "4",
        launch.ENV_PROCESS_ID: "0",
    }
    with pytest.raises(multihost.MultihostError, match=message):
        multihost.launcher_settings({**env, **change})


def test_initialize_after_jax_started_says_how_to_fix_it():
    jax.devices()
    with pytest.raises(
        multihost.MultihostError, match="call multihost.initialize\\(\\) first thing"
    ):
        multihost.initialize()


def test_the_private_jax_apis_multihost_uses_are_still_there():
    # multihost reads these private JAX names; if a JAX release moves them, this fails first.
    from jax._src import clusters, xla_bridge

    assert callable(xla_bridge.backends_are_initialized)
    assert "SlurmCluster" in {env.__name__ for env in clusters.ClusterEnv._cluster_types}


def test_a_moved_cluster_registry_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(multihost.clusters.ClusterEnv, "_cluster_types")
    with pytest.raises(
        multihost.MultihostError, match="moved its private list of cluster types"
    ):
        multihost.detected_cluster()


def test_jax_detects_slurm_from_its_variables(monkeypatch):
    for name in [
        "SLURM_JOB_ID",
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "OMPI_MCA_orte_hnp_uri",
        "KUBERNETES_SERVICE_HOST",
    ]:
        monkeypatch.delenv(name, raising=False)
    assert multihost.detected_cluster() is None
    for name, value in [
        ("SLURM_JOB_ID", "7"),
        ("SLURM_STEP_NODELIST", "node[0-1]"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_PROCID", "1"),
        ("SLURM_LOCALID", "0"),
    ]:
        monkeypatch.setenv(name, value)
    assert multihost.detected_cluster() == "SlurmCluster"


def test_single_process_helpers():
    n = jax.device_count()
    info = multihost.process_info("single process")
    assert (info.process_index, info.process_count, info.global_devices) == (0, 1, n)
    assert (
        str(info)
        == f"process 0 of 1: {n} local and {n} global CPU devices (joined by single process)"
    )
    mesh = multihost.global_mesh((n,), ("data",), axis_types=AxisType.Explicit)
    x = multihost.global_array(np.arange(2 * n, dtype=np.float32), mesh)
    assert x.shape == (2 * n,) and x.sharding.spec == P("data")
    np.testing.assert_array_equal(multihost.allgather(x, tiled=True), np.arange(2 * n))
    assert multihost.allgather(np.int32(5)).tolist() == [5]
    multihost.sync("test barrier")
    assert multihost.is_primary()


def test_native_stdout_goes_to_stderr_and_print_to_stdout():
    # os.write(1, ...) is what native code (gloo's std::cout) does: it writes to file descriptor 1.
    program = (
        "import os; from jaxdist_lessons import multihost\n"
        "print('before')\n"
        "multihost.native_stdout_to_stderr()\n"
        "os.write(1, b'native\\n'); print('python', flush=True); os.write(1, b'native again\\n')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\npython\n"
    assert result.stderr.endswith("native\nnative again\n")


def test_print0_prints_on_process_0(capsys):
    multihost.print0("only once")
    assert capsys.readouterr().out == "only once\n"


def test_hybrid_mesh_in_one_process():
    n = jax.device_count()
    mesh = multihost.hybrid_mesh(
        (1, n), (1, 1), ("data", "model"), axis_types=AxisType.Explicit
    )
    assert dict(mesh.shape) == {"data": 1, "model": n}
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert multihost.process_grid(mesh).tolist() == [[0] * n]
    with pytest.raises(multihost.MultihostError, match="must multiply to the 1 processes"):
        multihost.hybrid_mesh((1, n), (2, 1), ("data", "model"))
    with pytest.raises(multihost.MultihostError, match="one entry per axis"):
        multihost.hybrid_mesh((n,), (1, 1), ("data", "model"))


def test_replica_groups_of_a_compiled_psum_and_their_processes():
    n = jax.device_count()
    mesh = multihost.global_mesh((n,), ("data",), axis_types=AxisType.Explicit)
    fn = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
    )
    hlo = fn.lower(multihost.global_array(np.ones(n, np.float32), mesh)).compile().as_text()
    [op] = [c for c in comms.collectives(hlo) if c.kind == "all-reduce"]
    groups = comms.replica_group_lists(op.replica_groups, num_devices=n)
    assert sorted(i for group in groups for i in group) == list(range(n))
    assert multihost.processes_per_group(mesh, groups) == [[0]] * len(groups)


def test_latest_step_ignores_unfinished_checkpoints(tmp_path):
    assert multihost.latest_step(str(tmp_path / "none")) is None
    for name in ["3", "10", "7", "12.orbax-checkpoint-tmp-1"]:
        (tmp_path / name).mkdir()
    assert multihost.latest_step(str(tmp_path)) == 10
    assert multihost.restore_latest(str(tmp_path / "none"), None, None) is None


def test_fail_fast_reraises_in_a_single_process():
    with pytest.raises(ZeroDivisionError), multihost.fail_fast():
        print(1 / 0)
