"""A stage engine defined outside the launcher, plugged in through the public seam alone.

Every rank of a StagePlan is a plain local subprocess, ``python -m launcher.runtime.worker
STAGE/worker.json``, started with the environment torchrun would give it (``StagePlan.rank_env``);
rank 0 hosts the rendezvous store itself (``env://``, as without an agent). Its output goes to the
stage's LogRouter line by line, as ``host:rank``. Its channel for the ranks' events is this
machine's disk: the runtime's own ``RankForwarder`` runs here, in the launcher, reads the ranks'
beacon and report files and hands its lines to the LogRouter, which turns them into events, exactly
as it does for an agent's output. poll(): done when every rank has exited (ok when all exited 0),
a non-zero exit reported as ``RankExited``. stop(): SIGTERM, then SIGKILL, by pid.

Registered in a test with ``launcher.backends.register_engine("subprocess", SubprocessEngine)``;
nothing under ``launcher/`` knows it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
from typing import IO

from launcher.protocol import StagePaths
from launcher.records import RankExit
from launcher.runtime.forwarder import RankForwarder
from launcher.stage.engine import HandleStatus, LaunchRequest, StageEngine, StageHandle
from launcher.stage.events import RankExited
from launcher.stage.logrouting import LogRouter
from launcher.stage.plan import RankSlot, StagePlan

WORKER = ("-m", "launcher.runtime.worker")


class SubprocessEngine(StageEngine):
    name = "subprocess"

    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        commands = tuple(f"[{r.host}] $ RANK={r.rank} {shlex.join([sys.executable, *WORKER, str(plan.paths.worker_config)])}" for r in plan.ranks)
        return LaunchRequest(self.name, commands, ("each rank a plain subprocess; rank 0 hosts the rendezvous store",))

    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        stage = SubprocessStage(plan, logs)
        stage.start()
        return stage


class SubprocessStage(StageHandle):
    def __init__(self, plan: StagePlan, logs: LogRouter) -> None:
        super().__init__(plan, logs)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.readers: list[threading.Thread] = []
        self.forwarder = RankForwarder(StagePaths(plan.stage_dir), [r.rank for r in plan.ranks], lambda line: logs.route(line, "disk"))
        self.told: set[int] = set()

    def start(self) -> None:
        for slot in self.plan.ranks:
            env = {**os.environ, **self.plan.rank_env(slot), "TORCHELASTIC_RESTART_COUNT": "0", "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(
                [sys.executable, *WORKER, str(self.plan.paths.worker_config)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            self.procs[slot.rank] = proc
            assert proc.stdout is not None
            reader = threading.Thread(target=self._pump, args=(slot, proc.stdout), daemon=True)
            reader.start()
            self.readers.append(reader)
        self.forwarder.start()

    def _pump(self, slot: RankSlot, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.logs.write_rank_line(slot.rank, slot.host, raw.decode(errors="replace").rstrip("\n"))
        stream.close()

    def poll(self) -> HandleStatus:
        codes = {rank: proc.poll() for rank, proc in self.procs.items()}
        for rank, code in codes.items():
            if code not in (None, 0) and rank not in self.told:
                self.told.add(rank)
                signame = signal.Signals(-code).name if code < 0 else None
                self.emit(RankExited(RankExit(rank, None if signame else code, signame, host=self.plan.ranks[rank].host)))
        if any(code is None for code in codes.values()):
            return HandleStatus(done=False)
        for reader in self.readers:
            reader.join(timeout=5)
        self.forwarder.stop()  # its last sweep: every report the ranks wrote on their way out
        ok = all(code == 0 for code in codes.values())
        return HandleStatus(done=True, ok=ok, detail="" if ok else f"rank exits {codes}")

    def stop(self, grace_s: float = 5.0) -> None:
        live = [p for p in self.procs.values() if p.poll() is None]
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for proc in live:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            for proc in live:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=wait)
            live = [p for p in live if p.poll() is None]
        self.forwarder.stop()

    def signal_ranks(self, signum: int) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)
