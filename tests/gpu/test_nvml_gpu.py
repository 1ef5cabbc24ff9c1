"""NVML on a real GPU node (marked ``gpu``: skipped where nvidia-smi finds none): the inventory
matches what torch sees (names, UUIDs in CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID), a
recording plays back to the same inventory, discovery reads NVML, and the health check answers
for every GPU (whether this node's GPUs are healthy is the node's business, not the test's)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_nvml_inventory_matches_torch_and_plays_back():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from launcher.hardware.devices import discover
    from launcher.hardware.nvml import RecordedNvml, granted_gpu_problems, health_problems, read_inventory, record

    inventory = read_inventory()
    assert inventory is not None and inventory.driver_version and inventory.cuda_driver_version
    assert len(inventory.gpus) >= torch.cuda.device_count()
    nvml_uuids = {g.uuid for g in inventory.gpus}
    for i in range(torch.cuda.device_count()):
        uuid = "GPU-" + str(torch.cuda.get_device_properties(i).uuid).removeprefix("GPU-")
        assert uuid in nvml_uuids
    for gpu in inventory.gpus:
        assert gpu.memory_total_mib > 0 and gpu.pcie_max_gen and gpu.pcie_max_width
        assert isinstance(health_problems(gpu), list)
    replayed = read_inventory(RecordedNvml(record()))
    assert replayed is not None and [g.uuid for g in replayed.gpus] == [g.uuid for g in inventory.gpus]
    assert discover().source == "nvml"
    assert isinstance(granted_gpu_problems(0, None), list)
