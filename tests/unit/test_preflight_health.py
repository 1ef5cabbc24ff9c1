"""GPU health before the start, from recorded NVML answers (no GPU here).

This machine: a GPU the job would use with uncorrectable ECC errors, clocks held down, too little
free memory, or lost to NVML is refused through the CLI (exit 2, one line naming host, GPU index,
UUID and what was found; no run directory, nothing started). Several hosts: a host that fails is
left out and the next spare takes its place, named in the preflight's record; a spare that
cannot be reached is named but not fatal unless it is needed.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest

from launcher.backends.ssh.preflight import HostReport, PreflightError, preflight_hosts
from launcher.control import nodes
from launcher.hardware.devices import discover
from launcher.hardware.nvml import RecordedNvml
from launcher.spec.cluster import ClusterConfig, HostConfig
from launcher.spec.model import load_job
from launcher.stage.plan import NodeTarget
from launcher.ui import cli

ssh_preflight = importlib.import_module("launcher.backends.ssh.preflight")  # the package exports a function of that name
REPO = Path(__file__).resolve().parents[2]
NVML_DATA = Path(__file__).parent / "data" / "nvml"
RECORDED = json.loads((NVML_DATA / "h100_sxm_8gpu.json").read_text())  # GPUs 4-7 busy with another job
IDLE_ANSWERS = ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetPowerUsage",
                "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo")
H100 = copy.deepcopy(RECORDED)
for _device in H100["devices"][4:]:  # an idle node: GPU 0's idle answers on every GPU
    _device.update({k: copy.deepcopy(RECORDED["devices"][0][k]) for k in IDLE_ANSWERS})


def h100_with(gpu: int, **answers: Any) -> dict[str, Any]:
    rec = copy.deepcopy(H100)
    rec["devices"][gpu].update(answers)
    return rec


def h100_lost(gpu: int) -> dict[str, Any]:
    rec = copy.deepcopy(H100)
    rec["devices"][gpu] = {"nvmlDeviceGetHandleByIndex": {"nvml_error": pynvml.NVML_ERROR_GPU_IS_LOST}}
    return rec


def node_from(rec: dict[str, Any], name: str = "gpu-node", visible: str | None = None) -> NodeTarget:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    inventory = discover(nvml=RecordedNvml(rec), env=env)
    inventory = type(inventory)(name, 64, inventory.gpus, inventory.source, inventory.cuda_visible_devices, inventory.notes)
    return NodeTarget(name=name, address="127.0.0.1", inventory=inventory, python=sys.executable)


BAD_GPUS = {
    "ecc": (h100_with(3, nvmlDeviceGetTotalEccErrors={"1,0": 2}), 3, "2 uncorrectable ECC errors (volatile)"),
    "throttled": (h100_with(5, nvmlDeviceGetCurrentClocksEventReasons=0x08 | 0x40, nvmlDeviceGetClockInfo={"1": 420}), 5, "clocks held down: hw_slowdown"),
    "busy memory": (h100_with(1, nvmlDeviceGetMemoryInfo=RECORDED["devices"][4]["nvmlDeviceGetMemoryInfo"]), 1, "only 7346 of 81559 MiB free"),
    "lost": (h100_lost(6), 6, "NVML cannot read this GPU"),
}


@pytest.mark.parametrize("case", sorted(BAD_GPUS))
def test_an_unfit_gpu_on_this_machine_refuses_the_run(case, monkeypatch, tmp_path, capsys):
    rec, index, words = BAD_GPUS[case]
    node = node_from(rec)
    monkeypatch.setattr(nodes, "local_node", lambda visible=None: node)
    code = cli.main([str(REPO / "jobs/ddp_train.yaml"), "--out", str(tmp_path), "--set", "resources.gpus_per_node=8"])
    err = capsys.readouterr().err
    assert code == 2, err
    uuid = node.inventory.gpus[index].uuid
    (line,) = [ln for ln in err.splitlines() if uuid in ln]
    assert line.startswith(f"error: gpu-node: GPU {index} ({uuid})") and words in line, err
    assert "nothing was started" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # no run directory


def test_a_gpu_the_job_does_not_use_is_not_its_business(monkeypatch):
    rec, _, _ = BAD_GPUS["ecc"]  # GPU 3 is bad; the job sees GPUs 0 and 1 only
    node = node_from(rec, visible="0,1")
    job = load_job(REPO / "jobs/ddp_train.yaml", ["resources.gpus_per_node=2"])
    nodes.check_local_gpus(job, node)
    with pytest.raises(Exception) as caught:
        nodes.check_local_gpus(job, node_from(rec, visible="3,1"))  # now cuda:0 is the bad one
    assert "GPU 3" in str(caught.value) and "cuda:0 for the job" in str(caught.value)
    nodes.check_local_gpus(load_job(REPO / "jobs/ddp_train.yaml", ["resources.gpus_per_node=2", "preflight.gpu_health=false"]), node_from(rec, visible="3,1"))


# --- several hosts: left out, replaced by a spare ---------------------------------------------------


def reports_for(hosts: list[HostConfig], bad: dict[str, dict[str, Any]], unreachable: set[str] = frozenset()) -> list[HostReport]:
    out = []
    for h in hosts:
        if h.name in unreachable:
            out.append(HostReport(h, (f"{h.name}: ssh: connect to host {h.address} port 22: No route to host",)))
            continue
        node = node_from(bad.get(h.name, H100), name=h.name)
        out.append(HostReport(h, (), node.inventory, "2.13.0"))
    return out


def cluster(n: int) -> ClusterConfig:
    return ClusterConfig(hosts=tuple(HostConfig(name=f"node-{i}", address=f"10.0.0.{i + 1}") for i in range(n)), source="cluster.yaml")


def run_preflight(monkeypatch, hosts: ClusterConfig, nodes: int, bad: dict[str, Any], unreachable: set[str] = frozenset()):
    monkeypatch.setattr(ssh_preflight, "preflight_reports", lambda c, job=None, timeout_s=0: reports_for(list(c.hosts), bad, unreachable))
    job = load_job(REPO / "jobs/ddp_train.yaml", [f"resources.nodes={nodes}", "resources.gpus_per_node=8"])
    return preflight_hosts(hosts, job, network=False)


def test_a_host_with_a_bad_gpu_is_swapped_for_the_spare(monkeypatch):
    outcome = run_preflight(monkeypatch, cluster(3), 2, {"node-1": BAD_GPUS["ecc"][0]})
    assert [t.name for t in outcome.targets] == ["node-0", "node-2"]
    record = outcome.record
    assert record.hosts == ("node-0", "node-2") and record.spares == ()
    (swap,) = record.left_out
    assert swap.host == "node-1" and swap.replaced_by == "node-2"
    assert "GPU 3" in swap.describe() and "uncorrectable ECC" in swap.describe() and "the spare node-2 takes its place" in swap.describe()


def test_too_few_healthy_hosts_is_refused_with_exit_2_and_every_problem(monkeypatch):
    with pytest.raises(PreflightError) as caught:
        run_preflight(monkeypatch, cluster(3), 3, {"node-1": BAD_GPUS["ecc"][0], "node-2": BAD_GPUS["throttled"][0]})
    assert caught.value.exit_code == 2
    lines = str(caught.value).splitlines()
    assert any(ln.startswith("node-1: GPU 3 (") for ln in lines) and any(ln.startswith("node-2: GPU 5 (") for ln in lines)
    assert "1 of the 3 host(s) the job needs passed; nothing was started" in lines[-1]


def test_an_unreachable_spare_is_named_but_not_fatal_unless_needed(monkeypatch):
    outcome = run_preflight(monkeypatch, cluster(3), 2, {}, unreachable={"node-2"})
    assert [t.name for t in outcome.targets] == ["node-0", "node-1"]
    (swap,) = outcome.record.left_out
    assert swap.host == "node-2" and swap.replaced_by is None and "No route to host" in swap.describe()
    with pytest.raises(PreflightError) as caught:
        run_preflight(monkeypatch, cluster(3), 3, {}, unreachable={"node-2"})
    assert caught.value.exit_code == 1  # a host that cannot be reached is not bad input


def test_a_rank_checks_the_gpu_it_was_granted_before_it_starts():
    from launcher.hardware.nvml import granted_gpu_problems

    rec, index, words = BAD_GPUS["ecc"]  # NVML's GPU 3
    nvml = RecordedNvml(rec)
    assert granted_gpu_problems(0, "3", nvml) == [f"GPU 3 ({H100_UUID(3)}): 2 uncorrectable ECC errors (volatile)"]
    assert granted_gpu_problems(1, "2,3", RecordedNvml(rec)) != [] and granted_gpu_problems(0, "2,3", RecordedNvml(rec)) == []
    assert granted_gpu_problems(3, None, RecordedNvml(rec)) != []
    assert granted_gpu_problems(3, None, RecordedNvml(H100)) == []


def H100_UUID(index: int) -> str:
    return discover(nvml=RecordedNvml(H100), env={}).gpus[index].uuid


def test_a_gpu_whose_memory_nvml_cannot_report_is_not_lost():
    from launcher.hardware.nvml import health_problems, read_inventory

    rec = copy.deepcopy(json.loads((NVML_DATA / "h200_1gpu.json").read_text()))
    rec["devices"][0]["nvmlDeviceGetMemoryInfo"] = {"nvml_error": pynvml.NVML_ERROR_NOT_SUPPORTED}  # unified memory (GB10)
    inventory = read_inventory(RecordedNvml(rec))
    assert inventory is not None and inventory.gpus[0].memory_total_mib == 0
    assert health_problems(inventory.gpus[0]) == []


def test_slow_links_no_blamed_host_explains_stop_the_start(monkeypatch):
    from launcher.records import LinkMeasure, NetworkCheck

    check = NetworkCheck(
        links=(LinkMeasure("node-0", "node-1", 9.0, 0.01), LinkMeasure("node-2", "node-0", 0.1, 0.01)),
        median_gbit_s=9.0, min_fraction=0.5,
        slow=("slow link node-1 <-> node-2: 0.05 Gbit/s vs 9 median", "slow link node-2 <-> node-0: 0.1 Gbit/s vs 9 median"),
        unreachable=(), bad_hosts=("node-1",), seconds=1.0,
    )  # fmt: skip
    import launcher.backends.ssh.netcheck as netcheck

    monkeypatch.setattr(netcheck, "network_check", lambda hosts, links, budget_s, min_fraction: check)
    monkeypatch.setattr(ssh_preflight, "preflight_reports", lambda c, job=None, timeout_s=0: reports_for(list(c.hosts), {}))
    monkeypatch.setattr(ssh_preflight, "current_links", lambda: None)
    job = load_job(REPO / "jobs/ddp_train.yaml", ["resources.nodes=2", "resources.gpus_per_node=8"])
    with pytest.raises(PreflightError) as caught:
        preflight_hosts(cluster(4), job)
    said = str(caught.value)
    assert "slow link node-2 <-> node-0" in said and "cannot tell which host is at fault" in said
    assert caught.value.exit_code == 2
