"""Runs that survive, on the Ray backend: ddp_train (gloo on the CPU, one rank per actor) saves
through ctx.checkpoint every epoch (4 steps); an actor SIGKILLed mid-run is restarted from the
last checkpoint, and a stop notice (the launcher's, reaching the job through the actor's
``signal``) makes the job save and return, ``resume_run`` finishing it; both end with the same
model, bit for bit, as a run on Ray that was never interrupted. A SIGTERM to a rank's actor (its
node going away) is the job's notice too, as in a torchrun rank.

As the backend's other tests, the runs call ``launcher.run_job`` in this process, connected as a
Ray driver to the session's head (``ray_driver``); a stop is a ``StopRequest`` set from another
thread, as ``launch``'s SIGTERM handler sets it. Every run leaves no actor, placement group or
rank process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import launcher
from launcher.control.api import resume_run
from launcher.control.runloop import StopRequest
from tests.jobs.conftest import TINY_TRAIN
from tests.ray.conftest import DRIVER, REPO, RayDriver, RayHead, assert_ray_run_left_nothing, descendants, ray_cluster, wait_no_orphans

pytestmark = pytest.mark.slow

JOB = "ddp_train"
SPEC = REPO / "jobs" / f"{JOB}.yaml"
WRAPPER = "entrypoint=tests.jobs.killed_train:run"
EPOCHS = ["params.epochs=6", "scaling.workers=[2]", *TINY_TRAIN]  # 4 steps an epoch: checkpoints at 4, 8, ... 24


class Run:
    """One ``run_job`` on the session's Ray: its result.json and its run directory."""

    def __init__(self, result: launcher.RunResult) -> None:
        self.exit_code = result.exit_code
        self.run_dir = Path(result.run_dir)
        self.result: dict[str, Any] = json.loads((self.run_dir / "result.json").read_text())

    def shas(self) -> set[str]:
        return {r["result"]["model_sha256"] for r in self.result["ranks"]}

    def pids(self) -> list[int]:
        """Every rank process of every attempt: from the reports and the beacons (a SIGKILLed
        actor wrote no report; its beacon, set aside with its attempt, names it)."""
        found = {r["pid"] for r in self.result["ranks"] if isinstance(r.get("pid"), int)}
        for path in self.run_dir.glob("world*/**/rank*.json"):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and isinstance(data.get("pid"), int):
                found.add(data["pid"])
        return sorted(found)


def _run(out: Path, *sets: str, stop: StopRequest | None = None) -> Run:
    result = launcher.run_job(SPEC, overrides=[WRAPPER, *EPOCHS, *sets], backend="ray", out=out, events=launcher.RunEvents(),
                              stop=stop, metrics=False)  # fmt: skip
    return Run(result)


def _left_nothing(head: RayHead, run: Run, baseline: set[int]) -> None:
    assert_ray_run_left_nothing(head, JOB, run.pids())
    assert wait_no_orphans(baseline) == [], "a process of the run is still alive under pytest"


