"""The keeper's moves for a launcher that keeps the ranks itself (Ray's driver: a lost actor is
replaced by a new one), made in a surviving rank's process.

Under torchrun the node's agent is the keeper (``launcher.runtime.keeper``) and talks to the
stage's store directly. On Ray the store is rank 0's, on the cluster's network, where the driver
may not reach it; so the driver asks a surviving rank's actor (``RankActor.keeper``), which
reaches it as every rank does (``MASTER_ADDR``/``MASTER_PORT``), to read and write the same
``KeeperWord`` keys: the survivors' side (``launcher.runtime.inplace``) is unchanged.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Callable

from launcher.runtime.inplace import KeeperWord

CONNECT_S = 10.0  # the store is up already: every rank joined through it
_words: dict[int, KeeperWord] = {}  # attempt -> this process's connection to the stage's store


def _word(attempt: int) -> KeeperWord:
    if attempt not in _words:
        from torch._C._distributed_c10d import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=CONNECT_S))
        _words[attempt] = KeeperWord(store, attempt)
    return _words[attempt]


def claim(attempt: int, rank: int, joined: int, seen_at: float, token: str, pid: int | None = None,
          steps_at_death: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The next generation for rank ``rank``'s replacement, its death published for the
    survivors: ``{"gen": g, "wait_s": ..., "death": {...}}``. ``{"declined": why}`` where the
    rank's process (the one that joined generation ``joined``; ``pid`` where known) had not opted
    in, or another recovery is under way: then the survivors stop waiting, the restart path runs."""
    word = _word(attempt)
    armed = word.armed(rank)
    if armed is None or armed.get("gen") != joined or (pid is not None and armed.get("pid") != pid):
        return {"declined": word.decline(f"rank {rank} ended, not opted in")["why"]}
    claimed = word.claim(token)
    if claimed is None:
        return {"declined": f"rank {rank} lost while another recovery is under way"}
    gen = claimed
    death = {
        "attempt": attempt, "gen": gen, "ranks": [rank], "pids": [armed.get("pid")], "exitcodes": [None], "seen_at": seen_at,
        "steps_at_death": steps_at_death, "forked_at": time.time(), "replacements": ["new actor"],
    }  # fmt: skip
    word.publish_death(gen, death)
    return {"gen": gen, "wait_s": float(armed.get("wait_s") or 0.0), "death": death}


def outcome(attempt: int, gen: int) -> dict[str, Any] | None:
    """How generation ``gen`` ended (``recovered``: every rank stepped again), None while under way."""
    return _word(attempt).outcome(gen)


def fall_back(attempt: int, gen: int, token: str, record: dict[str, Any]) -> None:
    """Generation ``gen`` is given up: the survivors stop waiting, the restart path runs."""
    _word(attempt).fall_back({**record, "gen": gen}, token)


def release(attempt: int, token: str) -> None:
    """The recovery is over: the next loss may be recovered in place."""
    _word(attempt).release(token)


OPERATIONS: dict[str, Callable[..., Any]] = {"claim": claim, "outcome": outcome, "fall_back": fall_back, "release": release}
