"""The accelerators the book reasons about: one record per chip, every fact with its source.

Chapter 01_why_distribute divides a model's memory by a chip's; chapter 06_performance turns flops into utilisation with its
peak; chapter 10_language_model's cost model prices communication with its interconnect. They all read this one
table. Each fact names the page it comes from, and quotes the page's own words and unit:
NVIDIA writes memory in GB (10^9 bytes), Google writes TPU v4 and v5p memory in GiB (2^30 bytes)
and v5e and v6e memory in GB, so ``memory_bytes`` follows the unit each vendor uses. Where a vendor
gives only a system's total (a DGX B200's eight GPUs) or a per-link figure (a TPU v4's ICI), the
quote says how the per-chip figure follows from it.

A chip is found by its name here (``'H100 80GB'``) or by the ``device_kind`` string JAX reports
(``jax.devices()[0].device_kind``), matched exactly: a near miss (an H100 NVL, a ``'TPU v4 lite'``)
is not given a neighbour's figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

GB = 10**9
GiB = 2**30
_UNITS = {"GB": GB, "GiB": GiB}

_A100 = "https://www.nvidia.com/en-us/data-center/a100/"
_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_TPU_V4 = "https://cloud.google.com/tpu/docs/v4"
_TPU_V5E = "https://cloud.google.com/tpu/docs/v5e"
_TPU_V5P = "https://cloud.google.com/tpu/docs/v5p"
_TPU_V6E = "https://cloud.google.com/tpu/docs/v6e"
# The newer v5e page, whose table also counts ICI ports and host NICs.
_TPU_V5E_TABLE = "https://docs.cloud.google.com/tpu/docs/v5e"
_SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus/"
_DGX_B200 = "https://www.nvidia.com/en-us/data-center/dgx-b200/"
_DGX_B200_GUIDE = (
    "https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html"
)
_HGX = "https://www.nvidia.com/en-us/data-center/hgx/"
_CUDA_NAME = (
    "https://docs.nvidia.com/cuda/cuda-runtime-api/structcudaDeviceProp.html: the CUDA "
    "device name (cudaDeviceProp.name), which JAX reports as device_kind"
)
_TPU_KINDS = (
    "https://github.com/jax-ml/jax/blob/main/jax/_src/pallas/mosaic/tpu_info.py: "
    "chip_version_from_device_kind, JAX's map from device_kind to TPU generation"
)


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: memory, dense peaks, bandwidths and the ``device_kind`` strings JAX reports.

    ``memory`` is in ``memory_unit`` as the vendor states it; bandwidths are bytes per second;
    ``link_bytes_per_s`` is what one chip can send to its peers at once, one way (``None`` where
    the vendor gives no chip-to-chip figure). ``network_bytes_per_s`` is what one chip can send
    to other nodes (hosts, slices) at once, one way, through the adapters its reference system
    gives each chip (``None`` where none is recorded). ``host_bytes_per_s`` is what one chip
    can move to or from its host's memory, one way (PCIe; ``None`` where none is recorded).
    ``ici_links`` counts a TPU's inter-chip links (its neighbours in the torus) and ``torus`` names
    the shape they make (``None`` for GPUs, whose peers sit behind a switch).
    ``sources`` maps each field to its page.
    """

    name: str
    device_kinds: tuple[str, ...]
    memory: float
    memory_unit: str
    peak_bf16_flops: float
    peak_fp32_flops: float | None
    hbm_bytes_per_s: float
    link_bytes_per_s: float | None
    link: str
    sources: dict[str, str]
    network_bytes_per_s: float | None = None
    network: str = ""
    host_bytes_per_s: float | None = None
    ici_links: int | None = None
    torus: str | None = None

    @property
    def memory_bytes(self) -> float:
        """The memory in bytes, from the vendor's figure and unit."""
        return self.memory * _UNITS[self.memory_unit]

    @property
    def memory_label(self) -> str:
        """The memory as the vendor writes it, such as ``'95 GiB'``."""
        return f"{self.memory:g} {self.memory_unit}"

    @property
    def family(self) -> str:
        """The chip without its board: ``'H100'`` for both ``'H100 80GB'`` and ``'H100 PCIe'``.

        A TPU's family is its whole name: a v4, a v5e and a v5p are three chips.
        """
        return self.name if self.name.startswith("TPU") else self.name.split()[0]


