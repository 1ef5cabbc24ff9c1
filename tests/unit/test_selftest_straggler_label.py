"""The selftest's deliberate straggler (its last rank, slowed on purpose) is said once, as the
check it is; any other rank flagged is said as usual; the summary does not repeat it."""

from __future__ import annotations

from pathlib import Path

from launcher.control.selftest_run import PlannedStraggler
from launcher.results.store import RunResult
from launcher.stage.watch import RunEvents

FLAGGED = "straggler: rank 1 on vm (cpu): own work 24.6 ms per step vs 5.0 ms for its peers (median), 4.9x"


class Seen(RunEvents):
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.result: RunResult | None = None

    def message(self, text: str) -> None:
        self.lines.append(text)

    def finished(self, result: RunResult) -> None:
        self.result = result


def test_the_planned_straggler_is_labelled_once_and_not_repeated_under_the_summary():
    seen = Seen()
    events = PlannedStraggler(seen)
    events.stage_started("selftest", 2, "cpu", "torchrun")
    events.message(FLAGGED)
    events.message("rank 1 on vm (cpu) caught up after 3.0 s as a straggler")
    events.message(FLAGGED)
    events.message("straggler: rank 0 on vm (cpu): own work 9.0 ms per step vs 5.0 ms for its peers (median), 1.8x")  # not planned
    events.message("metrics: http://127.0.0.1:1/metrics")
    assert seen.lines == [
        "straggler check: rank 1, slowed on purpose by the selftest, was flagged as it should be: "
        "vm (cpu): own work 24.6 ms per step vs 5.0 ms for its peers (median), 4.9x",
        "straggler: rank 0 on vm (cpu): own work 9.0 ms per step vs 5.0 ms for its peers (median), 1.8x",
        "metrics: http://127.0.0.1:1/metrics",
    ]
    data = {"stages": [{"world_size": 2, "stragglers": [{"rank": 1}, {"rank": 0}]}], "status": "succeeded"}
    events.finished(RunResult(data, Path("/tmp/run")))
    assert seen.result is not None and seen.result.data["stages"][0]["stragglers"] == [{"rank": 0}]
    assert data["stages"][0]["stragglers"] == [{"rank": 1}, {"rank": 0}]  # the record itself keeps it
