"""NVML readings from recorded answers (no GPU needed): the inventory, health, CUDA_VISIBLE_DEVICES,
the recording round trip, and discovery through NVML."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

import launcher.hardware.devices
from launcher.hardware.devices import discover
from launcher.hardware.nvml import NvmlInventory, RecordedNvml, health_problems, read_inventory, record, visible_gpus

DATA = Path(__file__).parent / "data"
NVML_DATA = DATA / "nvml"
RECORDINGS = ("h100_sxm_8gpu", "h200_1gpu", "a100_pcie_2gpu")
H100_UUIDS = (
    "GPU-1b7a2f4e-9c3d-4e51-8a6b-0d2c7f9e3a41",
    "GPU-5e8d1c6b-2a4f-4b73-9e0c-6f1a3d8b2c57",
    "GPU-3d9c8e5a-7b1f-4c2e-a6d4-9e0b5f3c1a82",
    "GPU-8f2e6a1d-4c9b-4d3a-b7e5-1c8f0a6d9e13",
    "GPU-a4c71e93-0f5b-42d8-9b6e-3e7d1f2a8c64",
    "GPU-c2f95b07-6d3e-4a19-8f4c-7b0e2d5a9f38",
    "GPU-e6b13d8f-2a7c-4f05-a9d1-5c4e8b3f0d26",
    "GPU-f09a4c2e-8b6d-4e73-b1f5-2d9c7e0a4b19",
)


def recording(name: str) -> dict[str, Any]:
    return json.loads((NVML_DATA / f"{name}.json").read_text())


def inventory_of(rec: dict[str, Any]) -> NvmlInventory:
    inventory = read_inventory(RecordedNvml(rec))
    assert inventory is not None
    return inventory


def error(code: int) -> dict[str, int]:
    return {"nvml_error": code}


# --- the inventory --------------------------------------------------------------------------------


def test_an_hgx_h100_node_reads_as_eight_gpus_on_one_nvswitch_fabric():
    inv = inventory_of(recording("h100_sxm_8gpu"))
    assert (inv.driver_version, inv.cuda_driver_version) == ("550.54.15", "12.4")
    assert [g.index for g in inv.gpus] == list(range(8))
    assert {g.name for g in inv.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert tuple(g.uuid for g in inv.gpus) == H100_UUIDS
    assert [g.pci_bus_id for g in inv.gpus][:3] == ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0"]
    first, busy = inv.gpus[0], inv.gpus[4]
    assert (first.memory_total_mib, first.memory_used_mib, first.memory_free_mib) == (81559, 529, 81030)
    assert (first.pcie_gen, first.pcie_width, first.pcie_max_gen, first.pcie_max_width) == (5, 16, 5, 16)
    assert all((g.nvlink_version, g.nvlink_active) == (4, 18) for g in inv.gpus)  # NVML's 6 is NVLink 4.0
    assert (first.ecc_uncorrected_volatile, first.retired_pages_pending, first.remapped_rows_pending, first.remapped_rows_failure) == (0, None, False, False)
    assert first.throttle_reasons == ()  # idle is not a slowdown
    assert busy.throttle_reasons == ("sw_power_cap",)
    assert (busy.sm_clock_mhz, busy.sm_clock_max_mhz, busy.temperature_c, busy.power_w, busy.utilization_gpu_pct) == (1755, 1980, 62, 693.123, 100)
    assert first.compute_mode == "default"
    assert len(inv.topology) == 8
    for i, row in enumerate(inv.topology):
        assert row == tuple("X" if j == i else "NV18" for j in range(8))


def test_an_h200_with_nvlink_but_no_active_link():
    inv = inventory_of(recording("h200_1gpu"))
    (gpu,) = inv.gpus
    assert (gpu.name, gpu.uuid, gpu.memory_total_mib) == ("NVIDIA H200", "GPU-7c3e9a15-d2b8-4f60-8e4a-1b6d0c9f2e73", 143771)
    assert (gpu.nvlink_version, gpu.nvlink_active) == (4, 0)
    assert (gpu.pcie_gen, gpu.pcie_width) == (5, 16)
    assert inv.topology == (("X",),)
    assert inv.cuda_driver_version == "12.6"


def test_pcie_a100s_without_nvlink_read_their_pcie_path():
    inv = inventory_of(recording("a100_pcie_2gpu"))
    assert [g.name for g in inv.gpus] == ["NVIDIA A100-PCIE-40GB"] * 2
    assert all((g.nvlink_version, g.nvlink_active) == (None, 0) for g in inv.gpus)
    assert all((g.pcie_max_gen, g.pcie_max_width) == (4, 16) for g in inv.gpus)
    assert inv.topology == (("X", "PXB"), ("PXB", "X"))


@pytest.mark.parametrize(("level", "cell"), [(10, "PIX"), (20, "PXB"), (30, "PHB"), (40, "NODE"), (50, "SYS"), (77, "?")])
def test_topology_levels_are_named_as_nvidia_smi_names_them(level, cell):
    rec = recording("a100_pcie_2gpu")
    rec["devices"][0]["nvmlDeviceGetTopologyCommonAncestor"]["1"] = level
    assert inventory_of(rec).topology == (("X", cell), (cell, "X"))


def test_gpus_joined_directly_count_their_own_links():
    # two GPUs bridged by 4 links, one of which leads to a third GPU: NV3 and NV1, the rest PCIe
    rec = recording("a100_pcie_2gpu")
    third = copy.deepcopy(rec["devices"][1])
    third["nvmlDeviceGetPciInfo"]["busId"] = "00000000:AF:00.0"
    rec["devices"].append(third)
    rec["system"]["nvmlDeviceGetCount"] = 3
    buses = {0: ["00000000:3C:00.0"] * 3 + ["00000000:AF:00.0"], 1: ["00000000:3B:00.0"] * 3, 2: ["00000000:3B:00.0"]}
    for device, remote in buses.items():
        links = rec["devices"][device]
        links["nvmlDeviceGetNvLinkState"] = {str(k): 1 for k in range(len(remote))} | {str(len(remote)): error(2)}
        links["nvmlDeviceGetNvLinkRemotePciInfo"] = {str(k): {"busId": bus} for k, bus in enumerate(remote)}
        links["nvmlDeviceGetNvLinkVersion"] = {"0": 4}
        links["nvmlDeviceGetTopologyCommonAncestor"] = {"1": 20, "2": 50}
    inv = inventory_of(rec)
    assert [(g.nvlink_version, g.nvlink_active) for g in inv.gpus] == [(3, 4), (3, 3), (3, 1)]
    assert inv.topology == (("X", "NV3", "NV1"), ("NV3", "X", "SYS"), ("NV1", "SYS", "X"))


# --- health ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECORDINGS)
def test_the_recorded_nodes_are_healthy(name):
    inv = inventory_of(recording(name))
    assert [health_problems(g) for g in inv.gpus] == [[] for _ in inv.gpus]


def _one_bad_gpu(**answers: Any) -> list[str]:
    rec = recording("h100_sxm_8gpu")
    rec["devices"][2].update(answers)
    inv = inventory_of(rec)
    assert [health_problems(g) for i, g in enumerate(inv.gpus) if i != 2] == [[]] * 7
    return health_problems(inv.gpus[2])


def test_uncorrectable_ecc_errors_are_counted():
    assert _one_bad_gpu(nvmlDeviceGetTotalEccErrors={"1,0": 3}) == ["3 uncorrectable ECC errors (volatile)"]
    assert _one_bad_gpu(nvmlDeviceGetTotalEccErrors={"1,0": 1}) == ["1 uncorrectable ECC error (volatile)"]


def test_thermal_slowdown_names_the_reasons_and_the_clock():
    problems = _one_bad_gpu(nvmlDeviceGetCurrentClocksEventReasons=0x08 | 0x20 | 0x04, nvmlDeviceGetClockInfo={"1": 345})
    assert problems == ["clocks held down: hw_slowdown, sw_thermal (sm 345 of 1980 MHz)"]


@pytest.mark.parametrize(("mask", "reason"), [(0x40, "hw_thermal"), (0x80, "hw_power_brake"), (0x08, "hw_slowdown")])
def test_each_slowdown_alone_is_a_problem(mask, reason):
    (problem,) = _one_bad_gpu(nvmlDeviceGetCurrentClocksEventReasons=mask)
    assert problem.startswith(f"clocks held down: {reason} (sm ")


def test_power_cap_idle_sync_boost_and_app_clocks_are_not_problems():
    assert _one_bad_gpu(nvmlDeviceGetCurrentClocksEventReasons=0x01 | 0x02 | 0x04 | 0x10 | 0x100) == []


def test_too_little_free_memory_for_the_job():
    inv = inventory_of(recording("h100_sxm_8gpu"))
    assert health_problems(inv.gpus[4], min_free_mib=40000) == ["only 7346 MiB free, the job needs 40000"]
    assert health_problems(inv.gpus[0], min_free_mib=40000) == []


def test_retired_pages_pending_want_a_reset():
    assert _one_bad_gpu(nvmlDeviceGetRetiredPagesPendingStatus=1) == ["retired pages pending (reset the GPU)"]


def test_row_remapping_failure_and_pending():
    assert _one_bad_gpu(nvmlDeviceGetRemappedRows=[0, 2, 0, 1]) == ["row remapping failed"]
    assert _one_bad_gpu(nvmlDeviceGetRemappedRows=[0, 1, 1, 0]) == ["row remapping pending (reset the GPU)"]


def test_compute_mode_prohibited():
    assert _one_bad_gpu(nvmlDeviceGetComputeMode=2) == ["compute mode prohibited"]
    assert _one_bad_gpu(nvmlDeviceGetComputeMode=3) == []  # one process per GPU, as DDP runs


def test_several_problems_are_all_named():
    problems = _one_bad_gpu(nvmlDeviceGetTotalEccErrors={"1,0": 2}, nvmlDeviceGetComputeMode=2)
    assert problems == ["2 uncorrectable ECC errors (volatile)", "compute mode prohibited"]


# --- errors NVML answers --------------------------------------------------------------------------


def test_recorded_errors_raise_as_pynvml_errors_with_their_code():
    nvml = RecordedNvml(recording("a100_pcie_2gpu"))
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError) as raised:
        nvml.nvmlDeviceGetNvLinkState(handle, 0)
    assert raised.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert isinstance(raised.value, pynvml.NVMLError_NotSupported)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):  # not in the recording
        nvml.nvmlDeviceGetFanSpeed(handle)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceGetMemoryInfo(handle).total == 40960 * 1024 * 1024


def test_every_optional_query_failing_leaves_it_unknown():
    rec = recording("h100_sxm_8gpu")
    identity = {"nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetMemoryInfo"}
    for device in rec["devices"]:
        for function in list(device):
            if function not in identity:
                device[function] = error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    del rec["system"]["nvmlSystemGetCudaDriverVersion"]
    inv = inventory_of(rec)
    gpu = inv.gpus[0]
    assert (gpu.name, gpu.memory_total_mib) == ("NVIDIA H100 80GB HBM3", 81559)
    unknown = (gpu.pcie_gen, gpu.pcie_max_width, gpu.nvlink_version, gpu.ecc_uncorrected_volatile, gpu.remapped_rows_failure, gpu.temperature_c)
    assert unknown == (None,) * 6
    assert (gpu.nvlink_active, gpu.throttle_reasons, gpu.compute_mode, gpu.power_w, gpu.sm_clock_mhz) == (0, (), "?", None, None)
    assert inv.cuda_driver_version == "?"
    assert inv.topology[0] == ("X",) + ("?",) * 7  # no NVLink seen, no PCIe path answered
    assert health_problems(gpu) == []


def test_an_old_driver_answers_throttle_reasons_instead_of_clock_events():
    rec = recording("h200_1gpu")
    device = rec["devices"][0]
    del device["nvmlDeviceGetCurrentClocksEventReasons"]
    device["nvmlDeviceGetCurrentClocksThrottleReasons"] = 0x40
    (gpu,) = inventory_of(rec).gpus
    assert gpu.throttle_reasons == ("hw_thermal",)


def test_a_gpu_nvml_cannot_open_still_counts_and_is_unfit():
    rec = recording("a100_pcie_2gpu")
    rec["devices"][1] = {"nvmlDeviceGetHandleByIndex": error(pynvml.NVML_ERROR_GPU_IS_LOST)}
    inv = inventory_of(rec)
    assert [g.name for g in inv.gpus] == ["NVIDIA A100-PCIE-40GB", "?"]
    assert inv.topology == (("X", "?"), ("?", "X"))
    assert health_problems(inv.gpus[1]) == ["NVML cannot read this GPU (lost or unreachable)"]


class _NoLibrary:
    NVMLError = pynvml.NVMLError

    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


class _CountFails:
    NVMLError = pynvml.NVMLError

    def __init__(self) -> None:
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlDeviceGetCount(self) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")


def test_no_nvml_is_none_not_an_error():
    assert read_inventory(_NoLibrary()) is None
    assert read_inventory(RecordedNvml({"system": {"nvmlInit": error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)}, "devices": []})) is None
    failing = _CountFails()
    assert read_inventory(failing) is None
    assert failing.calls == ["init", "shutdown"]  # shut down even when reading failed


def test_nvml_is_shut_down_after_a_good_read():
    rec = recording("h200_1gpu")
    assert read_inventory(RecordedNvml(rec)) is not None
    assert record(RecordedNvml(rec))["system"]["nvmlShutdown"] is None  # the recorder saw the call


def test_the_command_line_prints_json_with_or_without_nvml():
    done = subprocess.run([sys.executable, "-m", "launcher.hardware.nvml"], capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(done.stdout)
    if "gpus" not in out:  # no NVML here (this machine has no driver): why not, instead of a crash
        assert out["nvml"] is None and out["reason"]
    recorded = json.loads(subprocess.run([sys.executable, "-m", "launcher.hardware.nvml", "--record"], capture_output=True, text=True, timeout=60, check=True).stdout)
    assert recorded["nvml_recording"] == 1 and "nvmlInit" in recorded["system"]


# --- recording --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECORDINGS)
def test_recording_a_recording_gives_it_back(name):
    rec = recording(name)
    again = record(RecordedNvml(rec))
    assert again == rec
    assert read_inventory(RecordedNvml(again)) == read_inventory(RecordedNvml(rec))


class _LikePynvml:
    """Answers as pynvml does, from a recording: ctypes structs, bytes (pynvml < 11.5), opaque handles."""

    NVMLError = pynvml.NVMLError

    def __init__(self, rec: dict[str, Any]) -> None:
        self._inner = RecordedNvml(rec)
        self._handles: list[tuple[object, Any]] = []  # (opaque handle, the recording's)

    def __getattr__(self, function: str) -> Any:
        inner = getattr(self._inner, function)

        def call(*args: Any) -> Any:
            args = tuple(next((mine for opaque, mine in self._handles if opaque is a), a) for a in args)
            answer = inner(*args)
            if function == "nvmlDeviceGetHandleByIndex":
                self._handles.append((object(), answer))
                return self._handles[-1][0]
            return self._as_pynvml(function, answer)

        return call

    @staticmethod
    def _as_pynvml(function: str, answer: Any) -> Any:
        if function == "nvmlDeviceGetMemoryInfo":
            return pynvml.c_nvmlMemory_t(answer.total, answer.free, answer.used)
        if function in ("nvmlDeviceGetPciInfo", "nvmlDeviceGetNvLinkRemotePciInfo"):
            pci = pynvml.nvmlPciInfo_t()
            pci.busId = answer.busId.encode()
            return pci
        if function == "nvmlDeviceGetUtilizationRates":
            return pynvml.c_nvmlUtilization_t(answer.gpu, answer.memory)
        if isinstance(answer, str):
            return answer.encode()
        return answer


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_recording_reads_as_the_library_it_was_made_from(name):
    library = _LikePynvml(recording(name))
    direct = read_inventory(library)
    made = record(_LikePynvml(recording(name)))
    assert direct is not None and read_inventory(RecordedNvml(made)) == direct
    assert json.loads(json.dumps(made)) == made  # JSON-able: structs as dicts, bytes as text
    assert made["devices"][0]["nvmlDeviceGetMemoryInfo"]["total"] == direct.gpus[0].memory_total_mib * 1024 * 1024
    assert made["devices"][0]["nvmlDeviceGetName"] == direct.gpus[0].name  # bytes recorded as text


def test_a_recording_file_loads(tmp_path):
    path = tmp_path / "node.json"
    path.write_text(json.dumps(recording("h200_1gpu")))
    assert read_inventory(RecordedNvml.from_file(path)) == inventory_of(recording("h200_1gpu"))


def test_without_pynvml_the_recording_says_the_library_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now fails
    assert read_inventory() is None
    assert record() == {"nvml_recording": 1, "system": {"nvmlInit": error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)}, "devices": []}


@pytest.mark.parametrize("name", RECORDINGS)
def test_the_inventory_round_trips_through_json(name):
    inv = inventory_of(recording(name))
    assert NvmlInventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv


# --- CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "indices"),
    [
        (None, list(range(8))),
        ("3,1", [3, 1]),
        ("", []),
        ("1,9,2", [1]),  # CUDA stops at the first entry that matches nothing
        ("GPU-a4c7,0", [4, 0]),  # UUID prefix
        ("c2f95b07", [5]),  # without "GPU-"
        ("2,2", [2]),
        ("-1,0", []),
        ("MIG-4f5e6d7c-1111-2222-3333-444455556666", []),
    ],
)
def test_visible_gpus_follow_cuda_numbering(visible, indices):
    inv = inventory_of(recording("h100_sxm_8gpu"))
    assert [g.index for g in visible_gpus(inv, visible)] == indices


# --- discovery ----------------------------------------------------------------------------------------


def test_discover_asks_nvml_first_and_applies_cuda_visible_devices():
    inv = discover(nvml=RecordedNvml(recording("h100_sxm_8gpu")), env={"CUDA_VISIBLE_DEVICES": "5,GPU-1b7a"})
    assert inv.source == "nvml"
    assert [(g.index, g.physical_index) for g in inv.gpus] == [(0, 5), (1, 0)]
    assert [g.uuid for g in inv.gpus] == [H100_UUIDS[5], H100_UUIDS[0]]
    assert [(g.memory_total_mib, g.memory_used_mib, g.utilization_pct) for g in inv.gpus] == [(81559, 74213, 100), (81559, 529, 0)]
    assert any("exposes 2 GPU(s)" in n for n in inv.notes)


def test_discover_falls_back_to_nvidia_smi_without_nvml(monkeypatch):
    monkeypatch.setattr(launcher.hardware.devices, "run_nvidia_smi", lambda: (DATA / "nvidia_smi_h100x4.csv").read_text())
    inv = discover(nvml=_NoLibrary(), env={})
    assert inv.source == "nvidia-smi" and inv.gpu_count == 4
    monkeypatch.setattr(launcher.hardware.devices, "run_nvidia_smi", lambda: None)
    inv = discover(nvml=_NoLibrary(), env={})
    assert inv.source == "none" and inv.gpu_count == 0


def test_recorded_nvidia_smi_output_bypasses_nvml():
    untouchable = SimpleNamespace()  # any NVML call on it would raise AttributeError
    inv = discover(query=lambda: (DATA / "nvidia_smi_h100x4.csv").read_text(), env={}, nvml=untouchable)
    assert inv.source == "nvidia-smi" and inv.gpu_count == 4


def test_discovery_and_nvml_do_not_import_torch():
    code = "import sys, launcher.hardware.devices, launcher.hardware.nvml, launcher.hardware.limits; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
