"""Ray across two "servers": a head in h1's namespace, a worker in h2's; the job's ranks spread
over both nodes and result.json names each rank's host.

The Ray processes run with `--block` and their own temp dirs, so nothing touches another Ray on
this machine (no `ray stop`: it would kill every Ray here); teardown kills what is left in our
namespaces, by pid. The worker node starts alongside the head (it waits for the head's GCS), and
the fixture waits on the dashboard's node list, read from h1's namespace with a plain HTTP request.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import PREFIX, NetnsCluster, netns_pids
from tests.conftest import REPO
from tests.integration.faultkit import pythonpath

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT, DASHBOARD_PORT = 6379, 8265


def _ray_env(token: str) -> dict[str, str]:
    # this venv's python first on PATH: a submitted job's entrypoint (`python -m launcher...`) runs
    # with the node's PATH, as on a real cluster whose nodes have gpulaunch and Ray installed
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_two_nodes(netns_cluster: NetnsCluster, tmp_path_factory):
    if importlib.util.find_spec("ray") is None or not Path(RAY).exists():
        pytest.skip("needs Ray (pip install 'gpulaunch[ray]')")
    h1, h2 = netns_cluster.hosts[:2]
    token = secrets.token_hex(16)
    logs = tmp_path_factory.mktemp("ray")
    procs: list[subprocess.Popen] = []
    common = ["--block", "--num-cpus=1", "--num-gpus=0", "--object-store-memory=100000000", "--disable-usage-stats"]
    try:
        head_cmd = [RAY, "start", "--head", f"--node-ip-address={h1.address}", f"--port={GCS_PORT}",
                    "--include-dashboard=true", f"--dashboard-host={h1.address}", f"--dashboard-port={DASHBOARD_PORT}",
                    f"--temp-dir=/tmp/{PREFIX}-ray1", *common]
        procs.append(subprocess.Popen(netns_cluster.ns_cmd(*head_cmd, ns=h1.ns), env=_ray_env(token),
                                      stdout=open(logs / "head.log", "wb"), stderr=subprocess.STDOUT))  # noqa: SIM115
        worker_cmd = [RAY, "start", f"--address={h1.address}:{GCS_PORT}", f"--node-ip-address={h2.address}",
                      f"--temp-dir=/tmp/{PREFIX}-ray2", *common]
        procs.append(subprocess.Popen(netns_cluster.ns_cmd(*worker_cmd, ns=h2.ns), env=_ray_env(token),
                                      stdout=open(logs / "worker.log", "wb"), stderr=subprocess.STDOUT))  # noqa: SIM115
        dashboard = f"http://{h1.address}:{DASHBOARD_PORT}"
        _wait_for(lambda: _dashboard_nodes_alive(netns_cluster, h1, dashboard, token) >= 2, 90, procs, logs)
        yield netns_cluster, token, dashboard
    finally:
        for ns in (h1.ns, h2.ns, netns_cluster.cli_ns):
            _kill_namespace_processes(ns, keep=netns_cluster.sshd_pids())
        for proc in procs:
            proc.wait(10)
        for k in (1, 2):
            shutil.rmtree(f"/tmp/{PREFIX}-ray{k}", ignore_errors=True)


def _kill_namespace_processes(ns: str, keep: set[int]) -> None:
    """SIGKILL, by pid, every process in ``ns`` but ``keep``: Ray's, all at once (on SIGTERM a
    raylet whose GCS went first waits for it, seconds; nothing of these nodes outlives the test)."""
    deadline = time.monotonic() + 5.0
    while (pids := netns_pids(ns) - keep) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


NODES_SNIPPET = """
import json, ray
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
print("NODES", json.dumps(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])))
"""


def _alive_addresses(cluster: NetnsCluster, host, token: str) -> list[str]:
    done = subprocess.run(
        cluster.ns_cmd(sys.executable, "-c", NODES_SNIPPET.format(address=f"{host.address}:{GCS_PORT}"), ns=host.ns),
        env=_ray_env(token), capture_output=True, text=True, timeout=60,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("NODES ")), None)
    return json.loads(line[6:]) if line else []


NODES_REST_SNIPPET = """
import json, os, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/api/v0/nodes?limit=100", headers={"Authorization": "Bearer " + os.environ["RAY_AUTH_TOKEN"]})
try:
    nodes = json.loads(urllib.request.urlopen(req, timeout=5).read())["data"]["result"]["result"]
except Exception:
    nodes = []
