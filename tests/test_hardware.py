"""hardware: one record per chip, every fact with its page, found by name or by JAX's device_kind."""

import json

import pytest

from jaxdist_lessons import hardware
from jaxdist_lessons.planning import cli

FIGURES = [
    "memory",
    "peak_bf16_flops",
    "peak_fp32_flops",
    "hbm_bytes_per_s",
    "link_bytes_per_s",
    "network_bytes_per_s",
    "device_kinds",
    "ici_links",
    "torus",
]
NEW = ["TPU v4", "H100 PCIe", "TPU v6e", "B200"]  # issue 59: figures added since


def test_figures_match_the_datasheets():
    # Independent datasheet values (SXM parts): A100 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s over
    # both directions; H100 3.35 TB/s HBM3, 80 GB.
    a100, h100 = hardware.chip("A100 40GB"), hardware.chip("H100 80GB")
    assert a100.peak_bf16_flops == 312e12
    assert a100.link_bytes_per_s == 300e9
    assert a100.hbm_bytes_per_s == 1555e9
    assert h100.hbm_bytes_per_s == 3350e9
    assert h100.link_bytes_per_s == 450e9
    assert h100.memory_bytes == 80e9
    # Across nodes, one 400 Gb/s InfiniBand NDR adapter per H100 (DGX H100): 50 GB/s one way,
    # a ninth of NVLink's; none recorded for a PCIe card.
    assert h100.network_bytes_per_s == 50e9 and h100.link_bytes_per_s / 50e9 == 9
    assert hardware.chip("H100 PCIe").network_bytes_per_s is None


def test_memory_in_the_vendors_unit():
    # Google states TPU v4 and v5p memory in GiB, v5e memory in GB; NVIDIA states GB.
    v5p = hardware.chip("TPU v5p")
    assert (v5p.memory_label, v5p.memory_bytes) == ("95 GiB", 95 * 2**30)
    assert hardware.chip("TPU v4").memory_bytes == 32 * 2**30
    assert hardware.chip("TPU v5e").memory_bytes == 16e9
    assert hardware.chip("H200 141GB").memory_label == "141 GB"


def test_every_fact_has_a_source_link():
    for chip in hardware.CHIPS.values():
        for field in FIGURES:
            if getattr(chip, field) is None:
                assert field not in chip.sources, (chip.name, field)
                continue
            source = chip.sources[field]
            assert source.startswith("https://") and ": " in source, (chip.name, field)
        page = chip.sources["memory"]
        assert "nvidia.com" in page or "cloud.google.com/tpu/docs" in page, chip.name


def test_peaks_match_device_kinds_exactly():
    # Near misses must not borrow a neighbour's peak: a v4i, an H100 NVL, another spelling, a CPU.
    for kind in ["TPU v4 lite", "NVIDIA H100 NVL", "tpu v5", "TPU v5p ", "H100", "cpu"]:
        assert hardware.peak_flops(kind) is None, kind
    # A TPU v5p reports "TPU v5", a v5e "TPU v5 lite": two chips, two peaks.
    assert hardware.peak_flops("TPU v5") > hardware.peak_flops("TPU v5 lite")
    assert hardware.peak_flops("NVIDIA H100 PCIe") < hardware.peak_flops(
        "NVIDIA H100 80GB HBM3"
    )
    kinds = [k for chip in hardware.CHIPS.values() for k in chip.device_kinds]
    assert len(kinds) == len(set(kinds))  # each kind names one chip
    for chip in hardware.CHIPS.values():
        for kind in chip.device_kinds:
            assert hardware.chip_for_kind(kind) is chip
            assert hardware.peak_flops(kind) == chip.peak_bf16_flops
        assert 1e14 < chip.peak_bf16_flops < 1e16


def test_tpu_kinds_are_ones_jax_knows():
    # JAX's own map from device_kind to TPU generation (a private module: skip if it moves).
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    for chip in hardware.CHIPS.values():
        for kind in chip.device_kinds:
            if kind.startswith("TPU"):
                assert tpu_info.chip_version_from_device_kind(kind) is not None, kind
    assert tpu_info.chip_version_from_device_kind("TPU v5").name == "TPU_V5P"


def test_by_memory_groups_equal_memories_and_lists_each_chip_once():
    groups = hardware.by_memory()
    assert list(groups) == sorted(groups)
    assert {c.name for chips in groups.values() for c in chips} == {
        name for name in hardware.CHIPS if "PCIe" not in name
    }
    assert [c.name for c in groups[80e9]] == ["A100 80GB", "H100 80GB"]
    assert (
        hardware.chip("H100 PCIe").family == hardware.chip("H100 80GB").family == "H100"
    )
    assert hardware.chip("TPU v5e").family != hardware.chip("TPU v5p").family
    # Asked for a PCIe card alone, the card is listed.
    assert [c.name for c in hardware.by_memory(["H100 PCIe"])[80e9]] == ["H100 PCIe"]