def _chip(
    name: str,
    kinds: tuple[str, ...],
    page: str,
    memory: tuple[float, str],
    tflops: tuple[float, float | None],
    hbm_gb_s: float,
    link: tuple[str, float | None],
    words: dict[str, str],
    network: tuple[str, float, str] | None = None,
    host: tuple[float, str] | None = None,
    ici: tuple[int | None, str] | None = None,
) -> Chip:
    """A chip from its vendor's page: ``memory`` as (figure, unit), ``tflops`` as (bf16, fp32),
    ``link`` as (name, GB/s over both directions, of which half goes each way); ``network`` as
    (name, Gb/s one way per chip, the source's page and words); ``host`` as (GB/s over both
    directions, the page's words); ``ici`` as (links per chip, torus), each quoted in ``words``."""
    link_name, both_ways = link
    across = {}
    if network is not None:
        across = {"network_bytes_per_s": network[1] * 1e9 / 8, "network": network[0]}
        words = {**words, "network_bytes_per_s": network[2]}
    if host is not None:
        across["host_bytes_per_s"] = host[0] / 2 * 1e9
        words = {**words, "host_bytes_per_s": host[1]}
    if ici is not None:
        across["ici_links"], across["torus"] = ici
    kinds_source = _TPU_KINDS if name.startswith("TPU") else _CUDA_NAME
    return Chip(
        name,
        kinds,
        *memory,
        tflops[0] * 1e12,
        None if tflops[1] is None else tflops[1] * 1e12,
        hbm_gb_s * 1e9,
        None if both_ways is None else both_ways / 2 * 1e9,
        f"{link_name} ({both_ways:g} GB/s bidirectional)" if both_ways else link_name,
        {
            **{
                f: text if text.startswith("https://") else f"{page}: {text}"
                for f, text in words.items()
            },
            "device_kinds": kinds_source,
        },
        **across,
    )


_BASEPOD = (
    "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-"
    "enterprise-ai/latest/core-components.html"
)
# Across nodes: the compute fabric of NVIDIA's reference systems, one adapter per GPU.
_DGX_H = (
    "InfiniBand NDR",
    400,
    f"{_BASEPOD}: DGX H100 and H200 systems, eight single-port ConnectX-7 adapters of up to "
    "400 Gb/s InfiniBand (NDR), one per GPU",
)
_DGX_A100 = (
    "InfiniBand HDR",
    200,
    "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html: "
    "8x single-port ConnectX-6 VPI 200 Gb/s HDR InfiniBand, one per GPU",
)

_A100_HOST = (64, "Interconnect: PCIe Gen4 64GB/s")
_A100_WORDS = {
    "peak_bf16_flops": "BF16 Tensor Core 312 TFLOPS (624 with sparsity)",
    "peak_fp32_flops": "FP32 19.5 TFLOPS",
}
_H100_WORDS = {"peak_fp32_flops": "FP32 67 teraFLOPS (H100 SXM), 51 (H100 PCIe)"}

