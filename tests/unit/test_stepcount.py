"""Each rank's step counter (``launcher.runtime.stepcount``): an 8-byte shared mapping that
``ctx.metrics.step()`` stores into, read by its host once the rank is gone, however it died; the
beacon it settles; and the counts the launcher gives the reports of ranks that wrote none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher.protocol import HOST_LOST, RankProgress, StagePaths
from launcher.runtime.stepcount import StepCounter, counter_path, read_steps, settle
from tests.conftest import REPO

# ranks' recorders with their counters, one per (path, steps) pair: each counts its steps, they
# say so, then the process dies as told (one process for every count: a torch import is 1.5 s)
_WRITER = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from launcher.runtime.metrics import MetricsRecorder
    from launcher.runtime.stepcount import StepCounter

    how, pairs = sys.argv[1], sys.argv[2:]
    recorders = []
    for path, steps in zip(pairs[::2], pairs[1::2]):
        recorder = MetricsRecorder(torch.device("cpu"), step_counter=StepCounter.create(path))
        for _ in range(int(steps)):
            recorder.step()
        recorders.append(recorder)
    if how == "self":
        os.kill(os.getpid(), signal.SIGKILL)  # stopped in silence right after a known step
    print("stepped", *(recorder.steps for recorder in recorders), flush=True)
    time.sleep(3600)  # until the test SIGKILLs it
    """
)


def _writer(how: str, counts: dict[Path, int]) -> subprocess.Popen:
    pairs = [str(arg) for path, steps in counts.items() for arg in (path, steps)]
    return subprocess.Popen([sys.executable, "-c", _WRITER, how, *pairs], cwd=REPO, stdout=subprocess.PIPE, text=True)


def test_a_new_counter_reads_zero_and_then_what_was_stored(tmp_path):
    path = tmp_path / "progress" / "rank0.steps"
    path.parent.mkdir()
    path.write_bytes((99).to_bytes(8, sys.byteorder))  # an earlier attempt's
    counter = StepCounter.create(path)
    assert counter is not None and read_steps(path) == 0
    counter.store(41)
    assert read_steps(path) == 41 and path.stat().st_size == 8
    assert read_steps(tmp_path / "none.steps") is None
    (tmp_path / "short.steps").write_bytes(b"\x01\x02")
    assert read_steps(tmp_path / "short.steps") is None


def test_a_counter_that_cannot_be_made_is_none(tmp_path):
    (tmp_path / "file").write_text("")
    assert StepCounter.create(tmp_path / "file" / "rank0.steps") is None  # its folder is a file


def test_the_count_survives_a_writer_sigkilled_mid_run(tmp_path):
    counts = {tmp_path / f"rank{rank}.steps": steps for rank, steps in enumerate([1, 1234, 100_003])}
    proc = _writer("wait", counts)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["stepped", *map(str, counts.values())]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert {path: read_steps(path) for path in counts} == counts


def test_the_count_survives_a_writer_that_sigkills_itself_right_after_a_step(tmp_path):
    path = tmp_path / "rank0.steps"
    proc = _writer("self", {path: 777})
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert read_steps(path) == 777


def test_optimizer_steps_of_a_job_that_counts_none_go_into_the_counter_as_the_beacon_counts_them(tmp_path):
    torch = pytest.importorskip("torch")
    from launcher.runtime.metrics import MetricsRecorder

    path = tmp_path / "rank0.steps"
    recorder = MetricsRecorder(torch.device("cpu"), step_counter=StepCounter.create(path))
    for _ in range(3):  # a torchrun script's DDP optimizer: what install_ddp_timing's hook calls
        recorder.work_clock.count_optimizer_step()
    assert read_steps(path) == 3 == (recorder.steps or recorder.work_clock.optimizer_steps)
    recorder.step()  # the job counts itself from here on: its count wins, as in the beacon
    recorder.work_clock.count_optimizer_step()
    assert read_steps(path) == 1 == (recorder.steps or recorder.work_clock.optimizer_steps)
    bare = MetricsRecorder(torch.device("cpu"))  # no counter file: counts all the same
    bare.step()
    assert bare.steps == 1


