"""Preemption with a deadline on a real Slurm cluster (the rig, with a requeued job starting again
within seconds): ``ddp_train`` on two nodes, one rank each, checkpointing every epoch (4 steps of
24). Slurm's warning before the time limit (``--signal=B:USR1@N``: here ``scancel --batch
--signal=USR1``, what slurmctld sends at that time) has the ranks save at their next step and
return, the batch script requeue the job, and the next allocation resume the run; an admin's
``scontrol requeue`` (SIGTERM to every process, then the job back in the queue) resumes it the same
way. Either way ``launch`` follows the job through the queue to its end: exit 0, a result with one
resume, the same model bit for bit as a run never interrupted on this rig, and Slurm's own record
COMPLETED with one restart. A requeued job stopped (Ctrl-C) before it runs again ends CANCELLED,
the run interrupted."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.jobs.conftest import TINY_TRAIN
from tests.slurm.slurmrig import SlurmRig
from tests.slurm.test_backend import Launch, launcher, result_of, slurm_state  # noqa: F401 - launcher: the fixture

pytestmark = pytest.mark.slow

SETTINGS = [
    "entrypoint=tests.jobs.killed_train:run", "params.epochs=6", "scaling.workers=[2]", *TINY_TRAIN, "params.kill_at=-1",
    "resources.nodes=2", "resources.cpu_workers=1", f"env={{PYTHONPATH: {REPO}}}", "timeouts.run_s=300", "preemption.grace_s=20",
]  # fmt: skip
STEPS = 24  # 6 epochs of 4 steps
SLOW = "params.step_sleep_s=0.3"  # long enough to be stopped mid-way


def ddp_train(tmp_path: Path, *extra: str) -> list[str]:
    args = ["jobs/ddp_train.yaml", "--backend", "slurm", "--quiet"]
    for item in (*SETTINGS, f"params.marker={tmp_path / 'unused'}", *extra):
        args += ["--set", item]
    return args


@pytest.fixture(scope="module")
def uninterrupted(slurm_requeue_rig: SlurmRig, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The final model of a run never interrupted, on this rig: every rank's digest."""
    out = tmp_path_factory.mktemp("baseline")
    run = Launch(slurm_requeue_rig, out / "runs", *ddp_train(out))
    try:
        assert run.wait(240) == 0, run.output()
        result = result_of(run.run_dir())
    finally:
        run.close()
        for record in run.out.glob("*/*/slurm.json"):  # a run that went wrong leaves no job behind
            slurm_requeue_rig.run(["scancel", json.loads(record.read_text()).get("job_id") or "0"])
    assert result["status"] == "succeeded" and result["slurm"]["restarts"] == 0, result.get("failure")
    digests = {r["result"]["model_sha256"] for r in result["ranks"]}
    assert len(digests) == 1
    return digests


def wait_for_steps(run: Launch, steps: int, timeout_s: float = 120) -> None:
    """Until rank 0's beacon has counted ``steps`` (the run well under way, a checkpoint saved)."""
    beacon = run.run_dir() / "world2" / "progress" / "rank0.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(beacon.read_text()).get("steps", 0) >= steps:
                return
        except (OSError, ValueError):
            pass
        if run.proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"rank 0 did not reach step {steps}:\n{run.output()}")


def assert_resumed_once(rig: SlurmRig, run: Launch, job_id: str, uninterrupted: set[str], *, at_least: int) -> dict[str, Any]:
    """launch's exit 0, the run succeeded in one resume from a checkpoint of step ``at_least`` or
    later, the same model as the uninterrupted run, and Slurm's record: COMPLETED, one restart."""
    assert run.wait(240) == 0, run.output()
    assert (slurm_state(rig, job_id), rig.job(job_id)["Restarts"]) == ("COMPLETED", "1"), rig.job(job_id)
    run_dir = run.run_dir()
    result = result_of(run_dir)
    assert (result["status"], result["slurm"]["state"], result["slurm"]["restarts"]) == ("succeeded", "COMPLETED", 1), result.get("failure")
    (stage,) = result["stages"]
    before, attempt = stage["attempts"]  # the first allocation's, kept in the record, then this one's
    assert before["status"] != "succeeded" and before["ended_at"] <= attempt["started_at"], before
    assert (before["attempt"], attempt["attempt"]) == (0, 1)
    resumed = attempt["resumed_step"]
    assert at_least <= resumed < STEPS and attempt["status"] == "succeeded", attempt
    assert all(r["result"]["start_step"] == resumed and r["result"]["steps"] == STEPS for r in result["ranks"]), result["ranks"]
    assert {r["result"]["model_sha256"] for r in result["ranks"]} == uninterrupted  # bit for bit
    assert (run_dir / "world2" / "resumed1" / "reports").is_dir()  # the first allocation's attempt, set aside
    out = run.output()
    assert f"Slurm job {job_id} was requeued (restart 1)" in out and f"restart 1): resuming the run in {run_dir}" in out, out
    assert f"the job resumed from the checkpoint of step {resumed}" in out, out
    assert (run_dir / f"slurm-{job_id}.out").read_text().count('"event":"stage"') == 2  # both allocations' output kept
    return result