@pytest.fixture(scope="module")
def uninterrupted(ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The same job, never interrupted, on the same Ray: the model every other run must end with."""
    DRIVER.connect(ray_head)
    out = tmp_path_factory.mktemp("ray-baseline")
    baseline = descendants(os.getpid())
    run = _run(out, "params.kill_at=-1", f"params.marker={out / 'unused'}")
    assert run.exit_code == 0 and run.result["status"] == "succeeded", run.result.get("failure")
    assert run.result["backend"] == "ray" and run.result["restarts"] == 0
    assert len(run.shas()) == 1
    assert all(r["result"]["start_step"] == 0 and r["result"]["steps"] == 24 for r in run.result["ranks"])
    _left_nothing(ray_head, run, baseline)
    yield run


def test_an_actor_killed_mid_run_is_replaced_in_place_and_ends_with_the_same_model(
    ray_driver: RayHead, tmp_path: Path, uninterrupted: Run
) -> None:
    """``ddp_train`` opts in to recovery in place: the driver starts a new actor for the lost
    rank, rank 0 keeps its process and sends it the state from memory, no restart."""
    baseline = descendants(os.getpid())
    run = _run(tmp_path, "params.kill_rank=1", "params.kill_at=10", f"params.marker={tmp_path / 'killed'}")
    assert run.exit_code == 0 and run.result["status"] == "succeeded", run.result.get("failure")
    assert (tmp_path / "killed").is_file()  # the fault happened
    stage = run.result["stages"][0]
    assert run.result["restarts"] == 0 and len(stage["attempts"]) == 1, stage["attempts"]  # no restart of the group
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "in_place" and recovery["dead_ranks"] == [1], recovery
    assert recovery["resumed_step"] == 10 and recovery["steps_lost"] == 0 and recovery["state_bytes"] > 0, recovery
    assert recovery["replacements"] == ["new actor"], recovery
    ranks = {r["rank"]: r for r in run.result["ranks"]}
    assert ranks[0]["result"]["start_step"] == 0 and ranks[1]["result"]["start_step"] == 10, ranks  # rank 0 kept its process
    assert all(r["result"]["steps"] == 24 for r in run.result["ranks"])
    assert run.shas() == uninterrupted.shas()  # bit for bit
    _left_nothing(ray_driver, run, baseline)


def test_an_actor_killed_mid_run_is_restarted_from_the_last_checkpoint_and_ends_with_the_same_model(
    ray_driver: RayHead, tmp_path: Path, uninterrupted: Run
) -> None:
    """The restart path, for a job that keeps it (``params.in_place=false``)."""
    baseline = descendants(os.getpid())
    run = _run(tmp_path, "params.kill_rank=1", "params.kill_at=10", f"params.marker={tmp_path / 'killed'}", "params.in_place=false")
    assert run.exit_code == 0 and run.result["status"] == "succeeded", run.result.get("failure")
    assert (tmp_path / "killed").is_file()  # the first attempt did lose rank 1's actor
    assert run.result["restarts"] == 1
    first, second = run.result["stages"][0]["attempts"]
    # a SIGKILLed actor: Ray's ActorDied, a lost rank (restart_on's default), not the job's error
    assert (first["failure_class"], first["restarted"], first["checkpoint_step"]) == ("rank_lost", True, 8), first
    assert first["cause"].startswith("rank 1 ") and "ActorDied" in first["cause"], first
    assert 0 <= first["lost_steps"] <= 2, first  # steps 9-10 were done after the checkpoint (as far as the beacons told)
    assert (second["resumed_step"], second["status"]) == (8, "succeeded"), second
    assert all(r["result"]["start_step"] == 8 and r["result"]["steps"] == 24 for r in run.result["ranks"])
    assert run.shas() == uninterrupted.shas()  # bit for bit: parameters, optimizer moments and data order restored
    _left_nothing(ray_driver, run, baseline)


def _once_at(out: Path, rank: int, steps: int, act: Callable[[dict], None], timeout_s: float = 120) -> threading.Thread:
    """A thread that calls ``act`` with ``rank``'s beacon once it counted ``steps`` (the run is
    well under way), from outside the run loop."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for path in out.glob(f"{JOB}/*/world2/progress/rank{rank}.json"):
                try:
                    beacon = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if beacon.get("steps", 0) >= steps:
                    act(beacon)
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, name="once-at", daemon=True)
    thread.start()
    return thread


def test_a_stop_notice_saves_at_the_next_step_and_resume_finishes_with_the_same_model(
    ray_driver: RayHead, tmp_path: Path, uninterrupted: Run
) -> None:
    baseline = descendants(os.getpid())
    stop = StopRequest()
    watcher = _once_at(tmp_path, 0, 6, lambda _beacon: stop.set("SIGTERM"))  # as launch's SIGTERM handler does
    run = _run(tmp_path, "params.kill_at=-1", f"params.marker={tmp_path / 'unused'}", "params.step_sleep_s=0.15", stop=stop)
    watcher.join(5)
    assert stop, "the run ended before rank 0 counted 6 steps"
    result = run.result
    failure = result["failure"]
    assert run.exit_code == 130 and result["status"] == "interrupted", failure
    assert failure["failure_class"] == "preempted", failure
    (attempt,) = result["stages"][0]["attempts"]
    saved = attempt["checkpoint_step"]
    assert saved is not None and 6 <= saved < 24 and attempt["lost_steps"] == 0, attempt  # saved where it stopped: nothing lost
    assert f"its last checkpoint is step {saved}; continue with: launch resume {run.run_dir}" in failure["summary"]
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 1]
    assert all(r["result"]["stopped_early"] for r in result["ranks"]), [r.get("result") for r in result["ranks"]]
    _left_nothing(ray_driver, run, baseline)

    resumed = Run(resume_run(run.run_dir, events=launcher.RunEvents(), metrics=False))
    assert resumed.exit_code == 0 and resumed.result["status"] == "succeeded", resumed.result.get("failure")
    assert resumed.result["run_id"] == result["run_id"] and resumed.result["backend"] == "ray"
    stopped, again = resumed.result["stages"][0]["attempts"]  # the record keeps the stopped attempt, then the resumed one
    assert stopped["checkpoint_step"] == saved and again["resumed_step"] == saved and again["status"] == "succeeded", (stopped, again)
    assert all(r["result"]["start_step"] == saved and not r["result"]["stopped_early"] for r in resumed.result["ranks"])
    assert resumed.shas() == uninterrupted.shas()
    assert (run.run_dir / "world2" / "resumed1" / "reports" / "rank0.json").is_file()  # the stopped attempt's, set aside
    _left_nothing(ray_driver, resumed, baseline)


def test_a_sigterm_to_a_ranks_actor_is_the_jobs_stop_notice(ray_driver: RayHead, tmp_path: Path) -> None:
    """Its node going away, a scheduler's signal: as in a torchrun rank, a job that reads
    ctx.should_stop saves at its next step and returns (the actor runs the rank in one of its
    threads, where the job's own handler cannot be installed: the actor's is)."""
    baseline = descendants(os.getpid())
    killed: list[int] = []

    def sigterm(beacon: dict) -> None:
        killed.append(beacon["pid"])
        os.kill(beacon["pid"], signal.SIGTERM)

    watcher = _once_at(tmp_path, 1, 6, sigterm)
    run = _run(tmp_path, "params.kill_at=-1", f"params.marker={tmp_path / 'unused'}", "params.step_sleep_s=0.15")
    watcher.join(5)
    assert killed, "the run ended before rank 1 counted 6 steps"
    result = run.result
    failure = result["failure"]
    assert run.exit_code == 130 and result["status"] == "interrupted", failure
    assert failure["failure_class"] == "preempted" and failure["summary"].startswith("stopped after a notice (SIGTERM)"), failure
    (attempt,) = result["stages"][0]["attempts"]
    assert 6 <= attempt["checkpoint_step"] < 24 and attempt["lost_steps"] == 0, attempt
    assert all(r["status"] == "ok" and r["result"]["stopped_early"] for r in result["ranks"]), result["ranks"]
    reports = [json.loads((run.run_dir / "world2" / "reports" / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert [r.get("stop_notice") for r in reports] == [None, "SIGTERM"]  # rank 1 was told; rank 0 stopped with it (the group's answer)
    _left_nothing(ray_driver, run, baseline)


@pytest.fixture
def doomed_head(driver: RayDriver) -> Iterator[RayHead]:
    """A Ray head of this test's own, this process its driver: a drained node stays drained (it
    takes no new work), so the session's head must never be the one drained."""
    with ray_cluster() as head:
        driver.connect(head)
        yield head


def test_a_node_being_drained_is_a_stop_notice_to_every_rank(doomed_head: RayHead, tmp_path: Path) -> None:
    """Ray drains the node the ranks run on (the autoscaler's preemption, a spot node's notice:
    here asked of the GCS as `ray drain-node` asks it, with a deadline): every rank is told, the
    job saves at its next step and returns, and the run ends preempted, to be resumed."""
    import ray
    from ray.core.generated import autoscaler_pb2

    ray_driver = doomed_head
    baseline = descendants(os.getpid())
    answers: list[tuple[bool, str]] = []

    def drain(_beacon: dict) -> None:
        gcs = ray._raylet.GcsClient(address=ray_driver.gcs_address)
        deadline_ms = int(time.time() * 1000) + 60_000
        node = ray.get_runtime_context().get_node_id()  # the one node of the session's head: the ranks' too
        answers.append(gcs.drain_node(node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "test: preempted", deadline_ms))

    watcher = _once_at(tmp_path, 1, 6, drain)
    try:
        run = _run(tmp_path, "params.kill_at=-1", f"params.marker={tmp_path / 'unused'}", "params.step_sleep_s=0.15")
    finally:
        watcher.join(5)
    assert answers and answers[0][0], answers  # the GCS took the drain
    result = run.result
    failure = result["failure"]
    assert run.exit_code == 130 and failure["failure_class"] == "preempted", failure
    (attempt,) = result["stages"][0]["attempts"]
    assert 6 <= attempt["checkpoint_step"] < 24 and attempt["lost_steps"] == 0, attempt
    assert all(r["result"]["stopped_early"] for r in result["ranks"]), result["ranks"]
    log = "".join(p.read_text() for p in (run.run_dir / "world2" / "logs").glob("*.log"))
    assert "Ray is draining node" in log and "stop notice to every rank" in log, log[-2000:]
    _left_nothing(ray_driver, run, baseline)
