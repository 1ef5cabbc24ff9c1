"""Issue 37 on Slurm: ``launch JOB --backend slurm --detach`` returns with the job id;
``launch attach JOB_ID`` follows the batch job as a foreground run does (rank lines, the
launcher's lines, the summary; exit 0); ``launch attach RUN_ID --backend slurm`` finds the job by
its run id; Ctrl-C detaches (exit 0, the job goes on) and ``launch stop JOB_ID`` cancels it. Every
command is run as a user types it, against the real rig (slurmctld and two slurmd nodes).

The job steps until the test creates its release file, so "still running" is never a race with a
job that ends by itself. Time limits here are hang guards only; every ``launch`` the test starts
is ended by pid and every job it submitted cancelled by id."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tests.conftest import REPO
from tests.slurm.slurmrig import SlurmRig

pytestmark = pytest.mark.slow

HOLDER = (REPO / "tests" / "holder_job.py").read_text()  # the job's own code, shipped with it


class User:
    """A user's shell on the rig: ``launch`` commands, and what they submitted (cancelled at the end)."""

    def __init__(self, rig: SlurmRig, tmp_path: Path) -> None:
        self.rig, self.tmp_path = rig, tmp_path
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        (job_dir / "holder_job.py").write_text(HOLDER)
        self.env = {**rig.env, "PYTHONPATH": f"{REPO}:{job_dir}", "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
        self.spec = job_dir / "holder.yaml"
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self.job_ids: list[str] = []

    def write_spec(self, release: Path) -> Path:
        spec = {
            "name": "holder", "entrypoint": "holder_job:run", "backend": "slurm", "params": {"release": str(release)},
            "resources": {"nodes": 2, "cpu_workers": 1}, "env": {"PYTHONPATH": self.env["PYTHONPATH"]},
            "timeouts": {"rendezvous_s": 60, "run_s": 600},
        }  # fmt: skip
        self.spec.write_text(yaml.safe_dump(spec, sort_keys=False))
        return self.spec

    def launch(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def start(self, *args: str) -> tuple[subprocess.Popen, Path]:
        log = self.tmp_path / f"launch-{len(self.procs)}.log"
        with open(log, "wb") as handle:
            proc = subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=REPO, env=self.env, stdout=handle, stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc, log

    def detach(self, release: Path, out: Path) -> tuple[str, str]:
        """``launch holder.yaml --detach``: the Slurm job id and the run id."""
        done = self.launch(str(self.write_spec(release)), "--detach", "--out", str(out))
        assert done.returncode == 0, done.stdout + done.stderr
        found = re.search(r"^Slurm job (\d+): launch status \1 .*follow it: launch attach \1 ", done.stdout, re.MULTILINE)
        assert found, done.stdout + done.stderr
        self.job_ids.append(found.group(1))
        [run_dir] = out.glob("holder/*")
        return found.group(1), run_dir.name

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for job_id in self.job_ids:
            self.rig.run(["scancel", job_id])


@pytest.fixture
def user(slurm_rig: SlurmRig, tmp_path: Path) -> Iterator[User]:
    who = User(slurm_rig, tmp_path)
    try:
        yield who
    finally:
        who.close()
    slurm_rig.wait_for("an empty queue", lambda: not slurm_rig.run(["squeue", "-h"], check=True).stdout.strip(), 120, 0.2)  # a hang guard
    assert slurm_rig.wait_clean() == {}, slurm_rig.describe(slurm_rig.leftovers())
    slurm_rig.wait_idle(timeout_s=30)


def wait_for(what: str, log: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s  # a hang guard
    while what not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {what!r} (exit {proc.poll()}):\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)


def status(user: User, job_id: str) -> str:
    done = user.launch("status", job_id, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return str(json.loads(done.stdout)["status"])


def test_detach_then_attach_follows_the_job_to_its_summary(user: User, tmp_path: Path) -> None:
    out, release = tmp_path / "out", tmp_path / "release"
    job_id, run_id = user.detach(release, out)
    attach, log = user.start("attach", job_id)
    wait_for("holder: rank 1 step", log, attach)  # live: the job runs on while attach shows it
    assert status(user, job_id) == "RUNNING"
    release.touch()
    assert attach.wait(180) == 0, log.read_text()
    shown = log.read_text()
    assert f"attached to Slurm job {job_id}" in shown and "▶ holder: world size 2 on cpu (slurm)" in shown, shown[-4000:]
    assert re.search(r"^n2:1 holder: rank 1 step", shown, re.MULTILINE) and "succeeded" in shown, shown[-4000:]
    assert "@gpulaunch" not in shown and "Traceback" not in shown, shown[-4000:]
    result = json.loads((out / "holder" / run_id / "result.json").read_text())
    assert (result["status"], result["run_id"], result["slurm"]["job_id"]) == ("succeeded", run_id, job_id)

    again = user.launch("attach", job_id)  # once it has ended: its summary and exit code at once
    assert again.returncode == 0 and "succeeded" in again.stdout, again.stdout + again.stderr


def test_attach_by_run_id_ctrl_c_detaches_and_launch_stop_cancels(user: User, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job_id, run_id = user.detach(tmp_path / "release", out)
    attach, log = user.start("attach", run_id, "--backend", "slurm")
    wait_for("holder: rank 0 step", log, attach)
    attach.send_signal(signal.SIGINT)
    assert attach.wait(60) == 0, log.read_text()
    shown = log.read_text()
    assert f"detached: Slurm job {job_id} goes on (launch attach {job_id} follows it again, launch stop {job_id} stops it)" in shown, shown
    assert "Traceback" not in shown, shown
    time.sleep(1.0)  # were the job cancelled by the detach, Slurm would say so by now
    assert status(user, job_id) == "RUNNING"
    stopped = user.launch("stop", job_id)
    assert (stopped.returncode, stopped.stdout) == (0, f"{job_id}: CANCELLED\n"), stopped.stdout + stopped.stderr
    assert json.loads((out / "holder" / run_id / "result.json").read_text())["status"] == "interrupted"
