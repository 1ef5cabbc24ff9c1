"""``launch selftest``: the selftest job (``launcher/workloads/selftest.yaml``) run through the
launcher's own paths, on this machine or on every host of a cluster file at once, and its
figures kept as ``selftest.json`` in the run directory, with the machine, the date and the
launcher's commit: the record BENCHMARKS.md's GPU section is made from.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from launcher.control.api import run_job
from launcher.results.store import RunResult
from launcher.spec.cluster import load_cluster
from launcher.spec.model import load_job
from launcher.stage.watch import PlainEvents, RunEvents, TeeEvents

SPEC = Path(__file__).resolve().parents[1] / "workloads" / "selftest.yaml"
REPORT_FILE = "selftest.json"
SCHEMA_VERSION = 1

Level = Literal["quick", "default", "full"]


@dataclass(frozen=True)
class SelftestOutcome:
    result: RunResult
    report: dict[str, Any]
    report_path: Path

    @property
    def passed(self) -> bool:
        return bool(self.report["passed"])


def run_selftest(
    level: Level = "default",
    *,
    cluster: str | None = None,
    out: str | Path = "runs",
    overrides: Sequence[str] = (),
    events: RunEvents | None = None,
) -> SelftestOutcome:
    """Run the selftest at ``level`` (here, or on every host of ``cluster`` in one stage) and
    write ``selftest.json``. Bad input (a cluster file, an override) raises before anything starts."""
    sets = [f"params.level={level}"]
    if cluster is not None:  # every host of the file, at once: the cross-node all-reduce spans them
        sets.append(f"resources.nodes={len(load_cluster(Path(cluster)).hosts)}")
    job = load_job(SPEC, [*sets, *overrides])
    result = run_job(job, out=out, cluster=cluster, events=PlannedStraggler(events or PlainEvents()), metrics=False)
    report = selftest_report(result.data, level)
    path = result.run_dir / REPORT_FILE
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return SelftestOutcome(result, report, path)


class PlannedStraggler(TeeEvents):
    """The selftest's events as the user sees them: the straggler its last rank is on purpose (the
    straggler check) is said once, as that check, while it is flagged; not as a straggler of the
    machine, and not again under the summary (result.json keeps it in ``stages[].stragglers``)."""

    _FLAGGED = re.compile(r"^straggler: rank (?P<rank>\d+) on (?P<rest>.*)$")
    _CLEARED = re.compile(r"^rank (?P<rank>\d+) on .* caught up after [\d.]+ s as a straggler$")

    def __init__(self, events: RunEvents) -> None:
        super().__init__(events)
        self._planned: int | None = None
        self._said = False

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self._planned = world_size - 1 if world_size > 1 else None  # the selftest slows its last rank (workloads.selftest)
        super().stage_started(job, world_size, device_type, backend)

    def message(self, text: str) -> None:
        flagged, cleared = self._FLAGGED.match(text), self._CLEARED.match(text)
        found = flagged or cleared
        if found is None or self._planned is None or int(found["rank"]) != self._planned:
            super().message(text)
        elif flagged and not self._said:
            self._said = True
            super().message(f"straggler check: rank {found['rank']}, slowed on purpose by the selftest, was flagged as it should be: {found['rest']}")

    def finished(self, result: RunResult) -> None:
        stages = [  # each stage's last rank is its planned straggler
            {**s, "stragglers": [x for x in s.get("stragglers") or () if x.get("rank") != int(s.get("world_size") or 0) - 1]}
            for s in result.data.get("stages") or ()
        ]
        super().finished(replace(result, data={**result.data, "stages": stages}))


def selftest_report(result: Mapping[str, Any], level: str) -> dict[str, Any]:
    """What ``selftest.json`` holds: where and when it ran, every figure with its limit, every
    check, what could not run and why; ``passed`` only for a run that finished and passed all."""
    summary = result.get("summary") or {}
    nodes = summary.get("nodes") or {}
    return {
        "schema_version": SCHEMA_VERSION,
        "level": level,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(result.get("started_at") or time.time())),
        "launcher_commit": launcher_commit(),
        "machine": {host: _machine(node) for host, node in nodes.items()} or {socket.gethostname(): {}},
        "status": result.get("status"),
        "wall_s": result.get("wall_s"),
        "passed": bool(summary.get("passed")) and result.get("status") == "succeeded",
        "figures": summary.get("figures", []),
        "checks": summary.get("checks", []),
        "not_run": summary.get("not_run", []),
        "nodes": nodes,  # each node's NVML inventory (GPUs, links, topology, health readings) and versions
        "failure": result.get("failure"),
        "summary_error": summary.get("error"),
        "run_dir": str(result.get("run_dir")),
    }


def _machine(node: Mapping[str, Any]) -> dict[str, Any]:
    inventory = node.get("inventory") or {}
    gpus = inventory.get("gpus") or []
    return {
        "gpus": [g.get("name") for g in gpus],
        "driver": inventory.get("driver_version"),
        "cuda_driver": inventory.get("cuda_driver_version"),
        "cpus": node.get("cpus"),
        "versions": node.get("versions"),
    }


def launcher_commit() -> str | None:
    """The launcher's git commit (with ``-dirty`` for local changes), where it runs from a clone."""
    here = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(here), "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None
