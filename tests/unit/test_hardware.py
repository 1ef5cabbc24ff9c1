"""The hardware's ceilings: datasheet peaks by device name, PCIe and NVLink limits, NCCL's bus factor."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.hardware.limits import allreduce_bus_factor, gpu_peaks, nvlink_limit_gbs, pcie_limit_gbs


@pytest.mark.parametrize(
    ("name", "model", "bf16", "tf32", "fp32"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 494.7, 66.9),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378.0, 51.2),
        ("NVIDIA H100 NVL", "H100 NVL", 835.0, 417.5, 60.0),
        ("NVIDIA H200", "H200 SXM", 989.4, 494.7, 66.9),
        ("NVIDIA GH200 480GB", "GH200", 989.4, 494.7, 66.9),
        ("NVIDIA A100-SXM4-80GB", "A100", 312.0, 156.0, 19.5),
        ("NVIDIA A100-PCIE-40GB", "A100", 312.0, 156.0, 19.5),
        ("NVIDIA L40S", "L40S", 362.05, 183.0, 91.6),
        ("NVIDIA A10G", "A10G", 70.0, 35.0, 31.2),
        ("NVIDIA L4", "L4", 121.0, 60.0, 30.3),
        ("Tesla V100-SXM2-32GB", "V100 SXM2", None, None, 15.7),
        ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165.2, 82.6, 82.6),
    ],
)
def test_device_names_find_their_datasheet_peaks(name, model, bf16, tf32, fp32):
    peaks = gpu_peaks(name)
    assert peaks is not None
    assert (peaks.model, peaks.bf16_tflops, peaks.tf32_tflops, peaks.fp32_tflops) == (model, bf16, tf32, fp32)
    assert peaks.source


def test_the_a10g_figures_say_they_are_approximate():
    peaks = gpu_peaks("NVIDIA A10G")
    assert peaks is not None and "approx" in peaks.source


@pytest.mark.parametrize("name", ["NVIDIA GeForce GTX 1080", "AMD Instinct MI300X", "", "NVIDIA A10", "NVIDIA L40"])
def test_unknown_devices_have_no_peaks(name):
    assert gpu_peaks(name) is None


@pytest.mark.parametrize(
    ("gen", "width", "gbs"),
    [(5, 16, 63.0), (4, 16, 31.5), (3, 16, 15.75), (4, 8, 15.75), (2, 16, 8.0), (1, 1, 0.25), (6, 16, 121.0)],
)
def test_pcie_payload_limit_per_direction(gen, width, gbs):
    assert pcie_limit_gbs(gen, width) == pytest.approx(gbs, rel=1e-3)


@pytest.mark.parametrize(("gen", "width"), [(None, 16), (5, None), (7, 16), (0, 16), (4, 0)])
def test_pcie_limit_unknown(gen, width):
    assert pcie_limit_gbs(gen, width) is None


@pytest.mark.parametrize(("version", "links", "gbs"), [(4, 18, 450.0), (3, 12, 300.0), (2, 6, 150.0), (1, 4, 80.0), (5, 18, 900.0)])
def test_nvlink_limit_per_direction(version, links, gbs):
    assert nvlink_limit_gbs(version, links) == gbs


@pytest.mark.parametrize(("version", "links"), [(4, 0), (None, 18), (9, 4)])
def test_nvlink_limit_unknown(version, links):
    assert nvlink_limit_gbs(version, links) is None


@pytest.mark.parametrize(("world", "factor"), [(8, 1.75), (2, 1.0), (4, 1.5), (1, 0.0), (0, 0.0)])
def test_allreduce_bus_factor(world, factor):
    assert allreduce_bus_factor(world) == factor


def test_standard_library_only():
    code = "import sys, launcher.hardware.limits; print(sorted(m for m in ('torch', 'pynvml', 'pydantic', 'yaml') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