CHIPS: dict[str, Chip] = {
    chip.name: chip
    for chip in [
        _chip(
            "A100 40GB",
            ("NVIDIA A100-SXM4-40GB",),
            _A100,
            (40, "GB"),
            (312, 19.5),
            1555,
            ("NVLink", 600),
            {
                **_A100_WORDS,
                "memory": "A100 40GB, GPU memory 40GB HBM2",
                "hbm_bytes_per_s": "GPU memory bandwidth 1,555GB/s",
                "link_bytes_per_s": "Interconnect, SXM: NVLink 600GB/s",
            },
            _DGX_A100,
            _A100_HOST,
        ),
        _chip(
            "A100 40GB PCIe",
            ("NVIDIA A100-PCIE-40GB",),
            _A100,
            (40, "GB"),
            (312, 19.5),
            1555,
            ("PCIe", None),
            {
                **_A100_WORDS,
                "memory": "A100 40GB PCIe, GPU memory 40GB HBM2",
                "hbm_bytes_per_s": "GPU memory bandwidth 1,555GB/s",
            },
            host=_A100_HOST,
        ),
        _chip(
            "A100 80GB",
            ("NVIDIA A100-SXM4-80GB",),
            _A100,
            (80, "GB"),
            (312, 19.5),
            2039,
            ("NVLink", 600),
            {
                **_A100_WORDS,
                "memory": "A100 80GB SXM, GPU memory 80GB HBM2e",
                "hbm_bytes_per_s": "GPU memory bandwidth 2,039GB/s",
                "link_bytes_per_s": "Interconnect, SXM: NVLink 600GB/s",
            },
            _DGX_A100,
            _A100_HOST,
        ),
        _chip(
            "A100 80GB PCIe",
            ("NVIDIA A100 80GB PCIe",),
            _A100,
            (80, "GB"),
            (312, 19.5),
            1935,
            ("PCIe", None),
            {
                **_A100_WORDS,
                "memory": "A100 80GB PCIe, GPU memory 80GB HBM2e",
                "hbm_bytes_per_s": "GPU memory bandwidth 1,935GB/s",
            },
            host=_A100_HOST,
        ),
        _chip(
            "H100 80GB",
            ("NVIDIA H100 80GB HBM3",),
            _H100,
            (80, "GB"),
            (989, 67),
            3350,
            ("NVLink", 900),
            {
                **_H100_WORDS,
                "memory": "H100 SXM, GPU memory 80GB",
                "peak_bf16_flops": "H100 SXM, BF16 Tensor Core 1,979 teraFLOPS with sparsity, so 989 dense",
                "hbm_bytes_per_s": "H100 SXM, GPU memory bandwidth 3.35TB/s",
                "link_bytes_per_s": "H100 SXM, NVIDIA NVLink 900GB/s",
            },
            _DGX_H,
            (128, "Interconnect: PCIe Gen5 128GB/s"),
        ),
        _chip(
            "H100 PCIe",
            ("NVIDIA H100 PCIe",),
            _H100,
            (80, "GB"),
            (756, 51),
            2000,
            # Peers over PCIe: an NVLink bridge joins only a pair of cards, not a node.
            ("PCIe Gen5 x16", 128),
            {
                **_H100_WORDS,
                "memory": "H100 PCIe, GPU memory 80GB",
                "peak_bf16_flops": "H100 PCIe, BF16 Tensor Core 1,513 teraFLOPS with sparsity, so 756 dense",
                "hbm_bytes_per_s": "H100 PCIe, GPU memory bandwidth 2TB/s",
                "link_bytes_per_s": "H100 PCIe, Interconnect: PCIe Gen5 128GB/s, "
                "so 64GB/s each way to a peer card",
            },
            host=(128, "Interconnect: PCIe Gen5 128GB/s"),
        ),
        _chip(
            # An H200 NVL, with a lower peak, may report the same name: pass its own figures.
            "H200 141GB",
            ("NVIDIA H200",),
            _H200,
            (141, "GB"),
            (989, 67),
            4800,
            ("NVLink", 900),
            {
                "memory": "H200 SXM, GPU memory 141GB",
                "peak_bf16_flops": "H200 SXM, BF16 Tensor Core 1,979 TFLOPS with sparsity, so 989 dense",
                "peak_fp32_flops": "H200 SXM, FP32 67 TFLOPS",
                "hbm_bytes_per_s": "H200 SXM, GPU memory bandwidth 4.8TB/s",
                "link_bytes_per_s": "H200 SXM, NVIDIA NVLink 900GB/s",
            },
            _DGX_H,
            (128, "Interconnect: PCIe Gen5 128GB/s"),
        ),
        _chip(
            "B200",
            ("NVIDIA B200",),
            _DGX_B200_GUIDE,
            (180, "GB"),
            (2250, None),
            8000,
            ("NVLink 5", 1800),
            {
                "memory": "8 x NVIDIA B200 GPUs that provide 1,440 GB total GPU memory, "
                "so 180 GB each",
                "peak_bf16_flops": f"{_HGX}: HGX B200 (8 GPUs), FP16/BF16 Tensor Core "
                "36 PFLOPS with sparsity, so 4.5 PFLOPS per GPU and 2,250 TFLOPS dense",
                "hbm_bytes_per_s": f"{_DGX_B200}: GPU Memory 1,440GB total, 64TB/s HBM3e "
                "bandwidth, so 8TB/s for each of 8 GPUs",
                "link_bytes_per_s": "2 x 5th generation NVLink switches that provide 14.4 TB/s "
                "aggregate bandwidth, so 1.8 TB/s for each of 8 GPUs",
            },
            (
                "InfiniBand NDR",
                400,
                f"{_DGX_B200_GUIDE}: 4 x OSFP ports for 8 x NVIDIA ConnectX-7 Single Port "
                "Cards, InfiniBand (default): Up to 400Gbps, one per GPU",
            ),
        ),
        _chip(
            "TPU v4",
            ("TPU v4",),
            _TPU_V4,
            (32, "GiB"),
            (275, None),
            1200,
            ("ICI", 540),
            {
                "memory": "HBM2 capacity and bandwidth: 32 GiB, 1200 GBps",
                "peak_bf16_flops": "Peak compute per chip: 275 teraflops (bf16 or int8)",
                "hbm_bytes_per_s": "HBM2 capacity and bandwidth: 32 GiB, 1200 GBps",
                # Google's v4 page gives no per-chip ICI figure; the scaling book gives one per link.
                "link_bytes_per_s": f"{_SCALING_BOOK}: ICI BW/link (one-way, bytes/s), TPU v4p: "
                "4.5e10; over its 6 links, 2.7e11 bytes/s one way (540 GB/s both ways)",
                "ici_links": "v4 TPUs have a direct connection to the nearest neighboring chips "
                "in 3 dimensions, so two along each of three axes: 6",
                "torus": "The connections can be configured as a 3D torus on slices where the "
                "topology, AxBxC, is either 2A=B=C or 2A=2B=C, where each dimension is a "
                "multiple of 4; Interconnect topology: 3D mesh",
            },
            ici=(6, "3D mesh, or 3D torus on slices such as 4x4x8"),
        ),
        _chip(
            "TPU v5e",
            ("TPU v5 lite", "TPU v5e"),
            _TPU_V5E,
            (16, "GB"),
            (197, None),
            819,
            ("ICI", 400),
            {
                "memory": "HBM2 capacity and bandwidth: 16 GB, 819 GBps",
                "peak_bf16_flops": "Peak compute per chip (bf16): 197 TFLOPs",
                "hbm_bytes_per_s": "HBM2 capacity and bandwidth: 16 GB, 819 GBps",
                "link_bytes_per_s": "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip): 400 GBps",
                "ici_links": f"{_TPU_V5E_TABLE}: ICI ports per chip: 4",
                "torus": "Interconnect topology: 2D Torus; TPU Pod size: 256 chips",
            },
            network=(
                "DCN",
                25,
                f"{_TPU_V5E_TABLE}: Chips per host: 8; Per-host NIC configuration: 2 x "
                "100 Gbps NIC; Data center network bandwidth per Pod: 6.4 Tbps, so 25 "
                "Gbps a chip either way (256 chips)",
            ),
            ici=(4, "2D torus, 256-chip pod"),
        ),
        _chip(
            "TPU v5p",
            ("TPU v5", "TPU v5p"),
            _TPU_V5P,
            (95, "GiB"),
            (459, None),
            2765,
            ("ICI", 1200),
            {
                "memory": "HBM capacity per chip (GiB): 95",
                "peak_bf16_flops": "Peak compute per chip (BF16) (TFLOPs): 459",
                "hbm_bytes_per_s": "HBM bandwidth per chip (GBps): 2765",
                "link_bytes_per_s": "Bidirectional inter-chip interconnect (ICI) bandwidth per chip (GBps): 1200",
                "ici_links": "Interconnect topology: 3D torus, so two links along each of three axes: 6",
                "torus": "Number of chips per pod: 8960; Interconnect topology: 3D torus",
            },
            (
                "DCN",
                50,
                f"{_TPU_V5P}: Data center network (DCN) bandwidth per chip: 50 Gbps",
            ),
            ici=(6, "3D torus, 8960-chip pod"),
        ),
        _chip(
            "TPU v6e",
            ("TPU v6 lite", "TPU v6e"),
            _TPU_V6E,
            (32, "GB"),
            (918, None),
            1638,
            ("ICI", 800),
            {
                "memory": "HBM capacity per chip: 32 GB",
                "peak_bf16_flops": "Peak compute per chip (bf16): 918 TFLOPs",
                "hbm_bytes_per_s": "HBM bandwidth per chip: 1638 GBps",
                "link_bytes_per_s": "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip): 800 GBps",
                "ici_links": "ICI ports per chip: 4",
                "torus": "Interconnect topology: 2D torus; TPU Pod size: 256 chips",
            },
            ici=(4, "2D torus, 256-chip pod"),
        ),
    ]
}


