"""The records of recoveries in place, from the node's files to ``result.json``: which files are
records (not the keeper's word to the survivors, nor a lost rank's beacon kept aside), each
recovery once however many ranks carry it, a run's earlier launch's first, the path named; and
the keeper's fallback record when a recovery timed out, even where the ranks' stacks cannot be read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from launcher.protocol import RankReport, RankStatus
from launcher.records import Recovery
from launcher.results.aggregate import _recoveries, stage_phases
from launcher.runtime.inplace import KeeperWord, death_path, declined_path, fallback_path, folder, record_path, stage_records
from launcher.ui.console import _recovery_lines


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def test_only_records_are_read_oldest_first(tmp_path: Path) -> None:
    first, second = folder(tmp_path, 0), folder(tmp_path, 1)
    _write(record_path(first, 2), {"attempt": 0, "gen": 2, "in_place": True})
    _write(record_path(first, 1), {"attempt": 0, "gen": 1, "in_place": True})
    _write(fallback_path(second, 1), {"attempt": 1, "gen": 1, "in_place": False, "why": "the replacement ended before it joined"})
    _write(death_path(first, 1), {"gen": 1, "ranks": [1]})
    _write(declined_path(second, 2), {"gen": 2, "why": "rank 1 ended with 1"})
    _write(first / "gen1.rank1.json", {"pid": 1, "steps": 7})  # a lost rank's beacon, kept aside
    assert [(r["attempt"], r["gen"], r["in_place"]) for r in stage_records(tmp_path)] == [(0, 1, True), (0, 2, True), (1, 1, False)]


def test_each_recovery_once_after_the_earlier_launch() -> None:
    doc = {"attempt": 0, "gen": 1, "in_place": True, "dead_ranks": [1], "died_at": 5.0, "recovery_s": 1.5, "steps_lost": 0, "resumed_step": 17}
    fallback = {"attempt": 1, "gen": 1, "in_place": False, "dead_ranks": [0], "died_at": 9.0, "why": "no recovery within wait_s=30s"}
    earlier = [Recovery.from_dict({**doc, "died_at": 1.0}).to_dict()]
    found = _recoveries(earlier, [[doc, fallback], [doc], None])
    assert [(r.attempt, r.gen, r.in_place, r.died_at) for r in found] == [(0, 1, True, 1.0), (0, 1, True, 5.0), (1, 1, False, 9.0)]
    assert found[1].to_dict()["path"] == "in_place" and found[2].to_dict()["path"] == "restart"
    assert Recovery.from_dict(found[2].to_dict() | {"in_place": False}).why == fallback["why"]


def _ranks(replacement_at: float) -> list[RankReport]:
    """Two ranks started at 0 (spawned 0.5 s in, first step at 1.8 s, done at 20 s); rank 1 lost
    and replaced in place: its report is the replacement's, which started at ``replacement_at``."""
    first = {"spawned": 0.5, "started": 0.6, "imported": 1.5, "joined": 1.6, "pg_ready": 1.7, "first_step": 1.8, "finished": 20.0}
    late = {k: v + replacement_at for k, v in first.items() if k != "finished"} | {"finished": 20.5, "replaced": replacement_at + 0.5}
    return [RankReport(rank=r, local_rank=r, node_rank=0, world_size=2, host="h", device="cpu", status=RankStatus.OK, phases=phases)
            for r, phases in ((0, first), (1, late))]  # fmt: skip


def test_a_replacements_late_start_is_not_the_stages_start_up() -> None:
    phases = stage_phases(0.0, _ranks(replacement_at=9.0))
    assert phases == {"spawn": 0.5, "import": 1.0, "rendezvous": 0.1, "pg_init": 0.1, "run": 18.8, "to_first_step": 1.8}, phases


