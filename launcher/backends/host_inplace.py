"""Recovery in place of a lost host: its ranks start again on a spare host while every other
host's ranks keep their processes (the torchrun engine over SSH, with a spare in the cluster file).

A node's keeper (``launcher.runtime.keeper``) replaces a rank its agent lost; a lost *host* takes
its agent and keeper with it, so the launcher, which sees the host go (its SSH session ends), is
the keeper there. It connects to the stage's store (node 0's agent serves it at the rendezvous
address, which the launcher reaches as it reaches the hosts), checks that every rank of the host
had opted in (each rank says so there: ``KeeperWord.arm``), claims the next generation and
publishes the host's ranks as dead; the engine starts a torchrun agent for the same node rank on
the spare, its ranks told the generation they join (``GPULAUNCH_IN_PLACE_GEN``), and from there it
is the recovery of a lost rank, for several ranks at once: the survivors leave the broken group,
re-form it with the spare's ranks, and the lowest survivor sends each of them the state from its
memory (``launcher.runtime.inplace``). DDP replicas are identical, so a lost host's state is in
every survivor's RAM. The spare's agent joins the static rendezvous as the lost one did: torch's
agents exchange their ranks through the store once, and the keys are still there.

Node 0's host serves the store: its loss takes the restart path, as does a loss while another
recovery is under way, a job that did not opt in, a store the launcher cannot reach, and a
recovery not over within the job's ``wait_s`` (then the spare's agent is stopped, the survivors
stop waiting, and the restart runs on that same spare, as before). ``wait_s`` counts from when the
spare's ranks began to join (their ``arrived`` keys in the store), not from the loss: a forked
replacement starts in a fraction of a second, a spare host first starts an agent over SSH (Python,
torch) on a node nobody warmed, which the job's ``wait_s`` was not meant to cover; their start
itself has ``wait_s`` too, from the loss.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

from launcher.runtime.inplace import KeeperWord, arrived_key, fallback_record

CONNECT_S = 5.0  # the stage's store is up (every rank joined through it): a launcher that cannot reach it falls back at once
ASK_S = 0.25  # how often the outcome of a recovery under way is read
SPARE_RESTART = "0"  # a spare host's agent is a new one (--max-restarts=0): its ranks' TORCHELASTIC_RESTART_COUNT


@dataclass
class HostRecovery:
    node_rank: int
    lost_host: str
    spare_host: str
    ranks: tuple[int, ...]
    gen: int
    seen_at: float  # time.time()
    wait_s: float
    next_ask: float = 0.0  # time.monotonic()
    arrived_at: float | None = None  # time.time() every rank on the spare had begun to join: wait_s counts from then


class HostKeeper:
    """One per stage attempt of the torchrun engine; acts only where the plan has spare hosts."""

    def __init__(self, attempt: int, store_address: tuple[str, int]) -> None:
        self.attempt = attempt
        self.store_address = store_address
        self.token = f"launcher:{os.getpid()}:{attempt}"
        self.word: KeeperWord | None = None
        self.joined: dict[int, int] = {}  # rank -> the generation its current process joined (0: the first)
        self.recovery: HostRecovery | None = None
        self.given_up = False  # after a fallback or a declined loss: the restart path has this attempt

    def _word(self) -> KeeperWord:
        if self.word is None:
            from torch._C._distributed_c10d import TCPStore  # the launcher loads torch only for a lost host

            host, port = self.store_address
            self.word = KeeperWord(TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_S)), self.attempt)
        return self.word

    def claim(self, node_rank: int, lost_host: str, spare_host: str, ranks: Sequence[int]) -> HostRecovery | str:
        """The generation the spare's ranks join, the host's ranks published dead for the
        survivors; or why not (the restart path takes the loss; the survivors stop waiting)."""
        seen = time.time()
        try:
            word = self._word()
            armed = {rank: word.armed(rank) for rank in ranks}
            # a record older than the generation this keeper put the rank in is its lost process's
            # (a node's keeper that replaced the rank since leaves a newer one: still opted in)
            late = [r for r, a in armed.items() if a is None or int(a.get("gen") or 0) < self.joined.get(r, 0)]
            if late:
                self.given_up = True
                return str(word.decline(f"rank(s) {late} of {lost_host} had not opted in")["why"])
            claimed = word.claim(self.token)
            if claimed is None:
                self.given_up = True
                return "another recovery is under way"
            gen = claimed
            death = {
                "attempt": self.attempt, "gen": gen, "ranks": list(ranks), "pids": [armed[r].get("pid") for r in ranks],  # type: ignore[union-attr]
                "exitcodes": [None] * len(ranks), "seen_at": seen, "steps_at_death": None, "forked_at": seen,
                "replacements": [f"spare host {spare_host}"] * len(ranks), "lost_host": lost_host,
            }  # fmt: skip
            word.publish_death(gen, death)
        except Exception as exc:  # noqa: BLE001 - a store the launcher cannot reach: the restart path, as before
            self.given_up = True
            return f"the stage's store at {self.store_address[0]}:{self.store_address[1]} did not answer ({type(exc).__name__}: {exc})"
        wait_s = max(float(a.get("wait_s") or 0.0) for a in armed.values() if a is not None)
        self.recovery = HostRecovery(node_rank, lost_host, spare_host, tuple(ranks), gen, seen, wait_s)
        return self.recovery

    def settled(self) -> bool | None:
        """The recovery under way: True once every rank stepped again (said in the store by the
        rank that sent the state), None while it goes on; False once ``wait_s`` went by, before the
        spare's ranks began to join (from the loss) or after (from then)."""
        recovery = self.recovery
        if recovery is None or time.monotonic() < recovery.next_ask:
            return None
        recovery.next_ask = time.monotonic() + ASK_S
        word = self._word()
        outcome = word.outcome(recovery.gen)
        if outcome is not None and outcome.get("outcome") == "recovered":
            self.recovery = None
            self.joined.update({rank: recovery.gen for rank in recovery.ranks})
            word.release(self.token)
            return True
        if recovery.arrived_at is None and word.store.check([arrived_key(SPARE_RESTART, recovery.gen, r) for r in recovery.ranks]):
            recovery.arrived_at = time.time()
        if time.time() - (recovery.arrived_at or recovery.seen_at) > recovery.wait_s:
            return False
        return None

    def give_up(self, why: str) -> dict[str, Any] | None:
        """The recovery under way (if any) ends: the survivors stop waiting; its fallback record."""
        recovery, self.recovery, self.given_up = self.recovery, None, True
        if recovery is None:
            return None
        record = fallback_record(self.attempt, recovery.gen, recovery.ranks, recovery.seen_at, why)
        try:
            self._word().fall_back(record, self.token)
        except Exception:  # noqa: BLE001 - node 0 gone too: nobody is left waiting on its store
            pass
        return record