print(sum(n.get("state") == "ALIVE" for n in nodes))
"""


def _dashboard_nodes_alive(cluster: NetnsCluster, host, dashboard: str, token: str) -> int:
    """The alive nodes as the head's dashboard lists them (0 until it answers); no Ray driver."""
    done = subprocess.run(cluster.ns_cmd(sys.executable, "-c", NODES_REST_SNIPPET, dashboard, ns=host.ns),
                          env=_ray_env(token), capture_output=True, text=True, timeout=30)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def _wait_for(predicate, timeout_s: float, procs: list[subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        exited = [p.returncode for p in procs if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            text = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in sorted(logs.glob("*.log")))
            raise AssertionError(f"Ray did not come up ({f'exited {exited}' if exited else f'in {timeout_s}s'}):\n{text}")
        time.sleep(0.5)


def test_ray_cluster_spans_two_namespaces(ray_two_nodes):
    cluster, token, _ = ray_two_nodes
    h1, h2 = cluster.hosts[:2]
    assert _alive_addresses(cluster, h1, token) == sorted([h1.address, h2.address])


def _ray_job(cluster: NetnsCluster, tmp_path: Path, token: str, *launch_args: str, ns: str | None = None, env: dict | None = None):
    return subprocess.run(
        cluster.ns_cmd(sys.executable, "-m", "launcher", "jobs/matmul_scaling.yaml", "--backend", "ray", *launch_args,
                       "--out", str(tmp_path / "runs"), "--set", "resources.cpu_workers=2", "--set", "scaling.workers=[2]",
                       "--set", "params.sizes=[64]", "--set", "params.iters=3", "--set", "params.warmup=1",
                       "--set", "timeouts.rendezvous_s=20", ns=ns),
        cwd=REPO, env={**_ray_env(token), **(env or {})}, capture_output=True, text=True, timeout=240,
    )


def _assert_spread(done: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result_file,) = (tmp_path / "runs").rglob("result.json")
    result = json.loads(result_file.read_text())
    assert result["backend"] == "ray" and result["status"] == "succeeded"
    ranks = sorted((r for r in result["ranks"] if r["world_size"] == 2), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["status"] == "ok" and r.get("host") for r in ranks)
    # One rank per node (each node has one CPU): node_rank tells the nodes apart. The namespaces
    # share one hostname, so `host` alone cannot show the spread here (on real servers it does).
    assert sorted(r["node_rank"] for r in ranks) == [0, 1], ranks
    print(textwrap.shorten(f"ray ranks: {[(r['rank'], r['host'], r['node_rank']) for r in ranks]}", 300))  # noqa: T201


def _need_ray_backend(*modules: str) -> None:
    missing = [m for m in ("launcher.backends.ray", *modules) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the Ray backend is not in this tree yet (missing {', '.join(missing)})")


def test_ray_backend_spreads_ranks_over_both_nodes(ray_two_nodes, tmp_path):
    """The launcher as a driver connected to the cluster (what a Ray job's entrypoint does)."""
    _need_ray_backend()
    cluster, token, _ = ray_two_nodes
    h1 = cluster.hosts[0]
    done = _ray_job(cluster, tmp_path, token, ns=h1.ns,
                    env={"GPULAUNCH_RAY_CONNECT": "1", "RAY_ADDRESS": f"{h1.address}:{GCS_PORT}"})
    _assert_spread(done, tmp_path)


def test_launch_with_address_runs_across_both_nodes(ray_two_nodes, tmp_path):
    """`launch ... --address http://HEAD:8265` from the launching host (Ray Jobs API)."""
    _need_ray_backend("launcher.backends.ray_jobs")
    cluster, token, address = ray_two_nodes
    _assert_spread(_ray_job(cluster, tmp_path, token, "--address", address), tmp_path)


STEPPER = '''
import time


def run(ctx):
    """A step every 50 ms for params.seconds."""
    end, n = time.monotonic() + float(ctx.param("seconds")), 0
    while time.monotonic() < end:
        time.sleep(0.05)
        ctx.metrics.step()
        n += 1
    return {"steps": n}
'''


def test_ranks_on_the_worker_node_are_live_on_the_submitting_console_and_endpoint(ray_two_nodes, tmp_path):
    """`launch --address` from the launching host: the rank on the worker node (its beacons on
    that node, which the launcher inside the job reads through Ray itself) is live on this
    console's progress line and on this launch's own /metrics, over the Ray job's log."""
    from tests.cluster.terminal import TerminalRun

    _need_ray_backend("launcher.backends.ray_jobs")
    cluster, token, address = ray_two_nodes
    h1, h2 = cluster.hosts[:2]
    job = tmp_path / "job"
    job.mkdir()
    (job / "stepper_job.py").write_text(STEPPER)
    (job / "stepper.yaml").write_text(
        "name: stepper\nentrypoint: stepper_job:run\nparams: {seconds: 20}\nbackend: ray\n"
        "resources: {cpu_workers: 2}\nray: {placement: strict_spread}\ntimeouts: {rendezvous_s: 60, run_s: 300}\n"
    )
    env = {k: v for k, v in _ray_env(token).items() if k.startswith("RAY_")}
    env["PYTHONPATH"] = pythonpath(REPO, job)  # the spec's entrypoint is checked here before submitting
    run = TerminalRun(cluster, str(job / "stepper.yaml"), "--address", address, "--out", str(tmp_path / "runs"), env=env)
    try:
        seen: list[dict] = []
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and run.proc.poll() is None:
            steps = run.scrape().get("gpulaunch_steps_total", {}) if run.metrics_url() else {}
            # the second sighting once the worker node's rank has stepped on since the first (its
            # beacons come through the job's log: seconds late on a busy machine)
            grew = not seen or any(v > seen[0].get(k, v) for k, v in steps.items() if k[1] == h2.address)
            if len(steps) == 2 and all(v > 0 for v in steps.values()) and grew:
                seen.append(steps)
                if len(seen) == 2:
                    break
            time.sleep(0.5)
        live_text = run.text
        code = run.wait(180)
    finally:
        if run.proc.poll() is None:
            run.proc.terminate()
            run.proc.wait(60)
    assert code == 0, run.text[-3000:]
    assert len(seen) == 2, run.text[-3000:]
    first, second = seen
    # one rank on each node, named by the node's address (the namespaces share one hostname)
    assert sorted(node for _, node in first) == sorted([h1.address, h2.address]), first
    worker = next(key for key in first if key[1] == h2.address)
    assert second[worker] > first[worker], (first, second)  # the worker node's rank, stepping, seen here
    assert re.search(r"world 2 · 2 running · steps \d+", live_text), live_text[-3000:]
    result = _result_of(tmp_path / "runs")
    assert sorted(r["host"] for r in result["ranks"]) == sorted([h1.address, h2.address])
    print(f"worker-node rank {worker[0]} live on the submitting side: steps {first[worker]:.0f} -> {second[worker]:.0f}")  # noqa: T201


def _result_of(out: Path) -> dict:
    (result_file,) = out.rglob("result.json")
    return json.loads(result_file.read_text())


def test_a_hang_on_the_worker_node_is_named_from_evidence_gathered_there(ray_two_nodes, tmp_path):
    """`launch --address`: the rank on the worker node sleeps forever at step 20. The launcher
    inside the Ray job sees the stall, a task pinned to the worker node reads that rank's stacks
    and flight recorder where its files are (that node's own folder), and the diagnosis comes
    back over the job's wire to this console and result.json."""
    from tests.integration.test_hangs import CASES, line_of

    _need_ray_backend("launcher.backends.ray_jobs")
    cluster, token, address = ray_two_nodes
    h2 = cluster.hosts[1]
    job = tmp_path / "job"  # the job's folder travels with it to the cluster (Ray's working_dir)
    job.mkdir()
    shutil.copy(REPO / "tests" / "integration" / "hang_job.py", job / "hang_job.py")
    spec = job / "rayhang2.yaml"
    spec.write_text(
        "name: rayhang2\nentrypoint: hang_job:run\nbackend: ray\nparams: {hang: sleep, rank: 1, at: 20}\n"
        "resources: {cpu_workers: 2}\nray: {placement: strict_spread}\ntimeouts: {rendezvous_s: 60, run_s: 300, hang_s: 6}\n"
    )
    env = {k: v for k, v in _ray_env(token).items() if k.startswith("RAY_")}
    env["PYTHONPATH"] = pythonpath(REPO, job)  # the spec's entrypoint is checked here before submitting
    done = subprocess.run(cluster.ns_cmd(sys.executable, "-m", "launcher", str(spec), "--address", address, "--out", str(tmp_path / "runs")),
                          cwd=REPO, env={**_ray_env(token), **env}, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = _result_of(tmp_path / "runs")
    assert result["status"] == "hung", result.get("failure")
    hang = result["failure"]["hang"]
    (culprit,) = hang["culprits"]
    rank_hosts = {r["rank"]: r["host"] for r in result["ranks"]}
    assert culprit["rank"] == 1 and culprit["line"] == line_of(CASES["sleep"][1]) and culprit["host"] == rank_hosts[1], hang
    assert "HUNG: rank 1 on" in " ".join(done.stdout.split()), done.stdout[-3000:]
    # each rank was found where it was, on its own node: the worker node's too (its stacks and collectives read there)
    worker_rank = next(rank for rank, host in rank_hosts.items() if host == h2.address)
    group = next(g for g in hang["groups"] if worker_rank in g["ranks"])
    expected = "time.sleep(FOREVER_S)" if worker_rank == 1 else "dist.all_reduce(grads)"
    assert group["where"].startswith("hang_job.py:") and group["where"].endswith(expected), hang
    print(f"worker node {h2.address}: {hang['summary']}")  # noqa: T201