def test_the_summary_tells_each_loss_in_place_or_not() -> None:
    recovered = Recovery.from_dict({"attempt": 0, "gen": 1, "in_place": True, "dead_ranks": [1], "died_at": 5.0, "detection_s": 0.41,
                                    "recovery_s": 3.744, "state_bytes": 302_200_000, "resumed_step": 17, "steps_lost": 0})  # fmt: skip
    fallen = Recovery.from_dict({"attempt": 0, "gen": 2, "in_place": False, "dead_ranks": [0], "died_at": 9.0, "why": "the replacement ended before it joined"})
    lines = [t.plain for t in _recovery_lines([{"world_size": 2, "recoveries": [recovered.to_dict(), fallen.to_dict()]}])]
    assert lines == [
        "world 2, attempt 1: rank(s) 1 lost; recovered in place in 3.74 s (seen after 0.41 s, state 302.2 MB from a survivor's memory), "
        "from step 17, 0 step(s) lost, no restart",
        "world 2, attempt 1: rank(s) 0 lost; not recovered in place (the replacement ended before it joined): the restart path",
    ]


def test_the_summary_says_when_a_warm_spare_took_the_place() -> None:
    by_spare = Recovery.from_dict({"attempt": 0, "gen": 1, "in_place": True, "dead_ranks": [1], "died_at": 5.0, "detection_s": 0.1,
                                   "recovery_s": 1.2, "resumed_step": 17, "steps_lost": 0, "replacements": ["warm spare"]})  # fmt: skip
    forked = Recovery.from_dict(by_spare.to_dict() | {"replacements": ["forked"]})
    assert Recovery.from_dict(by_spare.to_dict()).replacements == ("warm spare",)  # through result.json and back
    lines = [t.plain for t in _recovery_lines([{"world_size": 2, "recoveries": [by_spare.to_dict(), forked.to_dict()]}])]
    assert lines[0].startswith("world 2, attempt 1: rank(s) 1 lost; recovered in place by a warm spare in 1.2 s"), lines
    assert "spare" not in lines[1] and "recovered in place in 1.2 s" in lines[1], lines


class _Process:
    """What the keeper reads of a rank process (torch's, in its context): a real child here, so
    that the keeper's SIGKILL of a replacement it gives up on reaches a process of this test."""

    def __init__(self, popen: "subprocess.Popen[bytes] | None" = None, pid: int = 0, exitcode: int | None = None) -> None:
        self.popen, self._pid, self._exitcode = popen, pid, exitcode
        self.sentinel = object()

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else self._pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else self._exitcode

    def join(self, timeout: float | None = None) -> None:
        if self.popen is not None:
            self.popen.wait(timeout)


def test_a_timed_out_recovery_falls_back_even_where_the_ranks_stacks_cannot_be_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.runtime import hangdump
    from launcher.runtime.keeper import Keeper, _Lost, _Recovery

    def unreadable(*_args: object, **_kwargs: object) -> list:
        raise PermissionError("ptrace: operation not permitted")

    monkeypatch.setattr(hangdump, "gather", unreadable)
    said: list[str] = []
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))  # the stage's
    keeper = Keeper(tmp_path, 0, 0, said.append, world_size=2, store_address=("127.0.0.1", store.port))
    survivor, lost = _Process(pid=os.getpid()), _Process(pid=999_999_999, exitcode=-9)
    replacement = _Process(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        context = SimpleNamespace(processes=[survivor, replacement], sentinels={survivor.sentinel: 0, replacement.sentinel: 1})
        keeper.recovery = _Recovery(1, [_Lost(1, 1, lost, replacement)], seen_at=time.time() - 10, wait_s=5)
        keeper.tend(context)
        assert replacement.popen.wait(5) == -signal.SIGKILL  # the replacement given up on
    finally:
        replacement.popen.kill()
        replacement.popen.wait()
    assert context.processes[1] is lost and context.sentinels[lost.sentinel] == 1  # torch sees the loss: the restart path
    record = json.loads(fallback_path(folder(tmp_path, 0), 1).read_text())
    assert record["why"] == "no recovery within wait_s=5s", record
    assert record["stuck"] == ["the ranks' stacks could not be read: PermissionError: ptrace: operation not permitted"], record
    assert keeper.given_up and keeper.recovery is None, said
    word = KeeperWord(store, 0)  # what the survivors on every host read
    assert word.outcome(1) == {**record, "outcome": "fallback"}
