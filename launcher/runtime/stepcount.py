"""Each rank's exact step count, kept where its host can read it after the rank is gone.

A rank's beacon (``progress/rank<k>.json``) is rewritten twice a second: a rank that dies in
silence (SIGKILL, the OOM killer, a stop while it blocks in a collective, where no Python handler
runs) leaves a count up to half a second old. So every rank also keeps its count in
``progress/rank<k>.steps``: 8 bytes, the host's native signed 64-bit integer, in a shared mapping
of that file, into which ``ctx.metrics.step()`` stores (no system call, no lock: one process
writes it; the kernel's page cache keeps what it stored when the process dies, however it dies).
What the beacon counts goes through it: the job's ``ctx.metrics.step()``, or, for a DDP job that
counts none (a torchrun ``script:``), its optimizer's steps.

Once a rank's process is gone, whoever reads its host's progress at the end (the torchrun agent
after its workers ended, the SSH host wrapper after its teardown, its ``fetch``) calls
:func:`settle`: a beacon whose count is behind the counter is rewritten with the counter's
count, so every path that carries beacons to the launcher (the live channel, a fetch, this
machine's disk) carries the exact count. A rank that wrote no counter (stopped before its first
import finished) keeps its beacon as it was. Light: it runs in every agent (psutil only to ask
whether a rank whose start time still matches is a zombie).
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path
from typing import Iterable

from launcher.procutil import beacon_process_alive, read_json, write_json_atomic
from launcher.protocol import StagePaths

COUNTER_BYTES = 8


def counter_path(paths: StagePaths, rank: int) -> Path:
    """``progress/rank<k>.steps``: beside the rank's beacon (archived with it on a restart)."""
    return paths.progress_dir / f"rank{rank}.steps"


class StepCounter:
    """The writer's side: an 8-byte shared mapping of the counter file. ``cell[0] = n`` stores
    (what ``MetricsRecorder.step`` does); ``store(n)`` is the same for other callers."""

    def __init__(self, path: Path, mapping: mmap.mmap) -> None:
        self.path = path
        self._mapping = mapping  # kept referenced: the view below points into it
        self.cell = memoryview(mapping).cast("q")  # native byte order and size: the reader is on this host

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> "StepCounter | None":
        """A fresh counter at 0 (an earlier attempt's file is truncated), or None where the file
        cannot be made (the count then lives in the beacon alone, as before)."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, COUNTER_BYTES)  # zero-filled
                mapping = mmap.mmap(fd, COUNTER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)  # the mapping holds the file
        except (OSError, ValueError):
            return None
        return cls(path, mapping)

    def store(self, steps: int) -> None:
        self.cell[0] = steps


def read_steps(path: str | os.PathLike[str]) -> int | None:
    """The count a counter file holds (its writer alive or gone), or None without a whole one."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(COUNTER_BYTES)
    except OSError:
        return None
    if len(data) != COUNTER_BYTES:
        return None
    return int.from_bytes(data, sys.byteorder, signed=True)


def settle(paths: StagePaths, ranks: Iterable[int]) -> dict[int, int]:
    """Rewrite the beacon of each of ``ranks`` whose process is gone and whose counter is ahead
    of it, with the counter's count (stamped now: the count holds at this time). Returns rank ->
    the count written, for the ranks rewritten. Best effort: an unreadable beacon or counter is
    left as it is."""
    settled: dict[int, int] = {}
    for rank in ranks:
        steps = read_steps(counter_path(paths, rank))
        if steps is None:
            continue
        path = paths.progress(rank)
        beacon = read_json(path)
        if not isinstance(beacon, dict):
            continue
        known = beacon.get("steps")
        if isinstance(known, int) and not isinstance(known, bool) and known >= steps:
            continue  # the rank's own last beacon said it already
        if beacon_process_alive(beacon):
            continue  # still counting: its own beacon will say it
        beacon["steps"] = steps
        beacon["t"] = max(time.time(), float(beacon["t"]) if isinstance(beacon.get("t"), (int, float)) else 0.0)
        try:
            write_json_atomic(path, beacon, durable=False)
        except OSError:
            continue
        settled[rank] = steps
    return settled
