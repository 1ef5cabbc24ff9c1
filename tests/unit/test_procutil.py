"""Process checks on real child processes: the tree below a pid, liveness (a zombie is dead),
killing and waiting by pid, and process identity (a pid read from a progress beacon is trusted
only with its start time)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from launcher import procutil
from launcher.procutil import (
    cmdline,
    descendants,
    kill_now,
    pid_alive,
    process_spawn_time,
    process_start_ticks,
    stage_worker_pids,
    wait_gone,
    write_json_atomic,
)
from tests.fake_time import FakeTime

# sh -> {sleep, sh -> sleep}: two levels below the root, none of them exec'd away
TREE = "sleep 60 & sh -c 'sleep 60 & wait' & wait"


def _until(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """``check()``'s first true value within the timeout (its last value otherwise)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """A ``sh`` with two sleeps below it (one through another ``sh``); every pid killed after."""
    root = subprocess.Popen(["sh", "-c", TREE])
    below: list[int] = []

    def formed() -> list[int]:  # all three started, the sleeps exec'd
        pids = descendants(root.pid)
        names = sorted(Path(cmdline(p)[0]).name if cmdline(p) else "?" for p in pids)
        return pids if names == ["sh", "sleep", "sleep"] else []

    try:
        below = _until(formed)
        assert below, f"the tree never formed: {descendants(root.pid)}"
        yield root, below
    finally:
        for pid in [root.pid, *below]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        root.wait(10)


def test_descendants_lists_the_whole_tree_each_parent_before_its_children(tree) -> None:
    root, below = tree
    assert root.pid not in below
    seen = {root.pid}
    for pid in below:
        assert psutil.Process(pid).ppid() in seen, "a child listed before its parent"
        seen.add(pid)
    assert sorted(p.pid for p in psutil.Process(root.pid).children(recursive=True)) == sorted(below)
    assert set(below) <= set(descendants(os.getpid())), "grandchildren are ours too"
    assert cmdline(root.pid) == ["sh", "-c", TREE]


def test_descendants_of_a_pid_that_is_gone_is_empty() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert descendants(proc.pid) == []
    assert cmdline(proc.pid) == []
    assert process_start_ticks(proc.pid) is None
    assert process_spawn_time(proc.pid) is None


def test_kill_now_kills_a_tree_by_pid_and_leaves_its_exit_status_to_the_popen(tree, monkeypatch) -> None:
    root, below = tree
    assert all(pid_alive(p) for p in [root.pid, *below])
    survivors: list[list[int]] = []

    def seen_wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[int]:
        survivors.append(real_wait_gone(procs, timeout_s))
        return survivors[-1]

    real_wait_gone = procutil._wait_gone
    monkeypatch.setattr(procutil, "_wait_gone", seen_wait_gone)
    kill_now([root.pid, *below])
    assert survivors == [[]]  # its wait ended with every process gone, not at its deadline with survivors
    assert not any(pid_alive(p) for p in [root.pid, *below])
    assert wait_gone([root.pid, *below], 0.0) == []
    # the root is our child: a zombie until we reap it, and kill_now did not reap it
    assert psutil.Process(root.pid).status() == psutil.STATUS_ZOMBIE
    assert root.wait(5) == -signal.SIGKILL


def test_kill_now_and_wait_gone_accept_pids_already_gone() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    kill_now([proc.pid], wait_s=1.0)  # no error
    assert wait_gone([proc.pid], 1.0) == []
    assert not pid_alive(proc.pid)
    assert not pid_alive(0) and not pid_alive(-1)


def test_a_zombie_is_dead_but_still_in_the_tree() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(proc.pid, signal.SIGKILL)
        assert _until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)
        assert not pid_alive(proc.pid)
        assert wait_gone([proc.pid], 1.0) == []
        assert proc.pid in descendants(os.getpid())  # until reaped (the Ray tests' conftest reaps them)
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in descendants(os.getpid())


