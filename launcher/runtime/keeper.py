"""The node's keeper: in the torchrun agent, it replaces a lost rank in place instead of letting
torch stop the group (``launcher.runtime.inplace`` is the ranks' side).

torch's agent polls its ranks through ``ProcessContext.join`` every ``--monitor-interval`` (0.1 s);
on a rank that ended badly it stops every other rank, and the launcher restarts the group. The
keeper looks first, at each poll: a rank killed by a signal whose job opted in (its
``in_place/attempt<k>/armed.rank<r>.json`` names that very process) is replaced at once by a
rank forked from the agent's rank server (torch, the runtime and the job's imports already
there), with the same rank, environment and log, plus the generation it joins
(``GPULAUNCH_IN_PLACE_GEN``); torch's context then holds the replacement, never sees the loss,
and the survivors re-form the group with it. The fork starts while the survivors are still
finding out: its start overlaps their detection.

What the lost rank left (its beacon, its exact step count: ``launcher.runtime.stepcount``) is
kept aside first, since the replacement starts both afresh. The recovery counts once its record
is written (``gen<k>.json``: every rank stepped again). Until then, if the replacement ends, or
another rank ends, or ``wait_s`` (the job's, from its armed file) goes by, the keeper falls back:
the replacement is killed, the lost rank's beacon and count are put back, and the lost process
is handed back to torch's context, which then sees the loss as it would have and stops the
group: the restart path runs, unchanged, and ``gen<k>.fallback.json`` says why. A rank that
exited with a code (a job error, a report written) is never replaced: a bug fails again.

With ``checkpoint.warm_spares`` the keeper also keeps that many spares (``launcher.runtime.spare``):
processes forked once every rank has opted in, which run the job's ``prepare`` and wait; a loss
is handed to a spare first (its job's start done ahead), to a fork only when none is left, and a
spare is forked again once the recovery is over.

Over several hosts every node's agent has its keeper, each for its own ranks; they and the ranks
agree through the stage's store (``launcher.runtime.inplace.KeeperWord``): a keeper takes the next
generation there (one recovery at a time in the stage: a second keeper that finds one under way
leaves its loss to the restart path), publishes its word there, and learns there that the
recovery ended, from the rank that sent the state, which may be on another host. The node's
files (``gen<k>.death.json``, ``gen<k>.fallback.json``...) stay as its evidence. A lost host takes
its keeper with it: the launcher's restart path has it, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launcher.procutil import read_json, write_json_atomic
from launcher.protocol import StagePaths
from launcher.runtime.inplace import KeeperWord, armed_path, death_path, declined_path, fallback_path, fallback_record, folder, joining_args
from launcher.runtime.stepcount import counter_path, read_steps

CONNECT_S = 10.0  # the keeper's connection to the stage's store (up already: the ranks joined through it)
WHEREABOUTS_WAIT_S = 2.0  # a timed-out recovery: how long the ranks have to give their own stacks (py-spy's are read meanwhile)


@dataclass
class _Lost:
    index: int  # the local rank: its place in torch's process context
    rank: int
    original: Any  # the lost process (torch's, handed back on a fallback)
    replacement: Any = None


@dataclass
class _Spare:
    process: Any  # a rank process of the agent's kind, waiting (``launcher.runtime.spare.serve``)
    orders: Any  # the keeper's end of its pipe: the place it takes, once


@dataclass
class _Recovery:
    gen: int
    lost: list[_Lost]
    seen_at: float
    wait_s: float
    aside: list[tuple[Path, Path]] = field(default_factory=list)  # (kept copy, original place)


class Keeper:
    """One per agent (one node, one attempt): ``install()`` hooks torch's polling of the ranks."""

    def __init__(self, stage_dir: Path, attempt: int, first_rank: int, log: Callable[[str], None] | None = None, *, spares: int = 0,
                 world_size: int, store_address: tuple[str, int]) -> None:  # fmt: skip
        self.paths = StagePaths(stage_dir)
        self.root = folder(stage_dir, attempt)
        self.attempt = attempt
        self.first_rank = first_rank
        self.world_size = world_size
        self.store_address = store_address  # the stage's store (node 0's agent serves it)
        self.word: KeeperWord | None = None  # see _word
        self.token = f"{socket.gethostname()}:{os.getpid()}"
        self.gen = 0
        self.recovery: _Recovery | None = None
        self.given_up = False  # after a fallback: the restart path has this attempt
        self.renamed: dict[int, int] = {}  # a worker's pid -> the pid that took its place (torch's agent checks them)
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.wanted_spares = spares
        self.spares: list[_Spare] = []

    def install(self) -> None:
        import importlib

        spawn = importlib.import_module("torch.multiprocessing.spawn")  # the module (the package re-exports a function of its name)
        original = spawn.ProcessContext.join
        keeper = self

        def join(context: Any, timeout: float | None = None, grace_period: float | None = None) -> bool:
            keeper.tend(context)
            done = bool(original(context, timeout, grace_period))
            if done:
                keeper.release_spares()  # every rank ended well: no loss left to take
            return done

        spawn.ProcessContext.join = join
        atexit.register(self.release_spares)  # a failed attempt's agent leaves through here
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        monitor = LocalElasticAgent._monitor_workers

        def monitor_workers(agent: Any, worker_group: Any) -> Any:
            # torch's agent holds each worker's pid and checks them against its processes' first:
            # a worker replaced in place is known by its replacement's
            for worker in worker_group.workers:
                worker.id = keeper.renamed.get(worker.id, worker.id)
            return monitor(agent, worker_group)

        LocalElasticAgent._monitor_workers = monitor_workers  # type: ignore[method-assign]

    # --- each poll -----------------------------------------------------------------------------
    def tend(self, context: Any) -> None:
        """Before torch looks: settle a recovery under way, else replace newly lost ranks."""
        try:
            if self.recovery is not None:
                self._settle(context)
            if self.recovery is None and not self.given_up:
                self._replace_lost(context)
            if self.recovery is None and not self.given_up and len(self.spares) < self.wanted_spares:
                self._keep_spares(context)
        except Exception as exc:  # noqa: BLE001 - the keeper never breaks the agent: torch's path stays
            self._log(f"gpulaunch-keeper: {type(exc).__name__}: {exc}; the restart path has this loss")
            self.given_up = True

    def _word(self) -> KeeperWord:
        """The stage's store, connected at the first loss of a rank that opted in (a stage whose
        job never does pays nothing)."""
        if self.word is None:
            from datetime import timedelta

            from torch._C._distributed_c10d import TCPStore

            host, port = self.store_address
            self.word = KeeperWord(TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_S)), self.attempt)
        return self.word

    def _replace_lost(self, context: Any) -> None:
        ready = multiprocessing.connection.wait(list(context.sentinels), timeout=0)
        if not ready:
            return
        seen = time.time()
        lost, wait_s = [], 0.0
        for sentinel in ready:
            index = context.sentinels[sentinel]
            process = context.processes[index]
            process.join(1.0)
            armed = read_json(armed_path(self.root, self.first_rank + index))
            code = process.exitcode
            if code is None or code >= 0 or not isinstance(armed, dict) or armed.get("pid") != process.pid:
                if code:  # a job error, or a rank that had not opted in: its survivors stop waiting
                    self._decline(f"rank {self.first_rank + index} ended with {code}" + ("" if code > 0 else ", not opted in"))
                return  # torch's path for all
            lost.append(_Lost(index, self.first_rank + index, process))
            wait_s = max(wait_s, float(armed.get("wait_s") or 0.0))
        if len(lost) >= self.world_size:
            return  # no survivor to recover from
        gen = self._word().claim(self.token)
        if gen is None:
            self._log(f"gpulaunch-keeper: rank(s) {[x.rank for x in lost]} lost while another node's recovery is under way: the restart path")
            self.given_up = True
            return
        self.gen = gen
        recovery = _Recovery(self.gen, lost, seen, wait_s)
        self._keep_aside(recovery)
        death = {
            "attempt": self.attempt, "gen": self.gen, "ranks": [x.rank for x in lost], "pids": [x.original.pid for x in lost],
            "exitcodes": [x.original.exitcode for x in lost], "seen_at": seen, "steps_at_death": self._steps_at_death(recovery),
        }  # fmt: skip
        write_json_atomic(death_path(self.root, self.gen), death, durable=False)
        self._word().publish_death(self.gen, death)  # published whole: the survivors, on any host, act on it
        kinds = []
        for item in lost:
            item.replacement = self._assign_spare(context, item, self.gen)
            kinds.append("forked" if item.replacement is None else self._spare_state(item.replacement.pid))
            if item.replacement is None:
                item.replacement = self._fork(context, item, self.gen)
        death.update(forked_at=time.time(), replacement_pids=[x.replacement.pid for x in lost], replacements=kinds)
        write_json_atomic(death_path(self.root, self.gen), death, durable=False)
        self._word().publish_death(self.gen, death)
        self.recovery = recovery
        self._log(f"gpulaunch-keeper: rank(s) {death['ranks']} lost (exit {death['exitcodes']}); replaced in place, generation {self.gen}")

    def _decline(self, why: str) -> None:
        self.given_up = True
        if self.root.is_dir():  # only where ranks opted in: elsewhere nobody waits
            record = self._word().decline(why)
            write_json_atomic(declined_path(self.root, record["gen"]), record, durable=False)

    def _fork(self, context: Any, item: _Lost, gen: int) -> Any:
        """The lost rank again, from the rank server: torch's own target and arguments, its
        environment plus the generation it joins; it takes the lost one's place in the context."""
        old = item.original
        fn, index, args, error_file = old.rank_args  # torch.multiprocessing.spawn's own _wrap(fn, i, args, error_file), kept by the agent
        process = type(old)(target=old.rank_target, args=(fn, index, joining_args(args, index, gen), error_file), daemon=old.daemon)
        process.start()
        self._take_place(context, item, process)
        return process

    def _take_place(self, context: Any, item: _Lost, process: Any) -> None:
        """``process`` holds the lost rank's place in torch's context (and in its agent's pids)."""
        old = item.original
        context.sentinels.pop(old.sentinel, None)
        context.processes[item.index] = process
        context.sentinels[process.sentinel] = item.index
        self.renamed.pop(process.pid, None)
        self.renamed[old.pid] = process.pid

    # --- warm spares --------------------------------------------------------------------------
    def _keep_spares(self, context: Any) -> None:
        """One more spare, once every rank of the node has opted in (so the job recovers in
        place, and its ranks' own start is over: the spare's ``prepare`` overlaps steps)."""
        ended = [spare.process for spare in self.spares if spare.process.exitcode is not None]
        if ended:
            self._spare_ended(ended[0])
            return
        for index, process in enumerate(context.processes):
            armed = read_json(armed_path(self.root, self.first_rank + index))
            if not isinstance(armed, dict) or armed.get("pid") != process.pid:
                return
        from launcher.runtime.spare import serve

        template = context.processes[0]
        fn, _, args, _ = template.rank_args  # torch's arguments hold every local rank's
        receiver, sender = multiprocessing.Pipe(duplex=False)
        process = type(template)(target=serve, args=(template.rank_target, fn, args, receiver, str(self.root)), daemon=template.daemon)
        process.waiting_spare = True  # not a rank (yet): the agent's exit report skips it
        process.start()
        receiver.close()
        self.spares.append(_Spare(process, sender))

    def _assign_spare(self, context: Any, item: _Lost, gen: int) -> Any:
        """A waiting spare sent to take ``item``'s place, or None where none is left."""
        fn, index, args, error_file = item.original.rank_args
        while self.spares:
            spare = self.spares.pop(0)
            if spare.process.exitcode is not None:
                self._spare_ended(spare.process)
                continue
            try:
                spare.orders.send({"index": index, "gen": gen, "error_file": error_file})
            except OSError:
                continue
            finally:
                spare.orders.close()
            process = spare.process
            process.rank_target, process.rank_args = item.original.rank_target, (fn, index, joining_args(args, index, gen), error_file)
            process.waiting_spare = False
            self._take_place(context, item, process)
            return process
        return None

    def _spare_ended(self, process: Any) -> None:
        """A spare dies only of its own (its ``prepare`` raised, the OOM killer): no more this
        attempt, rather than a new one failing the same way at every poll."""
        if self.wanted_spares:
            self._log(f"gpulaunch-keeper: a warm spare ended (exit {process.exitcode}) before it was needed; no more spares this attempt")
        self.wanted_spares = 0

    def _spare_state(self, pid: int) -> str:
        """How ready the spare sent was: its ``prepare`` done, or still under way."""
        from launcher.runtime.spare import ready_path

        return "warm spare" if ready_path(self.root, pid).exists() else "warm spare (preparing)"

    def release_spares(self) -> None:
        """The spares of an attempt that ended: stopped (one that is preparing does not read its pipe)."""
        spares, self.spares = self.spares, []
        for spare in spares:
            spare.orders.close()
            if spare.process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(spare.process.pid, signal.SIGKILL)
                spare.process.join(5.0)

    def _settle(self, context: Any) -> None:
        recovery = self.recovery
        assert recovery is not None
        word = self._word()
        outcome = word.outcome(recovery.gen)  # the rank that sent the state says it, from any host
        if outcome is not None and outcome.get("outcome") == "recovered":
            for item in recovery.lost:
                item.original.recovered_in_place = True  # not a failure of this attempt any more
            self.recovery = None  # every rank stepped again: recovered in place
            word.release(self.token)
            return
        why, stuck = "", []
        if any(x.replacement.exitcode is not None for x in recovery.lost):
            why = "the replacement ended before it joined"
        elif any(p.exitcode is not None and p.exitcode != 0 for p in context.processes):
            why = "another rank ended during the recovery"
        elif time.time() - recovery.seen_at > recovery.wait_s:
            why = f"no recovery within wait_s={recovery.wait_s:g}s"
            self._log(f"gpulaunch-keeper: generation {recovery.gen} not recovered within wait_s; reading where each rank is")
            stuck = self._whereabouts(context)  # before the replacement is killed: which one did not come, and where it is
        if why:
            self._fall_back(context, recovery, why, stuck)

    def _whereabouts(self, context: Any) -> list[str]:
        """Where each rank of the node is (the innermost frame of the thread that runs its job,
        and the innermost one in the launcher's or the job's code under it), read as a stalled
        stage's are (``launcher.runtime.hangdump``): a recovery that timed out says which rank
        never came and at what line, instead of only that it took too long. The evidence is a
        bonus: where it cannot be read, one line says why, and the fallback happens all the same."""
        try:
            return self._read_whereabouts(context)
        except Exception as exc:  # noqa: BLE001 - py-spy refused, a rank's account unreadable: the restart path must still run
            return [f"the ranks' stacks could not be read: {type(exc).__name__}: {exc}"]

    def _read_whereabouts(self, context: Any) -> list[str]:
        from launcher.evidence import is_job_code
        from launcher.runtime.hangdump import gather

        pids = {self.first_rank + index: process.pid for index, process in enumerate(context.processes)}
        lines = []
        for evidence in gather(self.paths.root, socket.gethostname(), sorted(pids), wait_s=WHEREABOUTS_WAIT_S, pids=pids):
            thread = evidence.main_thread()
            frames = thread.frames if thread is not None else ()
            if not frames:
                lines.append(f"rank {evidence.rank} (pid {evidence.pid}): {evidence.note or 'no stack read'}")
                continue
            at = frames[0].where()
            ours = next((f for f in frames if is_job_code(f.filename) or "/launcher/" in f.filename), None)
            under = f" (under {ours.where()})" if ours is not None and ours is not frames[0] else ""
            lines.append(f"rank {evidence.rank} (pid {evidence.pid}) at {at}{under}")
        return lines

    def _fall_back(self, context: Any, recovery: _Recovery, why: str, stuck: list[str]) -> None:
        """The restart path, as if the keeper had never acted: the lost process back in torch's
        context (it sees the loss at this very poll), its beacon and count back in place."""
        for item in recovery.lost:
            replacement = item.replacement
            if replacement.exitcode is None:
                os.kill(replacement.pid, signal.SIGKILL)
                replacement.join(5.0)
            context.sentinels.pop(replacement.sentinel, None)
            context.processes[item.index] = item.original
            context.sentinels[item.original.sentinel] = item.index
            self.renamed.pop(item.original.pid, None)
            self.renamed[replacement.pid] = item.original.pid
        for kept, place in recovery.aside:
            shutil.copyfile(kept, place)
        record = fallback_record(self.attempt, recovery.gen, [x.rank for x in recovery.lost], recovery.seen_at, why, stuck)
        write_json_atomic(fallback_path(self.root, recovery.gen), record, durable=False)
        self.recovery, self.given_up = None, True
        self._word().fall_back(record, self.token)  # the survivors on every host stop waiting
        self._log(f"gpulaunch-keeper: generation {recovery.gen} not recovered in place ({why}): the restart path")
        for line in stuck:
            self._log(f"gpulaunch-keeper:   {line}")

    # --- what the lost rank left --------------------------------------------------------------
    def _keep_aside(self, recovery: _Recovery) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for item in recovery.lost:
            for place in (self.paths.progress(item.rank), counter_path(self.paths, item.rank)):
                if place.exists():
                    kept = self.root / f"gen{recovery.gen}.{place.name}"
                    shutil.copyfile(place, kept)
                    recovery.aside.append((kept, place))

    def _steps_at_death(self, recovery: _Recovery) -> int | None:
        counts = [read_steps(counter_path(self.paths, x.rank)) for x in recovery.lost]
        known = [c for c in counts if c is not None]
        return max(known) if known else None
