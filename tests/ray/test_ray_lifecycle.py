"""What a Ray run may touch and how it ends: an embedded run listens on loopback only and kills
only Ray's own processes (never the caller's other subprocesses), ``launch stop`` or a signal to ``launch --address`` stops the
submitted job, and ``resources.nodes > 1`` is refused before anything is submitted.

The three runs that are ended (by ``launch stop``, SIGTERM, SIGINT) are submitted side by side
when the first of their tests starts (``sleeping_runs``): getting a Ray job to its running rank
costs seconds of CPU, which they then spend together. Each test ends its own run and checks it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from launcher.procutil import pid_alive, wait_gone
from tests.ray.conftest import REPO, RayHead, descendants, launch, wait_no_orphans
from tests.integration.faultkit import pythonpath

pytestmark = pytest.mark.slow


LOOPBACK_SPEC = """\
name: loopback
entrypoint: launcher.workloads.matmul:run
params: {sizes: [128], iters: 200, trials: 3}
backend: ray
resources: {cpu_workers: 2}
scaling: {workers: [2]}
"""


def _listeners(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
@pytest.mark.usefixtures("no_ray_driver")
def test_embedded_run_in_process_listens_on_loopback_only_and_spares_the_callers_processes(tmp_path: Path) -> None:
    """A notebook or a service calling run_job keeps its own subprocesses; Ray's are all gone. While
    the ranks run, every socket the embedded Ray's processes listen on is on 127.0.0.1 (checked with
    ``ss``; Ray would otherwise use the machine's address and every interface)."""
    import launcher

    spec = tmp_path / "loopback.yaml"
    spec.write_text(LOOPBACK_SPEC)
    seen: list[str] = []
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        baseline = descendants(os.getpid())  # another test's Ray head is not this run's
        assert bystander.pid in baseline

        class Watch(launcher.RunEvents):
            def progress(self, progress):  # noqa: ANN001 - while the ranks run: every Ray process is up
                if not seen:
                    seen.extend(_listeners(descendants(os.getpid()) - baseline))

        result = launcher.run_job(spec, out=tmp_path / "runs", events=Watch(), metrics=False)
        assert result.status == "succeeded", result.data.get("failure")
        assert bystander.poll() is None and pid_alive(bystander.pid), "the caller's own subprocess was killed"
        assert wait_no_orphans(baseline) == [], "a Ray process of the embedded run is still alive"
    finally:
        bystander.kill()
        bystander.wait()
    assert len(seen) >= 3, seen  # gcs_server, raylet, the dashboard and its agent, the rank actors
    off_loopback = [addr for addr in seen if not addr.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:"))]
    assert off_loopback == [], seen


def _jobs(head: RayHead) -> list[dict]:
    return head.rest("/api/jobs/")


def test_several_nodes_with_address_is_refused_before_submitting(ray_head: RayHead, tmp_path: Path) -> None:
    before = {j["submission_id"] for j in _jobs(ray_head)}
    run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", "--address", ray_head.address, "--set", "resources.nodes=2",
                 "--set", "resources.cpu_workers=2", "--out", str(tmp_path), env=ray_head.env)
    assert run.returncode == 2, run.stderr[-3000:] + run.stdout[-3000:]
    assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert "resources.nodes: 1" in run.stderr and "resources.cpu_workers: 4" in run.stderr and "ray.placement: spread" in run.stderr
    assert "--cluster" not in run.stderr
    assert {j["submission_id"] for j in _jobs(ray_head)} == before, "a job was submitted"
    assert not any(tmp_path.iterdir())


def test_a_dry_run_with_an_address_plans_on_the_clusters_nodes_and_submits_nothing(ray_head: RayHead, tmp_path: Path) -> None:
    """The cluster has 4 CPUs (this machine may have another count): with ``cpu_workers: auto``
    the plan is the cluster's, read from its dashboard, and what would be submitted is printed;
    nothing is. Without ``--backend ray`` the same line plans the same way (an address means a
    Ray cluster)."""
    before = {j["submission_id"] for j in _jobs(ray_head)}
    args = ("jobs/matmul_scaling.yaml", "--dry-run", "--address", ray_head.address, "--out", str(tmp_path), "--set", "resources.cpu_workers=auto")
    for extra in (("--backend", "ray"), ()):
        run = launch(*args, *extra, "--set", "scaling=null", env={**ray_head.env, "COLUMNS": "200"})
        assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
        assert f"$ ray job submit --address {ray_head.address} --submission-id matmul_scaling-<run-id>" in run.stdout, run.stdout
        assert "placement group matmul_scaling-world4: 4 x {'CPU': 1.0}" in run.stdout and "planned on the cluster's nodes" in run.stdout
    too_big = launch(*args, "--set", "scaling.workers=[5]", env=ray_head.env)
    assert too_big.returncode == 2 and "no world size of [5] fits: world size 5 needs 5 worker slot(s) per node but resources.cpu_workers gives 4" in too_big.stderr, too_big.stderr
    wrong = launch(*args, "--backend", "torchrun", env=ray_head.env)
    assert wrong.returncode == 2 and "--address: submits to a Ray cluster, but the backend is torchrun" in wrong.stderr, wrong.stderr
    assert {j["submission_id"] for j in _jobs(ray_head)} == before, "a job was submitted"
    assert not any(tmp_path.iterdir())


