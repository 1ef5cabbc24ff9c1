"""What a Ray run may touch and how it ends: an embedded run kills only Ray's own processes (never
the caller's other subprocesses), a signal to ``launch --address`` stops the submitted job, and
``resources.nodes > 1`` is refused before anything is submitted."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.procutil import pid_alive, wait_gone
from tests.ray.conftest import REPO, RayHead, descendants, launch, wait_no_orphans

pytestmark = pytest.mark.slow
SMALL = ["params.sizes=[64]", "params.iters=3", "params.warmup=1", "scaling.workers=[1]"]


def test_embedded_run_in_process_spares_the_callers_other_processes(tmp_path: Path) -> None:
    """A notebook or a service calling run_job keeps its own subprocesses; Ray's are all gone."""
    import launcher

    bystander = subprocess.Popen(["sleep", "300"])
    try:
        baseline = descendants(os.getpid())
        assert bystander.pid in baseline
        result = launcher.run_job(REPO / "jobs" / "matmul_scaling.yaml", overrides=SMALL, backend="ray", out=tmp_path)
        assert result.status == "succeeded"
        assert bystander.poll() is None and pid_alive(bystander.pid), "the caller's own subprocess was killed"
        assert wait_no_orphans(baseline) == [], "a Ray process of the embedded run is still alive"
    finally:
        bystander.kill()
        bystander.wait()


def _jobs(head: RayHead) -> list[dict]:
    return head.rest("/api/jobs/")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launch_address_stops_the_submitted_job(ray_head: RayHead, tmp_path: Path, sig: signal.Signals) -> None:
    shutil.copy(REPO / "tests" / "integration" / "faulty.py", tmp_path / "faulty_job.py")
    spec = tmp_path / "sleepy.yaml"
    spec.write_text(
        "name: sleepy\nentrypoint: faulty_job:run\nparams: {fault: sleep, sleep_s: 300}\nbackend: ray\n"
        "resources: {cpu_workers: 1}\ntimeouts: {rendezvous_s: 60, run_s: 600}\n"
    )
    before = {j["submission_id"] for j in _jobs(ray_head)}
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", str(spec), "--address", ray_head.address, "--out", str(tmp_path / "out")],
                                cwd=REPO, env={**ray_head.env, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, job, rank_pid = time.monotonic() + 120, None, None
        while time.monotonic() < deadline and rank_pid is None and proc.poll() is None:
            new = [j for j in _jobs(ray_head) if j["submission_id"] not in before]
            if new:
                job = new[0]
                found = re.search(r"faulty: rank 0 pid (\d+)", ray_head.rest(f"/api/jobs/{job['submission_id']}/logs")["logs"])
                rank_pid = int(found.group(1)) if found else None
            time.sleep(0.5)
        assert job is not None and rank_pid is not None, f"the job never ran: {log.read_text()[-3000:]}"
        job_id = job["submission_id"]
        driver_pid = int(next(j for j in _jobs(ray_head) if j["submission_id"] == job_id)["driver_info"]["pid"])
        assert pid_alive(rank_pid) and pid_alive(driver_pid)

        proc.send_signal(sig)
        code = proc.wait(120)
        text = log.read_text()
        assert code == 130, text[-3000:]
        assert f"stopping Ray job {job_id}" in text, text[-3000:]
        assert [j["status"] for j in _jobs(ray_head) if j["submission_id"] == job_id] == ["STOPPED"]
        assert wait_gone([driver_pid, rank_pid], 60) == [], "a process of the stopped Ray job is still alive"
        assert not ray_head.live_actors("sleepy-rank")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
