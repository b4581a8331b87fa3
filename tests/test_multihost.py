"""Multi-process JAX for real: Open MPI's ``mpirun`` starts ``jaxdist_lessons.multihost_demo``
once per process, each with simulated CPU devices, joined by JAX's mpi4py detection over gloo.

Every layout of 8 devices (2 processes x 4, 1 x 8) must give the same all-reduce and the
same training losses; a process that is killed, raises or hangs must end the job with a non-zero
status and leave no process behind; a restart resumes from the last checkpoint exactly. The
timeouts are short here (the machine has 2 cores): the times themselves are measured by
``benchmarks/failure_time.py``, not asserted. The helpers that need no second process are
tested in this process or in a single subprocess.
"""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons import comms, hang_lab, hlo, multihost, multihost_demo

# The demo's processes, to check that a job leaves none behind.
DEMO = "jaxdist_lessons.multihost_demo"

# processes x devices per process: 8 devices each time. Chapter 08_multi_host runs more layouts of
# examples/train.py (8 x 1 and a hostfile among them) and checks their losses.
LAYOUTS = [(2, 4), (1, 8)]
TRAIN = ["--epochs", "2", "--steps-per-epoch", "2"]
SHORT = ["--initialization-timeout", "60", "--heartbeat-timeout", "10"]
# Open MPI refuses to run as root (CI's user) unless both are set.
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable))


def mpirun(processes, devices, out, *args, mpirun_args=(), timeout=180):
    """``mpirun -np P python -m jaxdist_lessons.multihost_demo --devices D --out OUT args``."""
    command = [
        MPIRUN,
        "--map-by",
        ":OVERSUBSCRIBE",
        "--output",
        "tag",
        *mpirun_args,
        "-np",
        str(processes),
        sys.executable,
        "-m",
        "jaxdist_lessons.multihost_demo",
        "--devices",
        str(devices),
        "--out",
        str(out),
        *SHORT,
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    return subprocess.run(
        command,
        env={**env, **ROOT_OK},
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def reports(out, num_processes):
    return [
        json.loads((out / f"rank{i}.json").read_text()) for i in range(num_processes)
    ]


def test_mpirun_is_installed_with_the_requirements():
    assert MPIRUN is not None, "pip install -r requirements.txt puts mpirun in the venv"
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True)
    assert version.stdout.startswith("mpirun (Open MPI) 5.")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Each layout's result and per-process reports from one ``mpirun`` of ``hello train``."""
    out = {}
    for p, d in LAYOUTS:
        directory = tmp_path_factory.mktemp(f"layout{p}x{d}")
        result = mpirun(p, d, directory, "hello", "train", *TRAIN)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        out[(p, d)] = (result, reports(directory, p))
    return out


# --- Real processes under mpirun ------------------------------------------------------------


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda layout: f"{layout[0]}x{layout[1]}"
)
def test_every_process_sees_every_device_and_the_all_reduce_crosses_them(
    layouts, layout
):
    num_processes, per_process = layout
    result, ranks = layouts[layout]
    global_ids = ranks[0]["hello"]["global_device_ids"]
    assert len(global_ids) == 8
    for i, report in enumerate(ranks):
        hello = report["hello"]
        assert (hello["process_index"], hello["process_count"]) == (i, num_processes)
        assert hello["joined_by"] == "mpi4py"
        assert hello["environment"]["OMPI_COMM_WORLD_RANK"] == str(i)
        # JAX's mpi4py detection hands each process one GPU: the one numbered by its rank among
        # the processes of its host (MPI's COMM_TYPE_SHARED communicator), here its world rank.
        assert hello["cuda_visible_devices"] == str(i)
        assert hello["global_device_ids"] == global_ids
        assert (
            hello["local_device_ids"]
            == global_ids[i * per_process : (i + 1) * per_process]
        )
        assert hello["contributed"] == [
            float(k + 1) for k in range(i * per_process, (i + 1) * per_process)
        ]
        assert hello["psum_on_my_devices"] == [36.0] * per_process  # 1 + 2 + ... + 8
        assert hello["all_reduce_group_size"] == 8
        assert hello["process_indices_gathered"] == list(range(num_processes))
    assert (
        f"[1,0]<stdout>: process 0 of {num_processes}: {per_process} local and 8 global CPU "
        "devices (joined by mpi4py)" in result.stdout
    )
    # gloo's connection messages (written by C++ to file descriptor 1) went to stderr
    assert "[Gloo]" not in result.stdout and "[Gloo]" in result.stderr


