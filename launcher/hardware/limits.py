"""What the hardware can do at most: a GPU's datasheet peaks, a PCIe or NVLink link's payload limit,
and NCCL-tests' bus-bandwidth factor, so that a measured rate can be put beside its ceiling.

Standard library only: the launcher and the ranks both read it, and neither needs torch for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPeaks:
    model: str  # the model the device name matched
    bf16_tflops: float | None  # dense tensor-core peak, no sparsity
    fp32_tflops: float | None  # non-tensor FP32
    tf32_tflops: float | None  # dense
    source: str  # the datasheet the figures come from


# Matched in order against the lower-cased device name (as NVML and torch spell it): the specific
# before the generic, since "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" also contain "h100".
_PEAKS: tuple[tuple[str, GpuPeaks], ...] = (
    (r"gh200", GpuPeaks("GH200", 989.4, 66.9, 494.7, "NVIDIA GH200 datasheet (H100 SXM figures)")),
    (r"h100\W*nvl", GpuPeaks("H100 NVL", 835.0, 60.0, 417.5, "NVIDIA H100 datasheet (NVL, per GPU)")),
    (r"h100\W*pcie", GpuPeaks("H100 PCIe", 756.5, 51.2, 378.0, "NVIDIA H100 datasheet (PCIe)")),
    (r"h100", GpuPeaks("H100 SXM", 989.4, 66.9, 494.7, "NVIDIA H100 datasheet (SXM5)")),
    (r"h200\W*nvl", GpuPeaks("H200 NVL", 835.0, 60.0, 417.5, "NVIDIA H200 datasheet (NVL)")),
    (r"h200", GpuPeaks("H200 SXM", 989.4, 66.9, 494.7, "NVIDIA H200 datasheet (SXM)")),
    (r"a100", GpuPeaks("A100", 312.0, 19.5, 156.0, "NVIDIA A100 datasheet")),
    (r"l40s", GpuPeaks("L40S", 362.05, 91.6, 183.0, "NVIDIA L40S datasheet")),
    (r"\ba10g\b", GpuPeaks("A10G", 70.0, 31.2, 35.0, "approximate: AWS A10G figures (no NVIDIA datasheet)")),
    (r"\bl4\b", GpuPeaks("L4", 121.0, 30.3, 60.0, "NVIDIA L4 datasheet")),
    (r"v100\W*sxm2", GpuPeaks("V100 SXM2", None, 15.7, None, "NVIDIA V100 datasheet (SXM2)")),
    (r"v100\W*pcie", GpuPeaks("V100 PCIe", None, 14.0, None, "NVIDIA V100 datasheet (PCIe)")),
    (r"rtx\W*4090", GpuPeaks("GeForce RTX 4090", 165.2, 82.6, 82.6, "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090)")),
)


def gpu_peaks(name: str) -> GpuPeaks | None:
    """The datasheet peaks of a GPU by its device name (e.g. "NVIDIA H100 80GB HBM3" is an H100
    SXM); None for a model not listed here."""
    lowered = name.lower()
    return next((peaks for pattern, peaks in _PEAKS if re.search(pattern, lowered)), None)


# Per lane: raw rate in GT/s and the share of it that is payload after line coding
# (8b/10b up to gen2, 128b/130b for gen3-5, gen6's FLIT mode carries 242 of every 256 bytes).
_PCIE_LANE = {
    1: (2.5, 8 / 10),
    2: (5.0, 8 / 10),
    3: (8.0, 128 / 130),
    4: (16.0, 128 / 130),
    5: (32.0, 128 / 130),
    6: (64.0, 242 / 256),
}


def pcie_limit_gbs(gen: int | None, width: int | None) -> float | None:
    """A PCIe link's per-direction payload limit in GB/s (1e9 bytes): gen5 x16 ~63.0, gen4 x16
    ~31.5. None where the generation is unknown or the width is not a positive lane count."""
    if gen not in _PCIE_LANE or width is None or width <= 0:
        return None
    rate_gts, coding = _PCIE_LANE[gen]
    return rate_gts * coding / 8 * width


# Per link, per direction (GB/s), by NVLink generation: NVLink 3 and 4 halved the lanes per link
# while doubling their rate, so a link stays at 25 GB/s until NVLink 5.
_NVLINK_LINK_GBS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}


def nvlink_limit_gbs(version: int | None, links: int) -> float | None:
    """Per-direction GB/s over `links` active NVLinks of generation `version` (H100: 4 x 18 = 450);
    None without links or for an unknown generation."""
    if links <= 0 or version not in _NVLINK_LINK_GBS:
        return None
    return _NVLINK_LINK_GBS[version] * links


def allreduce_bus_factor(world: int) -> float:
    """NCCL-tests' all-reduce bus-bandwidth factor 2(n-1)/n: busbw = algbw * factor, the rate each
    link carries in a ring. 0.0 for a world of one (nothing crosses a link)."""
    if world <= 1:
        return 0.0
    return 2 * (world - 1) / world
