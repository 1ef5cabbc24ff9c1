"""A host lost mid-run over SSH, with a spare in the cluster file: the restart runs on the spare and
resumes from the last checkpoint. Each host's run directory is its own (tmpfs): the checkpoint
reaches the spare only because ctx.checkpoint keeps a copy on every host (rank 0 sends it to each
host's first rank when they share no filesystem) and the load sends it to a host that has none.
The host lost is h1, rank 0's and the rendezvous's: its own copy goes with it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import REPO, NetnsCluster
from tests.jobs.conftest import TINY_TRAIN

pytestmark = pytest.mark.slow

SETS = ["entrypoint=tests.jobs.killed_train:run", "params.kill_at=-1", "params.epochs=6", "scaling.workers=[2]", *TINY_TRAIN]


def _spec(tmp: Path) -> Path:
    spec = tmp / "train.yaml"
    text = (REPO / "jobs" / "ddp_train.yaml").read_text()
    spec.write_text(text.replace("env: {}", f"env: {{PYTHONPATH: {REPO}}}").replace("cpu_workers: 2", "cpu_workers: 1").replace("nodes: 1", "nodes: 2"))
    return spec


def _args(spec: Path, cfg: Path, out: Path, marker: Path, *extra: str) -> list[str]:
    sets = [a for s in (*SETS, f"params.marker={marker}", *extra) for a in ("--set", s)]
    return [str(spec), "--cluster", str(cfg), "--out", str(out), "--no-metrics", *sets]


def _result(out: Path) -> dict:
    (run_dir,) = (out / "ddp_train").iterdir()
    return json.loads((run_dir / "result.json").read_text())


def _checkpoints_on(cluster: NetnsCluster, host_index: int, out: Path) -> list[str]:
    done = cluster.on_host(cluster.hosts[host_index], "sh", "-c", f"ls -d {out}/ddp_train/*/world2/checkpoints/step-* 2>/dev/null")
    return [Path(line).name for line in done.stdout.split()]


def power_off_h1_once_h2_has_step_8(cluster: NetnsCluster, proc: subprocess.Popen, out: Path) -> str:
    """Wait for h2's copy of the step-8 checkpoint, power h1 off (rank 0's host and the rendezvous:
    every process and its run directory), and return the run's output once it ends; h1 is powered
    on again and the launcher killed (by pid) whatever happens."""
    h1 = cluster.hosts[0]
    try:
        deadline = time.monotonic() + 120
        while "step-000000008" not in _checkpoints_on(cluster, 1, out):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:] if proc.poll() is not None else "no checkpoint"
            time.sleep(0.2)
        cluster.power_off(h1)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cluster.power_on(h1)
    return output


def test_a_lost_host_is_replaced_by_the_spare_and_the_run_resumes_from_the_copy_on_another_host(netns_cluster: NetnsCluster, tmp_path: Path, clean_after):
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml")  # h1 h2 h3; resources.nodes: 2 -> h3 is a spare
    spec = _spec(tmp_path)
    baseline_out = netns_cluster.out_dir(f"{tmp_path.name}-baseline")
    done = netns_cluster.launch(*_args(spec, cfg, baseline_out, tmp_path / "unused"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    baseline = {r["result"]["model_sha256"] for r in _result(baseline_out)["ranks"]}
    assert "spare host(s) h3: used when a host is lost" in done.stdout + done.stderr

    out = netns_cluster.out_dir(tmp_path.name)
    proc = netns_cluster.popen_launch(*_args(spec, cfg, out, tmp_path / "unused", "params.step_sleep_s=0.25"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = power_off_h1_once_h2_has_step_8(netns_cluster, proc, out)
    assert proc.returncode == 0, output[-4000:]
    result = _result(out)
    first, second = result["stages"][0]["attempts"]
    assert first["failure_class"] == "host_lost" and first["restarted"], first
    assert second["resumed_step"] is not None and second["resumed_step"] >= 8, second
    assert "h1 lost: its ranks go to the spare host h3" in output
    assert sorted(r["host"] for r in result["ranks"]) == ["h2", "h3"]  # the restart ran on h2 and the spare
    assert {r["result"]["model_sha256"] for r in result["ranks"]} == baseline  # bit for bit, from h2's copy
    assert "step-000000024" in _checkpoints_on(netns_cluster, 2, out)  # the spare keeps copies from then on
    # and the launching machine has the run's last checkpoint, copied from rank 0's host at the end
    (run_dir,) = (out / "ddp_train").iterdir()
    here = run_dir / "world2" / "checkpoints"
    assert sorted(p.name for p in here.iterdir()) == ["step-000000024"], list(here.iterdir())
    assert json.loads((here / "step-000000024" / "manifest.json").read_text())["step"] == 24
    left = netns_cluster.wait_clean()
    assert not left, netns_cluster.describe(left)