def test_training_losses_do_not_depend_on_the_layout(layouts):
    losses = {}
    for layout, (_, ranks) in layouts.items():
        per_rank = [r["train"]["losses"] for r in ranks]
        assert all(values == per_rank[0] for values in per_rank), "processes disagree"
        assert len(per_rank[0]) == 4
        losses[layout] = per_rank[0]
    reference = losses[(1, 8)]
    for layout, values in losses.items():
        # The same program on the same 8 devices; only the all-reduce's summation order may differ.
        np.testing.assert_allclose(values, reference, rtol=1e-6, err_msg=str(layout))
    assert reference[-1] < reference[0]


def test_the_launched_runs_match_this_process(layouts):
    # one process, 8 devices
    here = multihost_demo.train_digits(epochs=2, steps_per_epoch=2)
    assert here["process_count"] == 1
    np.testing.assert_allclose(
        here["losses"], layouts[(1, 8)][1][0]["train"]["losses"], rtol=1e-5
    )


def test_a_killed_process_ends_the_job_and_the_checkpoint_resumes_it(layouts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    before = set(hang_lab.module_pids(DEMO))
    args = ["train", *TRAIN, "--checkpoint-dir", str(checkpoints)]
    result = mpirun(
        2, 4, tmp_path / "killed", *args, "--fail-rank", "1", "--fail-at-epoch", "1"
    )
    assert result.returncode == 128 + 9, result.stderr[-3000:]
    assert "[1,1]<stdout>: epoch 2: process 1 fails (kill)" in result.stdout
    assert (
        "process rank 1 with PID" in result.stderr
        and "signal 9 (Killed)" in result.stderr
    )
    assert set(hang_lab.module_pids(DEMO)) <= before
    assert ocp.CheckpointManager(checkpoints).latest_step() == 2  # epoch 1's two steps

    # The restart need not use the same layout: one process of 8 devices reads the 2-process checkpoint.
    result = mpirun(1, 8, tmp_path / "resumed", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"[1,0]<stdout>: resumed from {checkpoints / '2'}" in result.stdout
    resumed = reports(tmp_path / "resumed", 1)[0]["train"]
    uninterrupted = layouts[(2, 4)][1][0]["train"]["losses"]
    assert resumed["first_step"] == 2
    np.testing.assert_allclose(resumed["losses"], uninterrupted[2:], rtol=1e-6)
    assert ocp.CheckpointManager(checkpoints).latest_step() == 4


FAIL = ["train", "--epochs", "1", "--steps-per-epoch", "1", "--fail-rank", "1"]


@pytest.mark.parametrize("how", ["raise", "hang"])
def test_a_failing_or_hung_process_ends_the_job(tmp_path, how):
    before = set(hang_lab.module_pids(DEMO))
    # A hang sends no error: only a time limit ends it (mpirun's --timeout, the scheduler's).
    limit = ["--timeout", "12"] if how == "hang" else []
    result = mpirun(
        2,
        1,
        tmp_path,
        *FAIL,
        "--fail-at-epoch",
        "0",
        "--fail-how",
        how,
        mpirun_args=limit,
    )
    assert result.returncode != 0
    if how == "raise":
        # The exception ends its process at once (status 1), not after the shutdown barrier.
        assert result.returncode == 1, result.stderr[-3000:]
        assert (
            "[1,1]<stderr>: RuntimeError: process 1 raised at epoch 1" in result.stderr
        )
        assert "exited with non-zero status" in result.stderr
        assert "Barrier timed out" not in result.stderr
    else:
        assert "The user-provided time limit for job execution has been reached" in (
            result.stderr
        )
    assert set(hang_lab.module_pids(DEMO)) <= before


def test_without_exit_on_error_an_exception_waits_in_the_shutdown_barrier(tmp_path):
    result = mpirun(
        2,
        1,
        tmp_path,
        # Process 0 never reaches the barrier (it waits in a collective for process 1): a
        # barrier of one second times out as surely as a longer one.
        "--shutdown-timeout",
        "1",
        "--no-exit-on-error",
        *FAIL,
        "--fail-at-epoch",
        "0",
        "--fail-how",
        "raise",
    )
    assert result.returncode != 0
    assert "RuntimeError: process 1 raised at epoch 1" in result.stderr
    # The raising process waited in shutdown() for the others, which waited for it.
    assert "Shutdown barrier" in result.stderr and "Barrier timed out" in result.stderr


# --- One process ----------------------------------------------------------------------------


def python(program, env=None, timeout=120):
    """Run ``program`` in a fresh Python without any cluster's variables."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI", "JAX_", "JAXDIST_"))
    }
    return subprocess.run(
        [sys.executable, "-c", program],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_without_a_cluster_initialize_runs_a_single_process():
    result = python(
        "from jaxdist_lessons import multihost\nprint(multihost.initialize(3))\n"
        "import jax; print(jax.distributed.is_initialized())"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "process 0 of 1: 3 local and 3 global CPU devices (joined by single process)",
        "False",
    ]


def test_jax_says_so_when_it_finds_no_cluster():
    # initialize() tells "no cluster" from a misconfiguration by this exact message of JAX's.
    result = python(
        "import jax\ntry:\n    jax.distributed.initialize()\n"
        "except ValueError as e:\n    print(repr(str(e)))"
    )
    assert result.stdout.strip() == repr(multihost._NO_CLUSTER)


def test_explicit_arguments_join_without_detection():
    # a port the system says is free now (a pid-derived one collided with a busy port)
    port = hang_lab.free_port()
    result = python(
        "from jaxdist_lessons import multihost\n"
        f"print(multihost.initialize(2, coordinator_address='127.0.0.1:{port}', "
        "num_processes=1, process_id=0))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "process 0 of 1: 2 local and 2 global CPU devices (joined by arguments)"
    )


def test_an_uncaught_exception_exits_at_once_without_atexit():
    program = (
        "import atexit\nfrom jaxdist_lessons import multihost\n"
        "atexit.register(print, 'atexit ran')\n"
        "multihost.exit_at_once_on_error()\n"
        "raise RuntimeError('boom')\n"
    )
    result = python(program)
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith("RuntimeError: boom")
    # jax.distributed.shutdown() is an atexit hook
    assert "atexit ran" not in result.stdout


def test_mpi_launchers_are_recognised_by_their_variables():
    assert multihost.launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "2"})
    assert multihost.launched_by_mpi({"PMI_SIZE": "2"})
    assert not multihost.launched_by_mpi({"SLURM_PROCID": "0"})


def test_a_launched_command_finds_this_python_s_mpirun():
    """A notebook's kernel started without activating the virtual environment has no
    mpirun on PATH; the launcher's environment puts this Python's folder first."""
    env = multihost.launcher_environment({"PATH": "/usr/bin", "OTHER": "kept"})
    assert env == {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin",
        "OTHER": "kept",
    }
    found = shutil.which("mpirun", path=env["PATH"])
    assert found == os.path.join(os.path.dirname(sys.executable), "mpirun")
    assert multihost.launcher_environment({})["PATH"] == os.path.dirname(sys.executable)


def test_initialize_after_jax_started_says_how_to_fix_it():
    jax.devices()
    with pytest.raises(
        multihost.MultihostError, match="call multihost.initialize\\(\\) first thing"
    ):
        multihost.initialize()


def test_single_process_helpers():
    n = jax.device_count()
    info = multihost.process_info()
    assert (info.process_index, info.process_count, info.global_devices) == (0, 1, n)
    assert (
        str(info)
        == f"process 0 of 1: {n} local and {n} global CPU devices (joined by single process)"
    )
    assert multihost.is_primary()


def test_native_stdout_goes_to_stderr_and_print_to_stdout():
    # os.write(1, ...) is what native code (gloo's std::cout) does: it writes to file descriptor 1.
    program = (
        "import os; from jaxdist_lessons import multihost\n"
        "print('before')\n"
        "multihost.native_stdout_to_stderr()\n"
        "os.write(1, b'native\\n'); print('python', flush=True); os.write(1, b'native again\\n')\n"
    )
    result = python(program)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\npython\n"
    assert result.stderr.endswith("native\nnative again\n")


def test_print0_prints_on_process_0(capsys):
    multihost.print0("only once")
    assert capsys.readouterr().out == "only once\n"


def test_hybrid_mesh_in_one_process():
    n = jax.device_count()
    mesh = multihost.hybrid_mesh(
        (1, n), (1, 1), ("data", "tensor"), axis_types=AxisType.Explicit
    )
    assert dict(mesh.shape) == {"data": 1, "tensor": n}
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert multihost.process_grid(mesh).tolist() == [[0] * n]
    with pytest.raises(multihost.MultihostError, match="must multiply to the 1 nodes"):
        multihost.hybrid_mesh((1, n), (2, 1), ("data", "tensor"))
    with pytest.raises(multihost.MultihostError, match="one entry per axis"):
        multihost.hybrid_mesh((n,), (1, 1), ("data", "tensor"))


def test_hybrid_mesh_over_two_nodes_given_in_one_process():
    # Nodes dealt round-robin (as mpirun --map-by node ranks them): device k is on node k % 2.
    devices = jax.devices()[:8]
    nodes = {d.id: i % 2 for i, d in enumerate(devices)}
    mesh = multihost.hybrid_mesh(
        (1, 4), (2, 1), ("data", "tensor"), devices=devices, nodes=nodes
    )
    assert multihost.node_grid(mesh, nodes).tolist() == [[0] * 4, [1] * 4]
    assert [d.id for d in mesh.devices[1]] == [1, 3, 5, 7]
    with pytest.raises(
        multihost.MultihostError, match=r"to the devices of each node \(\[3, 5\]\)"
    ):
        multihost.hybrid_mesh(
            (1, 4),
            (2, 1),
            ("data", "tensor"),
            devices=devices,
            nodes={d.id: int(i >= 3) for i, d in enumerate(devices)},
        )


class GPU(NamedTuple):
    id: int
    process_index: int


def test_node_device_grid_keeps_a_nodes_gpus_together_for_one_process_per_gpu():
    # 2 nodes x 8 GPUs, one process per GPU: a process is one GPU, so the node is the granule.
    gpus = [GPU(i, i) for i in range(16)]
    grid = multihost.node_device_grid(
        (1, 4, 2), (2, 1, 1), gpus, {g.id: g.id // 8 for g in gpus}
    )
    assert grid.shape == (2, 4, 2)
    ids = np.vectorize(lambda g: g.id)(grid)
    assert ids[0].ravel().tolist() == list(range(8)) and ids[
        1
    ].ravel().tolist() == list(range(8, 16))
    assert ids[1, :, 1].tolist() == [9, 11, 13, 15]  # a column of fsdp: one node's GPUs
    with pytest.raises(multihost.MultihostError, match="one entry per axis"):
        multihost.node_device_grid((8,), (2, 1), gpus, {g.id: 0 for g in gpus})


def test_nodes_are_named_by_slurm_or_the_hostname_and_numbered_in_order():
    assert multihost.node_key({"SLURM_NODEID": "3"}) == "slurm node 3"
    assert multihost.node_key({}) == socket.gethostname()
    # Open MPI's OMPI_COMM_WORLD_NODE_RANK is a rank inside a node, not a node: not used.
    assert (
        multihost.node_key({"OMPI_COMM_WORLD_NODE_RANK": "1"}) == socket.gethostname()
    )
    assert multihost.number_nodes(["b", "a", "b", "c", "a"]) == [0, 1, 0, 2, 1]
    assert multihost.node_of_processes({}) == [0]
    assert multihost.node_of_processes({multihost.NODE_OVERRIDE: "5"}) == [5]
    with pytest.raises(
        multihost.MultihostError, match="names 2 processes' nodes; the job has 1"
    ):
        multihost.node_of_processes({multihost.NODE_OVERRIDE: "0,1"})


NODE_DRIVER = pathlib.Path(__file__).with_name("node_mesh_driver.py")


def node_mesh_job(processes, per_process, nodes, ici, dcn):
    """``mpirun`` of ``tests/node_mesh_driver.py``: its printed lines and its report."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_"))
    }
    env |= {
        **ROOT_OK,
        multihost.NODE_OVERRIDE: nodes,
        "PYTHONPATH": str(NODE_DRIVER.parents[1]),
    }
    command = [
        MPIRUN,
        "--map-by",
        ":OVERSUBSCRIBE",
        "-np",
        str(processes),
        sys.executable,
        str(NODE_DRIVER),
        str(per_process),
        ici,
        dcn,
    ]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout)  # which device is on which node (pytest -s shows it)
    [report] = [
        line for line in result.stdout.splitlines() if line.startswith("REPORT ")
    ]
    return result.stdout.splitlines(), json.loads(report.removeprefix("REPORT "))


