"""examples/bandwidth.py: each collective moves the bytes its nccl-tests bus factor says (read
from the compiled program), the table's columns agree, --expect-gbps fails a slow link, and
the script runs under mpirun across two simulated nodes, and alone without joining."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxdist_lessons import comms
from jaxdist_lessons.traffic import Transfer, sent_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import bandwidth  # noqa: E402

BIN = os.path.dirname(sys.executable)
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
N = jax.device_count()


def clean_env(**variables) -> dict:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_"))
    }
    return {**env, **ROOT_OK, "PATH": f"{BIN}:{env['PATH']}", **variables}


def run_bandwidth(*flags: str, launcher: tuple[str, ...] = (sys.executable,), **env):
    """examples/bandwidth.py with ``flags`` (two timed iterations after one warm-up), in a
    clean environment plus ``env``."""
    return subprocess.run(
        [*launcher, "examples/bandwidth.py", *flags, "--iters", "2", "--warmup", "1"],
        cwd=ROOT,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(N < 4 or N % 2, reason="two simulated nodes of N/2 devices")
@pytest.mark.parametrize("collective", bandwidth.COLLECTIVES)
@pytest.mark.parametrize("axis", ["local", "node"])
def test_each_collective_moves_what_its_bus_factor_says(collective, axis):
    """Over one mesh axis of two simulated nodes: one collective of its kind in the compiled
    program, whose ring sends are the bus factor times S; and the right values."""
    mesh = bandwidth.node_mesh(per_node=N // 2)
    n = mesh.shape[axis]
    size = 64 * bandwidth.unit_bytes(collective, n)
    step, x = bandwidth.program(collective, mesh, axis, size)
    [found] = comms.collectives(step.lower(x).compile().as_text())
    result = {
        "all-reduce": size,
        "all-gather": size,
        "reduce-scatter": size // n,
        "all-to-all": size,
        "collective-permute": size,
    }[collective]
    assert (found.kind, found.bytes, found.group_size) == (
        collective,
        result,
        None if collective == "collective-permute" else n,
    )
    sent = sent_bytes(Transfer(found.kind, found.bytes, found.group_size))
    assert sent == pytest.approx(bandwidth.bus_factor(collective, n) * size, rel=1e-12)
    got = np.asarray(step(x).addressable_shards[0].data)
    summed = collective in ("all-reduce", "reduce-scatter")
    assert (got == (n if summed else 1)).all() and got.size * 4 == result


def test_the_table_agrees_with_itself_and_a_slow_link_fails(tmp_path):
    """4 CPU devices, sizes to 1 KiB: algbw = S / time and busbw = algbw x factor in every
    row; sizes double and split evenly; --expect-gbps above what it measured: status 1,
    one line saying which collectives, and the JSON written before."""
    out = tmp_path / "rows.json"
    done = run_bandwidth(
        *("--num-devices", "4", "--max-bytes", "1024", "--expect-gbps", "1e6"),
        *("--json", str(out)),
    )
    assert done.returncode == 1, done.stderr[-2000:]
    [line] = [x for x in done.stderr.splitlines() if "bandwidth FAILED" in x]
    assert "below 1e+06 GB/s: all-reduce" in line and "collective-permute" in line
    rows = json.loads(out.read_text())["rows"]
    assert {r["collective"] for r in rows} == set(bandwidth.COLLECTIVES)
    for r in rows:
        assert r["algbw_gbps"] == pytest.approx(r["size"] / r["seconds"] / 1e9)
        factor = bandwidth.bus_factor(r["collective"], 4)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
        assert r["size"] % bandwidth.unit_bytes(r["collective"], 4) == 0
    gathers = [r["size"] for r in rows if r["collective"] == "all-gather"]
    assert gathers == [16, 32, 64, 128, 256, 512, 1024]
    for size in gathers:  # as many table lines as rows, in the printed order
        assert f"\n{size:>12} {size // 4:>11} " in done.stdout


def test_one_device_times_host_copies_instead(tmp_path):
    """One device has no collective to time: the two copies between pinned host memory
    and the device, each a table with bus factor 1, and the note that says so. No
    launcher started it, so it never calls jax.distributed.initialize(): JAX's Open MPI 4
    detection takes OMPI_MCA_orte_hnp_uri alone and raises on one without an address."""
    out = tmp_path / "rows.json"
    done = run_bandwidth(
        *("--num-devices", "1", "--max-bytes", "64", "--json", str(out)),
        OMPI_MCA_orte_hnp_uri="1.0;no-address",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "# one device: no collective to time; copies between pinned host" in done.stdout
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["collective"], r["size"]) for r in rows] == [
        (copy, size) for copy in bandwidth.COPIES for size in (8, 16, 32, 64)
    ]
    assert all(r["busbw_gbps"] == r["algbw_gbps"] and r["group"] == 1 for r in rows)
    step, x = bandwidth.copy_program("device-to-host", 64)
    assert step(x).sharding.memory_kind == "pinned_host"
    assert x.sharding.memory_kind == "device" and x.size == 16


def test_it_runs_under_mpirun_across_two_simulated_nodes():
    """mpirun -np 2, 4 CPU devices a process, a node a process (--per-node 4): all-reduce
    across the nodes, groups of 2; process 0 alone prints the table."""
    mpirun = ("mpirun", "--map-by", ":OVERSUBSCRIBE", "-np", "2", "python")
    done = run_bandwidth(
        *("--collective", "all-reduce", "--axis", "across", "--per-node", "4"),
        *("--max-bytes", "64"),
        launcher=mpirun,
        JAX_NUM_CPU_DEVICES="4",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "8 devices (cpu) on 2 node(s), 2 process(es); groups of 2" in done.stdout
    lines = [x.split() for x in done.stdout.splitlines() if x[:12].strip().isdigit()]
    assert [int(x[0]) for x in lines] == [8, 16, 32, 64]  # one table, not two