def test_wait_gone_returns_the_survivors_at_the_deadline_and_the_exits_before_it(tree, monkeypatch) -> None:
    root, below = tree
    started = time.monotonic()
    assert sorted(wait_gone([root.pid, *below], 0.3)) == sorted([root.pid, *below])
    assert time.monotonic() - started >= 0.3  # it waited its whole timeout for them
    sleeper = next(p for p in below if Path(cmdline(p)[0]).name == "sleep" and psutil.Process(p).ppid() == root.pid)

    def kill_at_third_poll(n: int) -> None:  # the sleeper dies while wait_gone polls, after its 3rd sleep
        if n == 3:
            os.kill(sleeper, signal.SIGKILL)
            assert _until(lambda: not pid_alive(sleeper), 60.0), "the sleeper outlived SIGKILL"  # a hang guard

    clock = FakeTime.install(monkeypatch, procutil, on_sleep=kill_at_third_poll)
    assert wait_gone([sleeper], 10.0) == []
    assert clock.sleeps == [0.02] * 3  # it returned on the poll after the exit, long before its 10 s
    monkeypatch.undo()
    assert sorted(wait_gone([root.pid, *below], 0.0)) == sorted(p for p in [root.pid, *below] if p != sleeper)


def test_start_ticks_are_the_kernels_and_identify_a_process(tmp_path) -> None:
    first = subprocess.Popen(["sleep", "60"])
    try:
        ticks = process_start_ticks(first.pid)
        assert ticks is not None and ticks == process_start_ticks(str(first.pid))
        # the kernel's own figure (clock ticks since boot, field 22 of /proc/PID/stat): progress
        # files written before psutil was used hold the same values
        stat = Path(f"/proc/{first.pid}/stat").read_text()
        assert ticks == int(stat.rsplit(")", 1)[1].split()[19])
        assert process_start_ticks(os.getpid()) == process_start_ticks() <= ticks
        time.sleep(0.05)  # > 1 tick (10 ms): a later process has a later start
        second = subprocess.Popen(["sleep", "60"])
        try:
            later = process_start_ticks(second.pid)
            assert later is not None and later > ticks, "a new process must have another identity"
            assert process_start_ticks(first.pid) == ticks, "the identity of a process never changes"
        finally:
            second.kill()
            second.wait()
    finally:
        first.kill()
        first.wait()


def test_spawn_time_is_the_wall_clock_time_the_process_started() -> None:
    before = time.time()
    proc = subprocess.Popen(["sleep", "60"])
    after = time.time()
    try:
        spawned = process_spawn_time(proc.pid)
        assert spawned is not None and before - 0.02 <= spawned <= after + 0.02
        assert abs(spawned - psutil.Process(proc.pid).create_time()) < 1.01  # psutil's is up to 1 s off
    finally:
        proc.kill()
        proc.wait()
    mine = process_spawn_time()
    assert mine is not None and mine <= before


def test_stage_worker_pids_trusts_a_pid_only_with_its_recorded_start_time(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = process_start_ticks(proc.pid)
        assert ticks is not None and ticks >= process_start_ticks(os.getpid())
        write_json_atomic(tmp_path / "progress" / "rank0.json", {"pid": proc.pid, "pid_start": ticks})
        write_json_atomic(tmp_path / "progress" / "rank1.json", {"pid": proc.pid, "pid_start": ticks - 1})  # a reused pid
        write_json_atomic(tmp_path / "progress" / "rank2.json", {"pid": proc.pid})  # no identity recorded
        assert stage_worker_pids(tmp_path) == {0: proc.pid}
    finally:
        proc.kill()
        proc.wait()
    assert stage_worker_pids(tmp_path) == {}


def test_a_rank_records_the_identity_stage_worker_pids_checks(tmp_path) -> None:
    """The progress beacon's ``pid_start`` is ``process_start_ticks()`` taken inside the rank; the
    launcher compares it with ``process_start_ticks(pid)`` read from outside."""
    code = (
        "import json, os, sys, time\n"
        "from launcher.procutil import process_start_ticks, write_json_atomic\n"
        "write_json_atomic(sys.argv[1], {'pid': os.getpid(), 'pid_start': process_start_ticks()})\n"
        "time.sleep(60)\n"
    )
    beacon = tmp_path / "progress" / "rank3.json"
    proc = subprocess.Popen([sys.executable, "-c", code, str(beacon)], cwd=Path(__file__).resolve().parents[2])
    try:
        assert _until(beacon.exists, 30), "the rank never wrote its beacon"
        assert stage_worker_pids(tmp_path) == {3: proc.pid}
        kill_now(list(stage_worker_pids(tmp_path).values()))
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert stage_worker_pids(tmp_path) == {}