# --- runs of a sleeping job on the cluster, ended from outside ---------------------------------------


@dataclass
class SleepingRun:
    """``launch JOB --address`` of a job whose one rank prints its pid and sleeps for 5 minutes."""

    name: str
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text()


def _start_sleeping(head: RayHead, tmp: Path, name: str) -> SleepingRun:
    # the job's own code lives in its directory (the working dir Ray ships), as a user's would
    shutil.copy(REPO / "tests" / "integration" / "faulty.py", tmp / "faulty_job.py")
    spec = tmp / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\nentrypoint: faulty_job:run\nparams: {{fault: sleep, sleep_s: 300}}\nbackend: ray\n"
        "resources: {cpu_workers: 1}\ntimeouts: {rendezvous_s: 60, run_s: 600}\n"
    )
    log = tmp / "launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", str(spec), "--address", head.address, "--out", str(tmp / "out")],
                                cwd=REPO, env={**head.env, "PYTHONPATH": pythonpath(REPO, tmp)}, stdout=out, stderr=subprocess.STDOUT)
    return SleepingRun(name, proc, log)


@pytest.fixture(scope="module")
def sleeping_runs(ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SleepingRun]]:
    runs = {key: _start_sleeping(ray_head, tmp_path_factory.mktemp(key), f"sleepy-{key.lower()}") for key in ("stop", "SIGTERM", "SIGINT")}
    try:
        yield runs
    finally:  # a run whose test did not end it: SIGTERM makes launch stop its job, then it is killed
        for run in runs.values():
            if run.proc.poll() is None:
                run.proc.terminate()
        for run in runs.values():
            try:
                run.proc.wait(60)
            except subprocess.TimeoutExpired:
                run.proc.kill()
                run.proc.wait()


def _running(head: RayHead, run: SleepingRun) -> tuple[dict, int]:
    """The run's Ray job once its rank runs, and that rank's pid."""
    deadline, job, rank_pid = time.monotonic() + 120, None, None
    while time.monotonic() < deadline and rank_pid is None and run.proc.poll() is None:
        mine = [j for j in _jobs(head) if (j.get("submission_id") or "").startswith(f"{run.name}-")]
        if mine:
            [job] = mine
            assert job["status"] in ("PENDING", "RUNNING"), job.get("message")
            found = re.search(r"faulty: rank 0 pid (\d+)", head.rest(f"/api/jobs/{job['submission_id']}/logs")["logs"])
            rank_pid = int(found.group(1)) if found else None
        if rank_pid is None:
            time.sleep(0.5)
    assert job is not None and rank_pid is not None, f"the job never ran: {run.text()[-3000:]}"
    return job, rank_pid


def test_launch_stop_ends_a_running_cluster_job(ray_head: RayHead, sleeping_runs: dict[str, SleepingRun]) -> None:
    run = sleeping_runs["stop"]
    job, _ = _running(ray_head, run)
    job_id = job["submission_id"]
    logs = launch("logs", job_id, "--address", ray_head.address, env=ray_head.env)
    assert logs.returncode == 0 and "faulty: rank 0" in logs.stdout, logs.stderr
    stop = launch("stop", job_id, "--address", ray_head.address, env=ray_head.env)
    assert stop.returncode == 0, stop.stderr
    assert "STOPPED" in stop.stdout
    assert run.proc.wait(60) != 0
    assert [j["status"] for j in _jobs(ray_head) if j["submission_id"] == job_id] == ["STOPPED"]
    assert not ray_head.live_actors(f"{run.name}-rank")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launch_address_stops_the_submitted_job(ray_head: RayHead, sleeping_runs: dict[str, SleepingRun], sig: signal.Signals) -> None:
    run = sleeping_runs[sig.name]
    job, rank_pid = _running(ray_head, run)
    job_id = job["submission_id"]
    driver_pid = int(next(j for j in _jobs(ray_head) if j["submission_id"] == job_id)["driver_info"]["pid"])
    assert pid_alive(rank_pid) and pid_alive(driver_pid)

    run.proc.send_signal(sig)
    code = run.proc.wait(120)
    text = run.text()
    assert code == 130, text[-3000:]
    assert f"stopping Ray job {job_id}" in text, text[-3000:]
    assert [j["status"] for j in _jobs(ray_head) if j["submission_id"] == job_id] == ["STOPPED"]
    assert wait_gone([driver_pid, rank_pid], 60) == [], "a process of the stopped Ray job is still alive"
    assert not ray_head.live_actors(f"{run.name}-rank")
