"""A run that outlives the machine that launched it: ``launch JOB --cluster FILE --detach`` starts
the run loop on the cluster's controller host (its first host here, h1) and returns; ``launch
attach|status|logs|stop|fetch RUN --cluster FILE`` find it there by its run id.

Each host's run root is its own (a tmpfs in its own mount namespace): the run directory, its
result.json, exist on h1 only, read here through h1 (``on_host``), until ``launch fetch`` brings
them home. The controller reaches h1 and h2 over SSH as a foreground launch does. A detached
controller that is SIGKILLed leaves no rank behind: every host's lifeline wrapper stops its ranks
when the controller's connection goes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from launcher.backends.ssh.command import heartbeat_timeout
from launcher.procutil import pid_alive
from launcher.runtime.hostagent import REMOTE_GRACE_S
from tests.cluster.conftest import REPO, NetnsCluster, sh
from tests.waiting import poll

pytestmark = pytest.mark.slow

TINY = [
    "--set", "resources.nodes=2", "--set", "resources.cpu_workers=1", "--set", "scaling=null",
    "--set", "params.sizes=[64]", "--set", "params.iters=3", "--set", "params.warmup=1",
]  # fmt: skip
HANG_GUARD_S = 240


STARTED: list[str] = []  # run ids this module detached: their entries in ~/.gpulaunch/detached go at the end


@pytest.fixture(autouse=True, scope="module")
def _forget_runs():
    yield
    from launcher.control.detached_controller import registry

    for run_id in STARTED:
        (registry() / f"{run_id}.json").unlink(missing_ok=True)


def _detach(cluster: NetnsCluster, *args: str) -> tuple[str, int, str]:
    """``launch ... --detach``: its run id, the controller's pid, its output."""
    done = cluster.launch(*args, "--detach", timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    found = re.search(r"^run (\S+): detached on (\S+) \(controller pid (\d+)\)", done.stdout, re.M)
    assert found, output
    STARTED.append(found[1])
    assert f"launch attach {found[1]} --cluster" in done.stdout
    return found[1], int(found[3]), output


def _rank_pids(pids_dir: Path, count: int) -> list[int]:
    return [json.loads((pids_dir / f"rank{r}.json").read_text())["pid"] for r in range(count)]


def _steady(cluster: NetnsCluster, tmp: Path) -> tuple[Path, Path, Path]:
    pids = tmp / "pids"
    pids.mkdir()
    spec = {
        "name": "steady",
        "entrypoint": "tests.cluster.steady_job:run",
        "params": {"out": str(pids)},
        "resources": {"nodes": 2, "cpu_workers": 1},
        "env": {"PYTHONPATH": str(REPO)},
        "timeouts": {"rendezvous_s": 60, "run_s": 600},
        "max_restarts": 0,
    }
    (tmp / "steady.yaml").write_text(json.dumps(spec))
    cfg = cluster.cluster_yaml(tmp / "cluster.yaml", hosts=cluster.hosts[:2])
    return tmp / "steady.yaml", cfg, pids


def _wait_ranks(pids: Path, count: int, controller: int) -> list[int]:
    started = poll(lambda: len(list(pids.glob("rank*.json"))) >= count or not pid_alive(controller), HANG_GUARD_S)
    assert started and pid_alive(controller), f"ranks did not start ({len(list(pids.glob('rank*.json')))} of {count}); controller alive: {pid_alive(controller)}"
    return _rank_pids(pids, count)


def test_detach_returns_with_the_run_id_and_attach_shows_the_run_to_its_summary(netns_cluster: NetnsCluster, tmp_path: Path, clean_after):
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml", hosts=netns_cluster.hosts[:2])
    out = netns_cluster.out_dir(tmp_path.name)
    run_id, controller, _ = _detach(netns_cluster, "jobs/matmul_scaling.yaml", "--cluster", str(cfg), "--out", str(out), *TINY)
    # launch has returned, and nothing of it is left on the launching host (its ssh included)
    assert netns_cluster.cli_ns not in netns_cluster.leftovers(), netns_cluster.describe(netns_cluster.leftovers())

    attached = netns_cluster.launch("attach", run_id, "--cluster", str(cfg), timeout=HANG_GUARD_S)
    shown = attached.stdout + attached.stderr
    assert attached.returncode == 0, shown[-4000:]
    assert "matmul_scaling: world size 2 on cpu (torchrun)" in shown, shown[-4000:]
    assert re.search(r"^h2:1 ", attached.stdout, re.M), shown[-4000:]  # a rank on the other host, live through the controller
    assert "succeeded" in shown and f"run directory: {out}/matmul_scaling/{run_id}" in shown, shown[-4000:]
    assert not pid_alive(controller)

    remote_dir = f"{out}/matmul_scaling/{run_id}"
    on_h1 = netns_cluster.on_host(netns_cluster.hosts[0], "cat", f"{remote_dir}/result.json")
    assert on_h1.returncode == 0, on_h1.stderr
    assert json.loads(on_h1.stdout)["status"] == "succeeded"
    local = Path(remote_dir)
    assert not local.exists()  # written where the run loop lived: on h1, not here

    status = netns_cluster.launch("status", run_id, "--cluster", str(cfg), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["status"] == "SUCCEEDED"
    logs = netns_cluster.launch("logs", run_id, "--cluster", str(cfg), "--rank", "1")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.strip() and all(line.startswith("h2:1 ") for line in logs.stdout.splitlines()), logs.stdout[-2000:]
    everything = netns_cluster.launch("logs", run_id, "--cluster", str(cfg), "-f", timeout=HANG_GUARD_S)  # an ended run: to its end, then back
    assert everything.returncode == 0 and "matmul_scaling: succeeded" in everything.stdout, everything.stdout[-2000:] + everything.stderr
    assert re.search(r"^h1:0 ", everything.stdout, re.M) and "@gpulaunch" not in everything.stdout, everything.stdout[-2000:]

    fetched = netns_cluster.launch("fetch", run_id, "--cluster", str(cfg), "--out", str(out))
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert json.loads((local / "result.json").read_text())["status"] == "succeeded"
    assert (local / "spec.yaml").is_file() and (local / "world2").is_dir()
    left = netns_cluster.wait_clean(15)
    assert not left, netns_cluster.describe(left)


def test_stop_ends_a_detached_run_on_every_host(netns_cluster: NetnsCluster, tmp_path: Path, clean_after):
    spec, cfg, pids = _steady(netns_cluster, tmp_path)
    out = netns_cluster.out_dir(tmp_path.name)
    run_id, controller, _ = _detach(netns_cluster, str(spec), "--cluster", str(cfg), "--out", str(out))
    ranks = _wait_ranks(pids, 2, controller)
    h1 = netns_cluster.hosts[0]
    # the controller's /metrics endpoint is on h1's loopback, and it listens nowhere else
    log = f"{out}/steady/{run_id}/controller.log"
    assert poll(lambda: "metrics: http://127.0.0.1:" in netns_cluster.on_host(h1, "cat", log).stdout, 30), netns_cluster.on_host(h1, "cat", log).stdout
    listening = sh("ip", "netns", "exec", h1.ns, "ss", "-Hltnp", check=False).stdout.splitlines()
    own = [line for line in listening if f"pid={controller}," in line]
    assert own and all(line.split()[3].startswith("127.0.0.1:") for line in own), listening

    # Ctrl-C on attach leaves the run as it is (exit 0)
    watcher = netns_cluster.popen_launch("attach", run_id, "--cluster", str(cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert watcher.stdout is not None
        seen = []
        for line in watcher.stdout:
            seen.append(line)
            if "steady: world size 2 on cpu (torchrun)" in line:
                break
        watcher.send_signal(signal.SIGINT)
        rest, _ = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0 and "it goes on" in rest, "".join(seen)[-3000:] + rest[-3000:]
    assert pid_alive(controller) and all(pid_alive(p) for p in ranks)

    status = netns_cluster.launch("status", run_id, "--cluster", str(cfg))
    assert status.returncode == 0 and f"{run_id}: RUNNING" in status.stdout, status.stdout + status.stderr
    stopped = netns_cluster.launch("stop", run_id, "--cluster", str(cfg), timeout=HANG_GUARD_S)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"{run_id}: INTERRUPTED" in stopped.stdout, stopped.stdout
    assert not pid_alive(controller) and not any(pid_alive(p) for p in ranks)
    attached = netns_cluster.launch("attach", run_id, "--cluster", str(cfg), timeout=HANG_GUARD_S)
    assert attached.returncode == 130, attached.stdout[-3000:] + attached.stderr[-3000:]  # the run's exit code: interrupted
    left = netns_cluster.wait_clean(15)
    assert not left, netns_cluster.describe(left)


def test_a_killed_controller_leaves_no_rank_on_any_host(netns_cluster: NetnsCluster, tmp_path: Path, clean_after):
    spec, cfg, pids = _steady(netns_cluster, tmp_path)
    out = netns_cluster.out_dir(tmp_path.name)
    run_id, controller, _ = _detach(netns_cluster, str(spec), "--cluster", str(cfg), "--out", str(out), "--no-metrics")
    ranks = _wait_ranks(pids, 2, controller)
    os.kill(controller, signal.SIGKILL)
    # each host's wrapper stops its ranks when the controller's connection goes: at the latest after
    # the heartbeat silence and the wrapper's SIGTERM -> SIGKILL grace (slack for a loaded machine)
    grace = heartbeat_timeout(None) + REMOTE_GRACE_S + 20.0
    left = netns_cluster.wait_clean(grace)
    assert not left, netns_cluster.describe(left)
    assert not any(pid_alive(p) for p in ranks)
    status = netns_cluster.launch("status", run_id, "--cluster", str(cfg))
    assert status.returncode == 0 and f"{run_id}: LOST" in status.stdout, status.stdout + status.stderr
    attached = netns_cluster.launch("attach", run_id, "--cluster", str(cfg), timeout=HANG_GUARD_S)
    assert attached.returncode == 1 and "ended without its result" in attached.stdout + attached.stderr, attached.stdout + attached.stderr
    left = netns_cluster.wait_clean(15)
    assert not left, netns_cluster.describe(left)


def _checkpoints_on(cluster: NetnsCluster, host_index: int, run_dir: str) -> list[str]:
    done = cluster.on_host(cluster.hosts[host_index], "sh", "-c", f"ls -d {run_dir}/world2/checkpoints/step-* 2>/dev/null")
    return [Path(line).name for line in done.stdout.split()]


def test_resume_starts_a_killed_controller_again_from_the_last_checkpoint(netns_cluster: NetnsCluster, tmp_path: Path, clean_after):
    from tests.jobs.conftest import TINY_TRAIN

    spec = tmp_path / "train.yaml"
    text = (REPO / "jobs" / "ddp_train.yaml").read_text()
    spec.write_text(text.replace("env: {}", f"env: {{PYTHONPATH: {REPO}}}").replace("cpu_workers: 2", "cpu_workers: 1").replace("nodes: 1", "nodes: 2"))
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml", hosts=netns_cluster.hosts[:2])
    out = netns_cluster.out_dir(tmp_path.name)
    sets = ["entrypoint=tests.jobs.killed_train:run", "params.kill_at=-1", "params.epochs=6", "scaling.workers=[2]",
            f"params.marker={tmp_path / 'unused'}", "params.step_sleep_s=0.25", *TINY_TRAIN]  # fmt: skip
    run_id, controller, _ = _detach(netns_cluster, str(spec), "--cluster", str(cfg), "--out", str(out), "--no-metrics", *(a for s in sets for a in ("--set", s)))
    run_dir = f"{out}/ddp_train/{run_id}"
    saved = poll(lambda: "step-000000008" in _checkpoints_on(netns_cluster, 0, run_dir) or not pid_alive(controller), HANG_GUARD_S)
    assert saved and pid_alive(controller), netns_cluster.on_host(netns_cluster.hosts[0], "cat", f"{run_dir}/controller.log").stdout[-3000:]
    os.kill(controller, signal.SIGKILL)
    left = netns_cluster.wait_clean(heartbeat_timeout(None) + REMOTE_GRACE_S + 20.0)
    assert not left, netns_cluster.describe(left)

    resumed = netns_cluster.launch("resume", run_id, "--cluster", str(cfg))
    assert resumed.returncode == 0 and f"run {run_id}: resuming on h1" in resumed.stdout, resumed.stdout + resumed.stderr
    attached = netns_cluster.launch("attach", run_id, "--cluster", str(cfg), timeout=HANG_GUARD_S)
    assert attached.returncode == 0, attached.stdout[-4000:] + attached.stderr[-3000:]
    result = json.loads(netns_cluster.on_host(netns_cluster.hosts[0], "cat", f"{run_dir}/result.json").stdout)
    assert result["status"] == "succeeded"
    (stage,) = result["stages"]
    assert stage["attempts"][-1]["resumed_step"] is not None and stage["attempts"][-1]["resumed_step"] >= 8, stage["attempts"]
    left = netns_cluster.wait_clean(15)
    assert not left, netns_cluster.describe(left)


def test_the_cluster_file_names_its_controller_host(tmp_path: Path):
    from launcher.errors import SpecError
    from launcher.spec.cluster import load_cluster

    def cluster(extra: str) -> Path:
        path = tmp_path / "cluster.yaml"
        path.write_text("defaults: {user: root, key: id_test}\nhosts:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n" + extra)
        return path

    assert load_cluster(cluster("")).controller_host.name == "a"  # none named: the first host
    assert load_cluster(cluster("controller: b\n")).controller_host.name == "b"
    login = load_cluster(cluster("controller: {name: login, address: 10.0.0.9, port: 2222}\n")).controller_host
    assert (login.name, login.port, login.user, login.key) == ("login", 2222, "root", str(tmp_path / "id_test"))  # defaults inherited
    with pytest.raises(SpecError, match=r"cluster.yaml:5: controller: 'c' is not one of the hosts"):
        load_cluster(cluster("controller: c\n"))
    with pytest.raises(SpecError, match=r"controller.port"):
        load_cluster(cluster("controller: {address: 10.0.0.9, port: 0}\n"))