def test_one_process_per_gpu_2_nodes_x_4_tensor_and_fsdp_stay_in_a_node():
    # 8 processes of 1 device, nodes dealt round-robin (mpirun --map-by node): even ranks on node 0.
    lines, report = node_mesh_job(8, 1, "0,1,0,1,0,1,0,1", "1,2,2", "2,1,1")
    assert report["detected"] == [0] * 8  # without the override: one hostname, one node
    assert report["node_grid"] == [[[0, 0], [0, 0]], [[1, 1], [1, 1]]]
    assert (
        "device  2048 of process 1: node 1, mesh position {'data': 1, 'fsdp': 0, 'tensor': 0}"
        in lines
    )
    axes = report["axes"]
    assert axes["tensor"]["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axes["tensor"]["nodes"] == axes["fsdp"]["nodes"] == [[0], [0], [1], [1]]
    # HSDP: only the replicas' all-reduce crosses
    assert axes["data"]["nodes"] == [[0, 1]] * 4
    assert {axis: a["result"] for axis, a in axes.items()} == {
        "data": 2.0,
        "fsdp": 2.0,
        "tensor": 2.0,
    }


def test_one_process_per_node_2_nodes_x_4_tensor_stays_in_a_node():
    _, report = node_mesh_job(2, 4, "0,1", "1,1,4", "1,2,1")
    assert report["node_grid"] == [[[0] * 4, [1] * 4]]
    axes = report["axes"]
    # an axis of size 1: groups of one
    assert axes["data"]["groups"] == [[i] for i in range(8)]
    assert axes["tensor"]["nodes"] == [[0], [1]] and axes["tensor"]["result"] == 4.0
    assert axes["fsdp"]["nodes"] == [[0, 1]] * 4 and axes["fsdp"]["result"] == 2.0


def test_replica_groups_of_a_compiled_psum_and_their_processes():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    fn = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "data"),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
    )
    text = (
        fn.lower(jax.device_put(np.ones(n, np.float32), NamedSharding(mesh, P("data"))))
        .compile()
        .as_text()
    )
    [op] = [c for c in comms.collectives(text) if c.kind == "all-reduce"]
    groups = hlo.replica_group_lists(op.replica_groups, num_devices=n)
    assert sorted(i for group in groups for i in group) == list(range(n))
    assert multihost.processes_per_group(mesh, groups) == [[0]] * len(groups)
