"""Discovery from recorded nvidia-smi output (no GPU needed), and the d2l helpers on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.hardware.devices import apply_visible_devices, cpu, discover, num_gpus, parse_nvidia_smi_csv, try_all_gpus, try_gpu

DATA = Path(__file__).parent / "data"


def recorded(name: str):
    return lambda: (DATA / name).read_text()


def test_parses_every_field_of_a_recorded_h100_node():
    gpus = parse_nvidia_smi_csv((DATA / "nvidia_smi_h100x4.csv").read_text())
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[1].name == "NVIDIA H100 80GB HBM3"
    assert (gpus[1].memory_total_mib, gpus[1].memory_used_mib, gpus[1].utilization_pct) == (81559, 40960, 97)
    assert gpus[3].utilization_pct is None  # "[N/A]" is unknown, not zero
    assert gpus[0].uuid.startswith("GPU-1b7a")


def test_unknown_memory_used_is_none():
    (gpu,) = parse_nvidia_smi_csv((DATA / "nvidia_smi_a100_mig_na.csv").read_text())
    assert gpu.memory_used_mib is None and gpu.memory_total_mib == 40960


@pytest.mark.parametrize(
    ("visible", "physical"),
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        ("", []),
        ("1,7,2", [1]),  # CUDA stops at the first entry it cannot match
        ("GPU-3d9c8e5a", [2]),  # UUID prefix
        ("3,3", [3]),
    ],
)
def test_cuda_visible_devices_selects_and_renumbers(visible, physical):
    gpus = parse_nvidia_smi_csv((DATA / "nvidia_smi_h100x4.csv").read_text())
    chosen = apply_visible_devices(gpus, visible)
    assert [g.physical_index for g in chosen] == physical
    assert [g.index for g in chosen] == list(range(len(physical)))


def test_discover_uses_recorded_output_and_env():
    inv = discover(query=recorded("nvidia_smi_h100x4.csv"), env={"CUDA_VISIBLE_DEVICES": "1,3"})
    assert inv.gpu_count == 2
    assert [g.physical_index for g in inv.gpus] == [1, 3]
    assert inv.cuda_visible_devices == "1,3"
    assert inv.cpu_count >= 1


def test_discover_without_driver_reports_cpu_only():
    inv = discover(query=lambda: None, env={})
    assert inv.gpu_count == 0 and inv.source == "none"
    assert any("no NVIDIA driver" in n for n in inv.notes)


def test_inventory_round_trips_through_json():
    import json

    from launcher.hardware.devices import NodeInventory

    inv = discover(query=recorded("nvidia_smi_h100x4.csv"), env={})
    again = NodeInventory.from_dict(json.loads(inv.to_json()))
    assert again == inv


def test_garbled_output_is_a_note_not_a_crash():
    inv = discover(query=lambda: "garbage line without commas\n", env={})
    assert inv.gpu_count == 0
    assert any("could not read" in n for n in inv.notes)


def test_d2l_helpers_fall_back_to_cpu_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without GPUs")
    assert num_gpus() == 0
    assert try_gpu(0) == cpu() == torch.device("cpu")
    assert try_all_gpus() == [torch.device("cpu")]


def test_the_jobs_own_cuda_visible_devices_replaces_the_launchers():
    inv = discover(query=recorded("nvidia_smi_h100x4.csv"), env={"CUDA_VISIBLE_DEVICES": "0,1,2"}, visible_override="3,1")
    assert [g.physical_index for g in inv.gpus] == [3, 1] and [g.index for g in inv.gpus] == [0, 1]
    assert inv.cuda_visible_devices == "3,1"
    assert any(n.startswith("the job's env: CUDA_VISIBLE_DEVICES='3,1'") for n in inv.notes)


def test_mig_devices_are_counted_not_dropped_to_cpu():
    visible = "MIG-4f5e6d7c-1111-2222-3333-444455556666,MIG-4f5e6d7c-1111-2222-3333-777788889999"
    inv = discover(query=recorded("nvidia_smi_a100_mig_na.csv"), env={"CUDA_VISIBLE_DEVICES": visible})
    assert inv.gpu_count == 2 and [g.index for g in inv.gpus] == [0, 1]
    assert [g.uuid for g in inv.gpus] == visible.split(",")
    assert any("MIG devices" in n for n in inv.notes)


def test_a_plan_counts_the_gpus_the_jobs_env_leaves_visible(tmp_path, monkeypatch):
    import functools

    import launcher.control.nodes
    from launcher.control.api import dry_run
    from launcher.spec.model import load_job

    monkeypatch.setattr(launcher.control.nodes, "discover", functools.partial(discover, query=recorded("nvidia_smi_h100x4.csv"), env={}))
    spec = tmp_path / "j.yaml"
    spec.write_text("name: j\nentrypoint: launcher.workloads.matmul:run\nenv: {CUDA_VISIBLE_DEVICES: '2,3'}\n")
    (plan,) = dry_run(load_job(spec)).plans
    assert plan.world_size == 2 and [r.device for r in plan.ranks] == ["cuda:0", "cuda:1"]
