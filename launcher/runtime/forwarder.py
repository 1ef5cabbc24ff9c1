"""A node's side of the stage's live channel: its ranks' beacons and reports, forwarded as tagged
lines on the output of the process that carries them to the launcher (the torchrun agent; the SSH
host wrapper for what it writes after stopping the agent).

Each rank rewrites its beacon (``progress/rank<k>.json``: phase, steps, own work per step, pid)
twice a second and writes its report once, at its end, on this node's disk. The forwarder looks
for new reports every ``REPORT_EVERY_S`` (a failure's report is what stops the run: it must not
wait) and at the beacons every ``FORWARD_EVERY_S``, and writes one line for all the beacons that
changed (one line per node, not per rank) and one per new report. Whatever carries the agent's output to
the launcher (a local pipe, an SSH session over the host's one connection, an srun step) carries
these too, so every rank on every host is live on the launching machine: nothing is read from
another machine's disk. Standard library only: it runs in every agent.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, Iterable

from launcher.protocol import StagePaths, rank_event_lines

FORWARD_EVERY_S = 0.25  # beacons are rewritten every 0.5 s: each reaches the launcher within ~0.25 s
REPORT_EVERY_S = 0.05  # a failed rank's report reaches the launcher before its agent has finished noticing


def _identity(path: os.PathLike[str] | str) -> tuple[int, int, int] | None:
    """What changes when a file is rewritten (atomically: a new inode) or written again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _read(path: os.PathLike[str] | str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RankForwarder:
    """Forwards the beacons and reports of ``ranks`` from ``paths`` through ``write`` (one line each)."""

    def __init__(self, paths: StagePaths, ranks: Iterable[int], write: Callable[[str], None], every_s: float = FORWARD_EVERY_S) -> None:
        self.paths = paths
        self.ranks = tuple(ranks)
        self.write = write
        self.every_s = every_s
        self._unreported = set(self.ranks)
        self._seen: dict[str, tuple[int, int, int]] = {}  # file -> the identity last forwarded
        self._sent = 0  # messages so far: with the pid, each long one's key
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="gpulaunch-forward")

    def start(self) -> "RankForwarder":
        self._thread.start()
        return self

    def _loop(self) -> None:
        next_beacons = 0.0
        while not self._stop.wait(REPORT_EVERY_S):
            if time.monotonic() >= next_beacons:
                next_beacons = time.monotonic() + self.every_s
                self.sweep()
            elif self._unreported:
                self.sweep(beacons=False)

    def sweep(self, beacons: bool = True) -> None:
        """Forward what changed since the last sweep: the beacons in one line, each report in its own."""
        with self._lock:
            changed = {}
            for rank in self.ranks if beacons else ():
                beacon = self._changed(self.paths.progress(rank))
                if beacon is not None:
                    changed[rank] = beacon
            if changed:
                self._send(beacons=changed)
            for rank in self.ranks:
                report = self._changed(self.paths.report(rank))
                if report is not None:
                    self._unreported.discard(rank)
                    self._send(report=report)

    def _send(self, **what: object) -> None:
        self._sent += 1
        for line in rank_event_lines(key=f"{os.getpid()}-{self._sent}", **what):  # type: ignore[arg-type]
            self.write(line)

    def _changed(self, path: os.PathLike[str]) -> dict | None:
        key = str(path)
        identity = _identity(path)
        if identity is None or self._seen.get(key) == identity:
            return None
        data = _read(path)
        if data is not None:
            self._seen[key] = identity
        return data

    def stop(self) -> None:
        """Stop, after one last sweep: the reports the ranks wrote on their way out go too."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.sweep()


def node_ranks(node_rank: int, nproc_per_node: int) -> range:
    """The global ranks of one node, as torchrun numbers them (node by node)."""
    return range(node_rank * nproc_per_node, (node_rank + 1) * nproc_per_node)


def print_line(line: str) -> None:
    """The agent's output: one whole line, flushed (a reader on the other end of a pipe)."""
    import sys

    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass  # the launcher is gone: nobody is left to read it