def _dead_pid() -> tuple[int, int]:
    """A pid and start time of a process that is gone."""
    from launcher.procutil import process_start_ticks

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    ticks = process_start_ticks(proc.pid)
    proc.kill()
    proc.wait()
    assert ticks is not None
    return proc.pid, ticks


def test_settle_gives_a_gone_ranks_beacon_its_counters_count_and_leaves_the_rest(tmp_path):
    from launcher.procutil import process_start_ticks, write_json_atomic

    paths = StagePaths(tmp_path)
    pid, ticks = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        live_ticks = process_start_ticks(live.pid)
        beacons = {
            0: {"pid": pid, "pid_start": ticks, "phase": "running", "steps": 9, "t": 100.0, "ckpt_step": 8, "ckpt_at": 8},  # gone, behind
            1: {"pid": pid, "pid_start": ticks, "phase": "running", "steps": 12, "t": 100.0},  # its own last beacon said it
            2: {"pid": live.pid, "pid_start": live_ticks, "phase": "running", "steps": 3, "t": 100.0},  # still counting
            3: {"pid": pid, "pid_start": ticks, "phase": "importing", "steps": 0, "t": 100.0},  # no counter: stopped before it made one
        }
        counts = {0: 12, 1: 12, 2: 5}
        for rank, beacon in beacons.items():
            write_json_atomic(paths.progress(rank), beacon)
        for rank, steps in counts.items():
            counter = StepCounter.create(counter_path(paths, rank))
            assert counter is not None
            counter.store(steps)
            del counter
        assert settle(paths, range(5)) == {0: 12}  # rank 4 has neither beacon nor counter
        after = {rank: json.loads(paths.progress(rank).read_text()) for rank in beacons}
        assert after[0]["steps"] == 12 and after[0]["t"] > 100.0 and after[0]["ckpt_at"] == 8 and after[0]["phase"] == "running"
        assert [after[r] for r in (1, 2, 3)] == [beacons[r] for r in (1, 2, 3)]
        assert RankProgress.from_dict(after[0]).steps == 12
        assert settle(paths, range(5)) == {}  # once is enough
    finally:
        live.kill()
        live.wait()


def _state(world: int = 2):
    from launcher.control.planning import plan_stage
    from launcher.control.stagestate import StageState
    from launcher.spec.model import load_job
    from tests.unit.test_runloop import NODE

    job = load_job(REPO / "jobs" / "ddp_train.yaml", [f"resources.cpu_workers={world}"])
    return StageState(plan_stage(job, [NODE], world, "cpu", run_dir=Path("/tmp/unused-run"), master_port=1, backend=None), 1000.0)


def test_a_silent_ranks_settled_beacon_is_its_count_in_the_record_and_how_far_the_attempt_got():
    from launcher.control.restarts import AttemptProgress
    from launcher.stage.events import RankBeacon

    state = _state()
    state.apply([RankBeacon(0, RankProgress(phase="running", steps=7, t=1001.0, ckpt_step=8, ckpt_at=8)),
                 RankBeacon(1, RankProgress(phase="running", steps=7, t=1001.0))])  # fmt: skip
    # both stopped in silence at step 10: their hosts settled the beacons from the counters
    state.apply([RankBeacon(0, RankProgress(phase="running", steps=10, t=1003.0)), RankBeacon(1, RankProgress(phase="running", steps=10, t=1003.0))])
    state.apply([RankBeacon(1, RankProgress(phase="running", steps=7, t=1001.0))])  # an old copy, late: ignored
    state.apply([RankBeacon(0, RankProgress(phase="running", steps=9, t=1003.0))])  # the same time, a lower count: kept
    progress = AttemptProgress.of(state.beacons)
    assert (progress.steps, progress.checkpoint_step, progress.lost_steps) == (10, 8, 2)
    reports = state.final_reports()
    assert [(r.status.value, r.metrics) for r in reports] == [("stopped", {"steps": 10, "steps_from": "beacon"})] * 2