def test_an_unknown_chip_names_the_known_ones():
    with pytest.raises(
        ValueError, match="unknown accelerator 'V100'; allowed: A100 40GB"
    ):
        hardware.chip("V100")


def test_the_added_figures_match_their_pages():
    # TPU v4: 6 ICI links of 4.5e10 bytes/s one way (scaling book), 540 GB/s both ways.
    v4 = hardware.chip("TPU v4")
    assert (v4.link_bytes_per_s, v4.ici_links) == (6 * 4.5e10, 6)
    # H100 PCIe: its peers over PCIe Gen5 x16, 128 GB/s both ways; no network recorded.
    pcie = hardware.chip("H100 PCIe")
    assert pcie.link_bytes_per_s == 64e9 == pcie.host_bytes_per_s
    assert pcie.link.startswith("PCIe Gen5 x16")
    # TPU v6e (Trillium): 918 TFLOP/s, 32 GB, 1,638 GB/s, 800 GB/s of ICI over 4 ports.
    v6e = hardware.chip("TPU v6e")
    assert (v6e.peak_bf16_flops, v6e.memory_bytes, v6e.hbm_bytes_per_s) == (
        918e12,
        32e9,
        1638e9,
    )
    assert (2 * v6e.link_bytes_per_s, v6e.ici_links) == (800e9, 4)
    assert v6e.torus.startswith("2D torus") and v6e.network_bytes_per_s is None
    # B200: the DGX B200's totals over its 8 GPUs, and HGX B200's sparse peak halved.
    b200 = hardware.chip("B200")
    assert (b200.peak_bf16_flops, b200.memory_bytes, b200.hbm_bytes_per_s) == (
        2250e12,
        180e9,
        8000e9,
    )
    assert (2 * b200.link_bytes_per_s, b200.network_bytes_per_s * 8) == (1800e9, 400e9)
    # Tori: 2D for the v5e and v6e, 3D for the v4 and v5p; GPUs have none.
    assert [
        hardware.chip(f"TPU {v}").ici_links for v in ("v4", "v5e", "v5p", "v6e")
    ] == [
        6,
        4,
        6,
        4,
    ]
    assert all(
        c.torus is None and c.ici_links is None
        for c in hardware.CHIPS.values()
        if not c.name.startswith("TPU")
    )
    # A v5e's DCN per chip, from its page's figures per host and per pod, which agree:
    # 2 x 100 Gb/s for a host's 8 chips, 6.4 Tb/s for a pod's 256.
    v5e = hardware.chip("TPU v5e")
    assert v5e.network_bytes_per_s * 8 == 2 * 100e9 / 8 == 6.4e12 / 256
    assert all(f in v5e.sources["network_bytes_per_s"] for f in ("2 x 100", "6.4 Tbps"))


@pytest.mark.parametrize("name", NEW)
def test_every_added_figure_quotes_its_page(name):
    chip = hardware.chip(name)
    for field in FIGURES:
        if getattr(chip, field) is None:
            continue
        url, words = chip.sources[field].split(": ", 1)
        assert url.startswith("https://") and " " not in url, (name, field)
        assert any(ch.isdigit() for ch in words) or field == "device_kinds", (
            name,
            field,
        )


def test_the_added_kinds_are_found_exactly():
    assert hardware.chip_for_kind("TPU v6 lite") is hardware.chip("TPU v6e")
    assert hardware.chip_for_kind("TPU v6e") is hardware.chip("TPU v6e")
    assert hardware.chip_for_kind("NVIDIA B200") is hardware.chip("B200")
    for near in [
        "TPU v6",
        "TPU7x",
        "NVIDIA B200 NVL",
        "nvidia b200",
        "NVIDIA GB200",
        "B200",
    ]:
        assert hardware.chip_for_kind(near) is None, near


@pytest.mark.parametrize("name", ["TPU v4", "H100 PCIe", "TPU v6e", "B200"])
def test_the_planner_plans_one_node_of_each_added_chip(name):
    argv = ["--model", "1b", "--devices", "8", "--global-batch", "64", "--chip", name]
    shown = json.loads(cli.page_json(argv))
    assert "error" not in shown, shown
    assert shown["run"] and shown["rows"]


def test_the_planner_still_refuses_what_has_no_figure():
    # No DCN figure per chip for a v4 or v6e: one node only; no link for a PCIe A100.
    run = ["--model", "1b", "--devices", "16", "--global-batch", "64"]
    for name in ["TPU v4", "TPU v6e"]:
        shown = json.loads(cli.page_json([*run, "--nodes", "2", "--chip", name]))
        assert f"{name} has no network bandwidth" in shown["error"]
    shown = json.loads(cli.page_json([*run, "--chip", "A100 80GB PCIe"]))
    assert "A100 80GB PCIe has no chip-to-chip bandwidth" in shown["error"]