def chip(name: str) -> Chip:
    """The chip called ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in CHIPS:
        raise ValueError(
            f"unknown accelerator {name!r}; allowed: {', '.join(sorted(CHIPS))}"
        )
    return CHIPS[name]


def by_memory(names: Iterable[str] | None = None) -> dict[float, list[Chip]]:
    """The chips called ``names`` (all of ``CHIPS`` by default) grouped by memory in bytes, smallest first.

    Each chip appears once in its group: a chip sold on two boards with the same memory (an SXM
    module and a PCIe card) is the record listed first, since for memory they are one chip.
    """
    chips = CHIPS.values() if names is None else [chip(name) for name in names]
    groups: dict[float, list[Chip]] = {}
    # sorted() is stable: within a group the chips keep CHIPS's order, SXM before PCIe.
    for each in sorted(chips, key=lambda c: c.memory_bytes):
        group = groups.setdefault(each.memory_bytes, [])
        if all(other.family != each.family for other in group):
            group.append(each)
    return groups


def chip_for_kind(device_kind: str) -> Chip | None:
    """The chip whose ``device_kind`` (``jax.devices()[0].device_kind``) is exactly this; ``None`` if none."""
    return next((c for c in CHIPS.values() if device_kind in c.device_kinds), None)


def peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device kind, matched exactly; ``None`` for an unknown kind (a CPU)."""
    found = chip_for_kind(device_kind)
    return None if found is None else found.peak_bf16_flops