def test_ranks_lost_with_their_host_take_the_survivors_count_and_say_so():
    from launcher.stage.events import RankBeacon, RanksLost

    state = _state(world=4)
    state.apply([RankBeacon(r, RankProgress(phase="running", steps=20, t=1001.0)) for r in range(4)])
    state.apply([RanksLost((2, 3), "h2", HOST_LOST, "lost host h2 (no answer for 5 s)", at=1002.0)])
    state.apply([RankBeacon(r, RankProgress(phase="running", steps=23, t=1004.0)) for r in (0, 1)])  # the survivors' exact counts
    by_rank = {r.rank: r for r in state.final_reports()}
    assert by_rank[2].error is not None and by_rank[2].error.type == HOST_LOST
    assert by_rank[2].metrics == by_rank[3].metrics == {"steps": 23, "steps_from": "peers"}
    assert by_rank[0].metrics == {"steps": 23, "steps_from": "beacon"}


def test_a_rank_that_reported_keeps_its_own_count():
    from tests.unit.test_run_history import _report

    from launcher.stage.events import RankBeacon, RankReported

    state = _state()
    state.apply([RankBeacon(0, RankProgress(phase="running", steps=7, t=1001.0)), RankReported(_report(0, 2, 1000.0, 11))])
    report = state.final_reports()[0]
    assert report.metrics == {"steps": 11, "values": {}, "times_ms": {}}
    assert state.beacons[0].steps == 11


# a "rank" under the SSH host wrapper: its beacon lags its counter (50 steps done, the beacon says 3)
_RANK_UNDER_WRAPPER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from launcher.procutil import process_start_ticks, write_json_atomic
    from launcher.protocol import StagePaths
    from launcher.runtime.stepcount import StepCounter, counter_path

    paths = StagePaths(Path(sys.argv[1]))
    write_json_atomic(paths.progress(0), {"pid": os.getpid(), "pid_start": process_start_ticks(), "phase": "running", "steps": 3, "t": time.time()})
    counter = StepCounter.create(counter_path(paths, 0))
    counter.store(50)
    time.sleep(600)
    """
)


def test_the_ssh_host_wrapper_settles_its_stopped_ranks_counts_before_it_forwards_them(tmp_path):
    """The wrapper around a host's agent, stopped by the launcher (its stdin closed): the rank's
    beacon on the host and the one it forwards carry the counter's count."""
    from launcher.protocol import RANK_EVENTS_TAG, RankReport, RankStatus

    paths = StagePaths(tmp_path / "world1")
    paths.progress_dir.mkdir(parents=True)
    paths.worker_config.write_text(json.dumps({"entrypoint": "x:run"}))
    slot = {"rank": 0, "local_rank": 0, "node_rank": 0, "world_size": 1, "host": "h1", "device": "cpu"}
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "launcher.runtime.hostagent", "agent", "--stage", str(paths.root), "--silence-s", "600", "--grace-s", "1",
         "--", sys.executable, "-c", _RANK_UNDER_WRAPPER, str(paths.root)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wrapper.stdin is not None and wrapper.stdout is not None
        wrapper.stdin.write(json.dumps({"env": {}, "ranks": [slot]}) + "\n")
        wrapper.stdin.flush()
        deadline = time.monotonic() + 120  # a hang guard, not a measurement
        while read_steps(counter_path(paths, 0)) != 50:
            assert wrapper.poll() is None and time.monotonic() < deadline, f"the rank never counted (wrapper exit {wrapper.poll()})"
            time.sleep(0.05)
        wrapper.stdin.close()  # the launcher stops the host
        assert wrapper.wait(timeout=120) == 143
        out = wrapper.stdout.read()
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
    assert json.loads(paths.progress(0).read_text())["steps"] == 50
    forwarded = [json.loads(line[len(RANK_EVENTS_TAG) :]) for line in out.splitlines() if line.startswith(RANK_EVENTS_TAG)]
    assert [m["beacons"]["0"]["steps"] for m in forwarded if "beacons" in m] == [50], out
    report = RankReport.from_dict(json.loads(paths.report(0).read_text()))
    assert report.status == RankStatus.STOPPED and report.host == "h1"
