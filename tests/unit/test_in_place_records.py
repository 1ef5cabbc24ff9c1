"""The records of recoveries in place, from the node's files to ``result.json``: which files are
records (not the keeper's word to the survivors, nor a lost rank's beacon kept aside), each
recovery once however many ranks carry it, a run's earlier launch's first, the path named."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.records import Recovery
from launcher.results.aggregate import _recoveries
from launcher.runtime.inplace import death_path, declined_path, fallback_path, folder, record_path, stage_records


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
