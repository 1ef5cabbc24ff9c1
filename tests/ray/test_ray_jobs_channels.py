"""A run submitted with ``launch JOB --address`` to a real Ray head, end to end through the CLI:

- what it ships: the spec sits beside a live unix socket (as a running Ray's session dir has) and
  a 60 MiB file. The socket is skipped and named; the large file is refused in one line (exit 2,
  no traceback, nothing submitted, no run directory), and goes unshipped once a .gitignore lists it;
- one id for the run: the Ray job's submission id is ``<job>-<run id>`` (its metadata's run_id the
  same), the run directory ``<job>/<run id>``, result.json's run_id that id, and ``launch status``
  takes the run id;
- the job's log is for people: no line of the remote-run wire (it has a file of its own), its rank
  lines and the outcome all the same; the console has none of Ray's ``Uploading package`` lines,
  which are in the run directory's ``ray-submit.log`` instead.

(The live progress over the wire and the /metrics run_id: test_ray_jobs_progress.py.)"""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path
from typing import Iterator

import pytest

from tests.ray.conftest import RayHead, launch
from tests.integration.faultkit import pythonpath

pytestmark = pytest.mark.slow

LISTER = '''
import os
import time


def run(ctx):
    """Says what its working directory holds, then steps for params.seconds."""
    if ctx.rank == 0:
        print(f"lister: working dir holds {sorted(os.listdir('.'))}", flush=True)
    end = time.monotonic() + float(ctx.param("seconds"))
    while time.monotonic() < end:
        time.sleep(0.05)
        ctx.metrics.step()
    print(f"lister: rank {ctx.rank} done", flush=True)
    return {}
'''


@contextlib.contextmanager
def listening_socket(path: Path) -> Iterator[None]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        sock.listen(1)
        yield


def test_the_wire_file_goes_beside_the_driver_log_and_nowhere_else(tmp_path: Path) -> None:
    """Inside a Ray job the driver's output is Ray's job-driver-<id>.log: the wire goes beside it;
    where the output is anything else (a pipe, another file) there is no wire file (the wire then
    goes into the output, as a Slurm job's does)."""
    import os

    from launcher.backends.ray_jobs.wirefile import driver_wire_path, wire_file_name

    with open(tmp_path / "job-driver-lister-20261126-003832-adbd98.log", "w") as log, open(tmp_path / "other.log", "w") as other:
        assert driver_wire_path(log.fileno()) == tmp_path / wire_file_name("lister-20261126-003832-adbd98")
        assert driver_wire_path(other.fileno()) is None
    read, write = os.pipe()
    try:
        assert driver_wire_path(write) is None
    finally:
        os.close(read)
        os.close(write)


def _submission_ids(head: RayHead) -> set[str]:
    return {j["submission_id"] for j in head.rest("/api/jobs/")}


def test_a_cli_run_ships_what_its_job_needs_keeps_its_log_for_people_and_has_one_id(ray_head: RayHead, tmp_path: Path) -> None:
    job_dir, out = tmp_path / "job", tmp_path / "out"
    job_dir.mkdir()
    (job_dir / "lister_job.py").write_text(LISTER)
    spec = job_dir / "lister.yaml"
    spec.write_text("name: lister\nentrypoint: lister_job:run\nparams: {seconds: 2}\nbackend: ray\n"
                    "resources: {cpu_workers: 2}\ntimeouts: {rendezvous_s: 60, run_s: 300}\n")  # fmt: skip
    with open(job_dir / "big.bin", "wb") as handle:
        handle.truncate(60 * 1024**2)
    env = {**ray_head.env, "PYTHONPATH": pythonpath(Path(__file__).resolve().parents[2], job_dir), "COLUMNS": "300"}
    args = (str(spec), "--address", ray_head.address, "--out", str(out))
    with listening_socket(job_dir / "ray.sock"):
        before = _submission_ids(ray_head)
        refused = launch(*args, env=env)
        assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
        assert refused.stderr.startswith("error: ") and refused.stderr.count("\n") == 1, refused.stderr
        assert "Traceback" not in refused.stdout + refused.stderr and "shutil.Error" not in refused.stderr
        assert f"the Ray job's working directory {job_dir} is 60.0 MiB, over ray.working_dir_max_mb (50.0 MiB)" in refused.stderr
        assert "largest: big.bin 60.0 MiB" in refused.stderr and "ray.excludes" in refused.stderr and "ray.working_dir" in refused.stderr
        assert _submission_ids(ray_head) == before, "a job was submitted"
        assert not out.exists() or not any(out.rglob("*")), "a run directory was made"

        (job_dir / ".gitignore").write_text("big.bin\n")
        run = launch(*args, env=env)
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-5000:]
    assert "Uploading package" not in console and "Creating a file package" not in console, console[-5000:]
    assert "@gpulaunch" not in console and "Traceback" not in console
    assert "skipped 1 that are not regular files (or cannot be read): ray.sock" in console, console[-5000:]

    # one id: the Ray job, the run directory, result.json, the job's metadata; launch status takes it
    [job_id] = [line.split()[4] for line in run.stdout.splitlines() if line.startswith("launcher: submitted Ray job ")]
    [run_dir] = (out / "lister").iterdir()
    run_id = run_dir.name
    assert job_id == f"lister-{run_id}"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "succeeded" and result["run_id"] == run_id and result["run_dir"] == str(run_dir)
    [job] = [j for j in ray_head.rest("/api/jobs/") if j["submission_id"] == job_id]
    assert job["metadata"]["run_id"] == run_id and job["status"] == "SUCCEEDED"
    status = launch("status", run_id, "--address", ray_head.address, env=ray_head.env)
    assert status.returncode == 0 and status.stdout.startswith(f"{job_id}: SUCCEEDED"), status.stdout + status.stderr

    # Ray's own lines went to the run directory, not the console
    assert "Uploading package" in (run_dir / "ray-submit.log").read_text()

    # the job's log is for people: rank lines and the outcome, no wire line, no bundle
    log = ray_head.rest(f"/api/jobs/{job_id}/logs")["logs"]
    assert "@gpulaunch" not in log, log[-3000:]
    assert "lister: rank 0 done" in log and "lister: rank 1 done" in log and "lister: succeeded" in log, log[-3000:]
    [holds] = [line for line in log.splitlines() if "lister: working dir holds" in line]
    assert "lister_job.py" in holds and ".gitignore" in holds and "big.bin" not in holds and "ray.sock" not in holds, holds
    logs = launch("logs", job_id, "--address", ray_head.address, env=ray_head.env)
    assert logs.returncode == 0 and "lister: rank 1 done" in logs.stdout and "@gpulaunch" not in logs.stdout, logs.stderr