def test_slurms_warning_saves_requeues_and_the_next_allocation_resumes(slurm_requeue_rig: SlurmRig, launcher, tmp_path: Path, uninterrupted):  # noqa: F811
    rig = slurm_requeue_rig
    run = launcher(rig, *ddp_train(tmp_path, SLOW))
    job_id = run.job_id()
    wait_for_steps(run, 6)
    t0 = time.monotonic()
    rig.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)  # what slurmctld sends N s before the time limit
    result = assert_resumed_once(rig, run, job_id, uninterrupted, at_least=7)  # saved at the step after the notice
    print(f"warned at step >= 6 -> saved at {result['stages'][0]['attempts'][-1]['resumed_step']}, requeued, resumed, "
          f"launch done after {time.monotonic() - t0:.1f}s")  # fmt: skip
    assert "stop notice sent to every rank: 20s" in run.output(), run.output()
    said = (run.run_dir() / f"slurm-{job_id}.out").read_text()  # the batch script's own lines (launch --quiet shows none)
    assert "gpulaunch: SIGUSR1 from Slurm (time limit in 50 s, or preemption)" in said, said
    assert f"gpulaunch: Slurm job {job_id} requeued: the next allocation resumes the run from its last checkpoint" in said, said
    set_aside = json.loads((run.run_dir() / "world2" / "resumed1" / "reports" / "rank1.json").read_text())
    assert set_aside["result"]["stopped_early"] and set_aside["stop_notice"], set_aside


def test_an_admins_scontrol_requeue_ends_in_a_finished_run_with_one_resume(slurm_requeue_rig: SlurmRig, launcher, tmp_path: Path, uninterrupted):  # noqa: F811
    """Slurm's SIGTERM to every process of the job (the launcher, the ranks) is not a stop from
    launch: the batch script neither cancels nor requeues the job; Slurm requeues it."""
    rig = slurm_requeue_rig
    run = launcher(rig, *ddp_train(tmp_path, SLOW))
    job_id = run.job_id()
    wait_for_steps(run, 6)
    t0 = time.monotonic()
    rig.run(["scontrol", "requeue", job_id], check=True)
    assert_resumed_once(rig, run, job_id, uninterrupted, at_least=4)  # at least the checkpoint of epoch 1
    print(f"scontrol requeue at step >= 6 -> launch done after {time.monotonic() - t0:.1f}s")
    said = (run.run_dir() / f"slurm-{job_id}.out").read_text()
    assert "gpulaunch:" not in said, said  # the script neither cancelled nor requeued it: Slurm did


def test_ctrl_c_while_the_requeued_job_waits_in_the_queue_cancels_it(slurm_requeue_rig: SlurmRig, launcher, tmp_path: Path):  # noqa: F811
    """Requeued, then stopped before it ran again: CANCELLED in Slurm's record, and interrupted in
    launch's, whatever the allocation before wrote (Slurm's SIGTERM cut that one short)."""
    rig = slurm_requeue_rig
    run = launcher(rig, *ddp_train(tmp_path, SLOW))
    job_id = run.job_id()
    wait_for_steps(run, 2)
    rig.run(["scontrol", "requeue", job_id], check=True)
    rig.wait_for("launch to see the requeue", lambda: f"Slurm job {job_id} was requeued (restart 1)" in run.output(), 120)  # a hang guard
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(60) == 130, run.output()
    print(f"Ctrl-C while requeued -> launch done after {time.monotonic() - t0:.1f}s")
    assert (slurm_state(rig, job_id), rig.job(job_id)["Restarts"]) == ("CANCELLED", "1")
    result = result_of(run.run_dir())
    summary = f"interrupted (SIGINT; Slurm job {job_id} cancelled while requeued, before it ran again)"
    assert (result["status"], result["failure"]["summary"], result["slurm"]["restarts"]) == ("interrupted", summary, 1), result["failure"]
    assert "resuming the run" not in run.output()  # it never ran again
