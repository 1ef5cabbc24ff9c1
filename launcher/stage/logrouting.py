"""A stage's output on the launching machine: per-rank log files, the console, and the rank events.

Every rank line arrives prefixed ``host:rank| `` (torchrun's log-line prefix template, set by the
plan), from a local pipe, an SSH session or an srun step alike. The router splits it back into
``logs/rank<k>.log`` in the run directory and echoes it as ``host:rank`` on the console. The
agent's own tagged lines are the stage's live channel: its ranks' forwarded beacons and reports
(``protocol.RANK_EVENTS_TAG``) and its machine-readable failure records become typed events in
``events``, which the run loop reads; they never reach a log file or the console.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import IO, Callable, Iterable

from launcher.masking import redact
from launcher.protocol import AGENT_FAILURE_TAG, LOG_PREFIX_SEPARATOR, RANK_EVENTS_PART_TAG, RANK_EVENTS_TAG, RankEventParts, decode_rank_events
from launcher.records import RankExit
from launcher.stage.events import EventQueue, RankBeacon, RankExited, RankReported, StageEvent

_RANK_LINE = re.compile(r"^(?P<host>[^\s|]+):(?P<rank>\d+)" + re.escape(LOG_PREFIX_SEPARATOR))

Echo = Callable[[str, str], None]  # (source like "host:3" or "host:agent", text)


class LogRouter:
    def __init__(self, logs_dir: Path, echo: Echo | None = None, *, secrets: Iterable[str] = ()) -> None:
        self.logs_dir = logs_dir
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.secrets = tuple(secrets)  # masked in every log line and on the console
        self.events = EventQueue()  # what the stage's ranks said, for the run loop
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()
        self._threads: dict[str, list[threading.Thread]] = {}
        self._last_line: dict[str, float] = {}  # per source, when its last line arrived
        self._parts: dict[str, RankEventParts] = {}  # per source: long forwarded messages in pieces
        # what has come through so far, for an engine's own checks (a node whose ranks fell silent)
        self.beacon_times: dict[int, float] = {}  # rank -> its latest beacon's own time
        self.reported: set[int] = set()  # ranks whose report came

    def follow(self, stream: IO[bytes], source_host: str) -> None:
        """Read ``stream`` to its end in a background thread."""
        thread = threading.Thread(target=self._pump, args=(stream, source_host), daemon=True, name=f"logs-{source_host}")
        self._last_line[source_host] = time.monotonic()
        thread.start()
        self._threads.setdefault(source_host, []).append(thread)

    def drain(self, source_host: str, idle_s: float) -> bool:
        """Wait until everything ``source_host`` wrote has been routed (its streams ended).

        An agent's last lines (its ranks' reports, its failure records) can still be in the pipe
        when the agent has exited; a verdict reached before they are routed would lose them.
        Gives up once nothing has arrived for ``idle_s``, because a stray child may hold the pipe
        open. True when every stream of the host ended.
        """
        threads = self._threads.get(source_host, [])
        while any(t.is_alive() for t in threads):
            if time.monotonic() - self._last_line.get(source_host, 0.0) > idle_s:
                return False
            for thread in threads:
                thread.join(0.05)
        return True

    def _pump(self, stream: IO[bytes], source_host: str) -> None:
        for raw in iter(stream.readline, b""):
            self._last_line[source_host] = time.monotonic()
            self.route(raw.decode("utf-8", errors="replace").rstrip("\n"), source_host)
        stream.close()

    def route(self, line: str, source_host: str) -> None:
        if line.startswith(RANK_EVENTS_TAG):
            self._forwarded(line, source_host)
            return
        if line.startswith(RANK_EVENTS_PART_TAG):
            whole = self._parts.setdefault(source_host, RankEventParts()).feed(line)
            if whole is not None:
                self._forwarded(whole, source_host)
            return
        line = redact(line, self.secrets)
        match = _RANK_LINE.match(line)
        if match:
            text = line[match.end() :]
            self._write(f"rank{match['rank']}.log", text)
            if self.echo:
                self.echo(f"{match['host']}:{match['rank']}", text)
            return
        if line.startswith(AGENT_FAILURE_TAG) and self._agent_failure(line[len(AGENT_FAILURE_TAG) :], source_host):
            return
        self._write(f"agent-{source_host}.log", line)
        if self.echo and line.strip():
            self.echo(f"{source_host}:agent", line)

    def _forwarded(self, line: str, source_host: str) -> None:
        decoded = decode_rank_events(line)
        if decoded is None:
            return  # cut short: the next beacon, or the report's fetch at the end, makes up for it
        beacons, report = decoded
        events: list[StageEvent] = [RankBeacon(rank, beacon) for rank, beacon in beacons.items()]
        if report is not None:
            events.append(RankReported(report))
        self.emit(*events)

    def emit(self, *events: StageEvent) -> None:
        """Events an engine got by other means than a forwarded line (a Ray actor's drain, a
        lost host, a report fetched at the end), on the same queue."""
        self.take_note(list(events))
        self.events.put_all(list(events))

    def take_note(self, events: list[StageEvent]) -> None:
        """Remember when each rank was last heard of and which have reported (see above)."""
        for event in events:
            if isinstance(event, RankBeacon) and event.beacon.t is not None:
                self.beacon_times[event.rank] = max(event.beacon.t, self.beacon_times.get(event.rank, 0.0))
            elif isinstance(event, RankReported):
                self.reported.add(event.report.rank)

    def _agent_failure(self, text: str, source_host: str) -> bool:
        try:
            record = json.loads(text)
            exit_ = RankExit(
                rank=int(record["rank"]),
                exitcode=record.get("exitcode"),
                signal=record.get("signal"),
                oom_suspected=bool(record.get("oom_suspected")),
                host=source_host,
                collateral=bool(record.get("collateral")),
            )
        except (ValueError, TypeError, KeyError):
            return False
        self.events.put(RankExited(exit_))
        return True

    def write_rank_line(self, rank: int, host: str, text: str) -> None:
        """For engines whose ranks' output does not come through an agent (e.g. Ray actors)."""
        self.route(f"{host}:{rank}{LOG_PREFIX_SEPARATOR}{text}", host)

    def _write(self, name: str, text: str) -> None:
        with self._lock:
            handle = self._files.get(name)
            if handle is None:
                handle = self._files[name] = open(self.logs_dir / name, "a", encoding="utf-8")  # noqa: SIM115
            handle.write(text + "\n")
            handle.flush()

    def close(self, timeout_s: float = 5.0) -> None:
        for threads in self._threads.values():
            for thread in threads:
                thread.join(timeout_s)
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()
