"""Recovery in place on Ray: the driver is the keeper of the stage's ranks.

Under torchrun a node's agent forks a lost rank again (``launcher.runtime.keeper``). A Ray actor
has no such parent: when one dies (SIGKILL, the OOM killer: its ``run`` call raises
``RayActorError``) the driver, which watches every rank's call, is the one that can start its
replacement. It asks rank 0's actor to claim the next generation in the stage's store and to
publish the death there (``launcher.runtime.store_keeper``: rank 0 serves that store, which the
survivors reach and the driver may not), starts a new actor for the rank in the dead one's bundle
of the placement group (its node, its reservation), told the generation it joins
(``GPULAUNCH_IN_PLACE_GEN``), and waits for the outcome: the survivors re-form the group with it
and send it the state from memory exactly as under torchrun (``launcher.runtime.inplace``), and
the rank that sent the state says in the store when every rank stepped again.

A recovery that does not end within the job's ``wait_s``, a replacement that dies, another rank
lost meanwhile: the keeper gives the generation up (the survivors stop waiting, its
``gen<k>.fallback.json`` says why) and the loss takes the restart path, unchanged. Rank 0 serves
the store and is the survivor the keeper speaks through: its loss always takes the restart path.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import RayError

from launcher.procutil import write_json_atomic
from launcher.runtime.inplace import fallback_path, fallback_record, folder

CLAIM_S = 10.0  # rank 0's answer to the claim (a few store round trips; a loaded machine is slower)
ASK_S = 0.25  # how often the outcome of a recovery under way is asked for

_log = logging.getLogger("gpulaunch.ray")


@dataclass
class _Recovery:
    rank: int
    gen: int
    seen_at: float  # time.time() when the driver saw the actor's death
    wait_s: float
    deadline: float  # time.monotonic()
    asked: Any = None  # rank 0's answer about the outcome, in flight
    next_ask: float = 0.0


class RayKeeper:
    """One per stage attempt of a Ray stage with more than one rank (``RayStage``)."""

    def __init__(self, *, attempt: int, world_size: int, stage_dir: Path, respawn: Callable[[int, int], Any], log: Callable[[str], None]) -> None:
        self.attempt = attempt
        self.world_size = world_size
        self.root = folder(stage_dir, attempt)  # the driver's evidence (its node's copy of the stage's files)
        self.respawn = respawn  # (rank, generation) -> the new actor, its run started
        self.log = log
        self.token = f"ray-driver:{os.getpid()}:{attempt}"
        self.joined: dict[int, int] = {}  # rank -> the generation its current actor joined (0: the first)
        self.recovery: _Recovery | None = None
        self.given_up = False  # after a fallback or a declined loss: the restart path has this attempt

    def take(self, rank: int, actors: Sequence[Any], detail: str, steps_at_death: int | None = None) -> bool:
        """Rank ``rank``'s actor died: True where its replacement is under way (not a failure
        yet); False where the restart path takes it (a recovery under way is given up then)."""
        if self.recovery is not None:
            why = "the replacement ended before it joined" if rank == self.recovery.rank else "another rank ended during the recovery"
            self.give_up(actors, why)
            return False
        if self.given_up or rank == 0 or self.world_size <= 1:
            return False
        seen = time.time()
        claim = {"attempt": self.attempt, "rank": rank, "joined": self.joined.get(rank, 0), "seen_at": seen, "token": self.token,
                 "steps_at_death": steps_at_death}  # fmt: skip
        try:
            answer = ray.get(actors[0].keeper.remote("claim", claim), timeout=CLAIM_S)
        except (RayError, TimeoutError) as exc:
            self.given_up = True
            self.log(f"gpulaunch: rank {rank}'s actor died; not recovered in place (the stage's store did not answer: {first_line(exc)})")
            return False
        if "declined" in answer:
            self.given_up = True
            return False
        gen, wait_s = int(answer["gen"]), float(answer["wait_s"])
        self.recovery = _Recovery(rank, gen, seen, wait_s, time.monotonic() + wait_s)
        try:
            self.respawn(rank, gen)
        except (RayError, ValueError) as exc:
            self.give_up(actors, f"no new actor for rank {rank}: {first_line(exc)}")
            return False
        self.joined[rank] = gen
        self.log(f"gpulaunch: rank {rank}'s actor died ({first_line(detail)}); replaced in place by a new actor, generation {gen}")
        return True

    def poll(self, actors: Sequence[Any]) -> tuple[int, str] | None:
        """A recovery under way, looked at: None while it goes on or once it is over; (the lost
        rank, why) once it is given up (the stage then fails: the restart path)."""
        recovery = self.recovery
        if recovery is None:
            return None
        if recovery.asked is not None and ray.wait([recovery.asked], timeout=0)[0]:
            try:
                outcome = ray.get(recovery.asked)
            except RayError:
                outcome = None  # rank 0 is gone: its run call says so (another rank ended)
            recovery.asked = None
            if isinstance(outcome, dict) and outcome.get("outcome") == "recovered":
                self.recovery = None
                actors[0].keeper.remote("release", {"attempt": self.attempt, "token": self.token})
                return None
        if time.monotonic() > recovery.deadline:
            lost = recovery.rank
            self.give_up(actors, f"no recovery within wait_s={recovery.wait_s:g}s")
            return lost, f"rank {lost} was not recovered in place within wait_s={recovery.wait_s:g}s"
        if recovery.asked is None and time.monotonic() >= recovery.next_ask:
            recovery.next_ask = time.monotonic() + ASK_S
            recovery.asked = actors[0].keeper.remote("outcome", {"attempt": self.attempt, "gen": recovery.gen})
        return None

    def give_up(self, actors: Sequence[Any], why: str) -> None:
        """The recovery under way (if any) is over: the survivors stop waiting, the restart path runs."""
        recovery, self.recovery, self.given_up = self.recovery, None, True
        if recovery is None:
            return
        record = fallback_record(self.attempt, recovery.gen, [recovery.rank], recovery.seen_at, why)
        write_json_atomic(fallback_path(self.root, recovery.gen), record, durable=False)
        try:
            ray.get(actors[0].keeper.remote("fall_back", {"attempt": self.attempt, "gen": recovery.gen, "token": self.token, "record": record}),
                    timeout=CLAIM_S)  # fmt: skip
        except (RayError, TimeoutError) as exc:  # rank 0 is gone: nobody is left waiting on its store
            _log.info("the fallback of generation %d not told to the store: %s", recovery.gen, first_line(exc))
        self.log(f"gpulaunch: generation {recovery.gen} not recovered in place ({why}): the restart path")


def first_line(exc: Any) -> str:
    """The first line of an error's text (a Ray error's runs to a whole traceback), or its type."""
    text = str(exc).strip()
    return next((line.strip()[:500] for line in text.splitlines() if line.strip()), type(exc).__name__)
