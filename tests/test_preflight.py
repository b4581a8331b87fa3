"""examples/preflight.py on recorded outputs: a DGX H100's nvidia-smi (its query, header and
``topo -m`` matrix, in the format NVIDIA's tool prints), a PCIe box, a node without GPUs;
every check's ok, WARN and FAIL branch, and the exit status."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import preflight  # noqa: E402

H100_QUERY = "\n".join(["NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15"] * 8) + "\n"
H100_HEADER = "| NVIDIA-SMI 550.54.15             Driver Version: 550.54.15     CUDA Version: 12.4 |"
# nvidia-smi topo -m on 8 GPUs joined by NVSwitch: 18 NVLinks between every pair.
H100_TOPO = "\t" + "\t".join(f"GPU{j}" for j in range(8)) + "\tNIC0\tCPU Affinity\n"
for i in range(8):
    row = ["X" if i == j else "NV18" for j in range(8)]
    H100_TOPO += f"GPU{i}\t" + "\t".join(row) + "\tPXB\t0-55,112-167\n"
H100_TOPO += "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
PCIE_TOPO = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSYS\t0-31\nGPU1\tSYS\t X \t0-31\n"
CUDA12 = {"jax-cuda12-plugin": "0.10.2", "nvidia-nccl-cu12": "2.27.7"}
ACTIVE = [(f"mlx5_{k}", "1", "4: ACTIVE") for k in range(8)]


def node(**changes) -> preflight.Node:
    base = dict(
        smi=H100_QUERY,
        smi_header=H100_HEADER,
        topo=H100_TOPO,
        wheels=CUDA12,
        environ={},
        infiniband=ACTIVE,
    )
    return preflight.Node(**{**base, **changes})


def levels(findings, what: str) -> list[str]:
    return [f.level for f in findings if f.what == what]


def test_a_healthy_dgx_h100_passes():
    findings = preflight.check(node(environ={"NCCL_DEBUG": "WARN"}), expect_gpus=8)
    assert not [f for f in findings if f.level != "ok"], findings
    assert findings[0].detail == "NVIDIA H100 80GB HBM3, 81,559 MiB, driver 550.54.15"
    details = {f.what: f.detail for f in findings}
    assert details["driver"] == "550.54.15; jax-cuda12-plugin 0.10.2 needs >= 525"
    assert details["CUDA"].startswith("driver supports CUDA 12.4; pip: ")
    assert "nvidia-nccl-cu12 2.27.7" in details["CUDA"]
    assert details["links"] == "NVLink between every pair of GPUs (NV18)"
    assert details["variable"] == "NCCL_DEBUG=WARN"


def test_what_fails_a_node():
    """A CUDA 13 wheel on a 550 driver (JAX asks >= 580), seven GPUs where eight were
    expected, an InfiniBand port down."""
    down = [*ACTIVE[:7], ("mlx5_7", "1", "1: DOWN")]
    findings = preflight.check(
        node(
            smi=H100_QUERY.replace(
                "NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15\n", "", 1
            ),
            wheels={"jax-cuda13-plugin": "0.10.2"},
            infiniband=down,
        ),
        expect_gpus=8,
    )
    failed = {f.what: f.detail for f in findings if f.level == "FAIL"}
    assert failed == {
        "GPU count": "7 visible, expected 8 (CUDA_VISIBLE_DEVICES=unset)",
        "driver": "550.54.15; jax-cuda13-plugin 0.10.2 needs >= 580",
        "InfiniBand": "mlx5_7 port 1: 1: DOWN",
    }


def test_the_warnings():
    """PCIe-only GPUs, no InfiniBand, no JAX CUDA wheel; and the three traps."""
    two = "".join(H100_QUERY.splitlines(keepends=True)[:2])
    pcie = preflight.check(node(smi=two, topo=PCIE_TOPO, wheels={}, infiniband=[]))
    warned = {f.what: f.detail for f in pcie if f.level == "WARN"}
    assert warned == {
        "links": "no NVLink between GPU0-GPU1 SYS",
        "InfiniBand": "no adapter: across nodes NCCL uses sockets (TCP), far slower",
        "JAX CUDA wheel": 'none installed: JAX will not use the GPUs (pip install "jax[cuda13]")',
    }
    environ = {
        "LD_LIBRARY_PATH": "/usr/local/cuda-12.2/lib64:/opt/lib",
        "SLURM_GPUS_PER_TASK": "1",
        "SLURM_NTASKS_PER_NODE": "8(x2)",
    }
    traps = preflight.traps(environ, CUDA12, 1)
    assert [f.what for f in traps] == ["LD_LIBRARY_PATH", "SLURM"]
    assert traps[0].detail.startswith("/usr/local/cuda-12.2/lib64 can shadow")
    assert "--gpus-per-task=1 with 8 tasks a node" in traps[1].detail
    shared = {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": ".75",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "16",
    }
    [memory] = preflight.traps(shared, CUDA12, 8)  # 2 processes a GPU
    assert memory.detail.startswith("XLA_PYTHON_CLIENT_MEM_FRACTION=.75 for each of 2")
    assert (
        preflight.traps({**shared, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, CUDA12, 8) == []
    )


def test_no_gpu_and_the_exit_status(monkeypatch, capsys, tmp_path):
    assert preflight.check(node(smi=None)) == [
        preflight.Finding(
            "ok", "GPUs", "no nvidia-smi: no NVIDIA GPU here, nothing to check"
        )
    ]
    monkeypatch.setattr(preflight, "gather", lambda: node(smi=None))
    assert preflight.main([]) == 0
    assert capsys.readouterr().out.endswith("preflight passed: 0 failed, 0 warnings\n")
    monkeypatch.setattr(preflight, "gather", lambda: node())
    assert preflight.main(["--expect-gpus", "16"]) == 1
    assert "preflight FAILED: 1 failed, 0 warnings" in capsys.readouterr().out
    # sysfs as the kernel lays it out: <adapter>/ports/<n>/state
    for adapter, state in (("mlx5_0", "4: ACTIVE"), ("mlx5_1", "1: DOWN")):
        port = tmp_path / adapter / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
    assert preflight.infiniband(tmp_path) == [
        ("mlx5_0", "1", "4: ACTIVE"),
        ("mlx5_1", "1", "1: DOWN"),
    ]


@pytest.mark.parametrize("topo", [H100_TOPO, PCIE_TOPO])
def test_the_link_matrix_is_read_pair_by_pair(topo):
    pairs = preflight.links(topo)
    count = 8 if topo is H100_TOPO else 2
    assert len(pairs) == count * (count - 1)
    assert set(pairs.values()) == ({"NV18"} if count == 8 else {"SYS"})
