"""hardware: one record per chip, every fact with its page, found by name or by JAX's device_kind."""

import pytest

from jaxdist_lessons import hardware

FIGURES = [
    "memory",
    "peak_bf16_flops",
    "peak_fp32_flops",
    "hbm_bytes_per_s",
    "link_bytes_per_s",
    "network_bytes_per_s",
    "device_kinds",
]


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
