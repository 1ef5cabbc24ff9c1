"""Recovery in place: a lost rank is replaced while the surviving ranks keep their processes.

The job opts in with ``live = ctx.checkpoint.in_place(model, optimizer, wrap=...)`` (in place of
building its DDP model itself) and runs each step through ``live.run(step_fn, *args)``. Then:

* a peer's death breaks the step's collective; the error (gloo: connection closed by peer) is
  raised in each survivor's ``live.run``, which waits (up to ``wait_s``) for the node's keeper
  (``launcher.runtime.keeper``, in the torchrun agent) to say it forked a replacement
  (``in_place/gen<k>.death.json``). No word from it (another backend, another host, a job error):
  the error goes on as before, and the launcher's restart path runs, unchanged;
* the survivors leave the broken group and form generation ``k`` of it (a new prefix in the
  stage's store) with the replacement, which takes the lost rank's place (same rank, same world);
* the lowest surviving rank sends the state, tensor by tensor, from its memory into the
  replacement's own tensors (``launcher.runtime.peerstate``): DDP replicas are identical, so any
  survivor holds the state at the last completed step. A step broken before its optimizer step
  is done again (its state had not moved): no step is lost, and where the job's data order is
  deterministic the model stays what an uninterrupted run's would be, bit for bit;
* every rank builds its DDP model again (``wrap``: the old one's reducer belongs to the old
  group) and steps on; the first step done writes ``in_place/gen<k>.json``, the recovery's
  record (who died, when it was seen, when every rank stepped again, steps lost), which the
  rank's metrics carry to ``result.json``.

The replacement runs the job's code from its start (its imports came with the fork from the
agent's rank server): until its ``in_place`` call, its ``ctx.checkpoint.load()`` answers None
without a collective (the survivors are not loading), and ``in_place`` fills its model and
optimizer from the peer and hands back the step to go on from (``live.step``).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from launcher.procutil import read_json, write_json_atomic
from launcher.protocol import PEER_LOSS

ENV_GEN = "GPULAUNCH_IN_PLACE_GEN"  # set by the keeper in a replacement rank: the generation it joins
ENV_KEEPER = "GPULAUNCH_IN_PLACE_KEEPER"  # set by a torchrun agent that keeps its ranks (one node): "1"
FOLDER = "in_place"  # under the stage directory: the keeper's and the ranks' files
_RECORD_NAME = re.compile(r"gen\d+(\.fallback)?\.json")
POLL_S = 0.005  # how often a survivor looks for the keeper's word (a stat of one file)
KEEPER_DECIDES_S = 15.0  # a survivor waits this much longer than ``wait_s`` for a replacement: the keeper's fallback comes first


def folder(stage_dir: str | os.PathLike[str], attempt: int) -> Path:
    """``in_place/attempt<k>/`` under the stage directory: one attempt's generations (a restart
    starts the group, and the count of generations, again)."""
    return Path(stage_dir) / FOLDER / f"attempt{attempt}"


def armed_path(root: Path, rank: int) -> Path:
    """Written by a rank whose job opted in (its pid, ``wait_s``): the keeper replaces only such ranks."""
    return root / f"armed.rank{rank}.json"


def death_path(root: Path, gen: int) -> Path:
    """Written by the keeper when it forked the replacements of generation ``gen``."""
    return root / f"gen{gen}.death.json"


def declined_path(root: Path, gen: int) -> Path:
    """Written by the keeper when a rank ended in a way it does not recover in place (a job
    error, a rank that had not opted in): the survivors stop waiting and the restart path runs."""
    return root / f"gen{gen}.declined.json"


def record_path(root: Path, gen: int) -> Path:
    """Written by the rank that sent the state, once every rank stepped again in generation ``gen``."""
    return root / f"gen{gen}.json"


def fallback_path(root: Path, gen: int) -> Path:
    """Written by the keeper when generation ``gen`` did not recover and the restart path runs."""
    return root / f"gen{gen}.fallback.json"


def stage_records(stage_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every recovery record of the stage so far (each attempt's, in place or fallen back), oldest first."""
    found = []
    for path in sorted(Path(stage_dir, FOLDER).glob("attempt*/gen*.json")):
        if not _RECORD_NAME.fullmatch(path.name):
            continue  # the keeper's word to the survivors, a lost rank's beacon kept aside
        record = read_json(path)
        if isinstance(record, dict):
            found.append(record)
    return sorted(found, key=lambda r: (int(r.get("attempt") or 0), int(r.get("gen") or 0)))


def group_prefix(restart: str, gen: int) -> str:
    """The store prefix of the process group's generation ``gen`` (0: the group as first formed)."""
    return "default_pg" if gen == 0 else f"gpulaunch/in_place/{restart}/gen{gen}"


def arrived_key(restart: str, gen: int, rank: int) -> str:
    """Set by a replacement as it starts to join: the survivors wait for it (``wait_s``)."""
    return f"gpulaunch/in_place/{restart}/gen{gen}/arrived/{rank}"


def joining_args(args: tuple[Any, ...], index: int, gen: int) -> tuple[Any, ...]:
    """torch's arguments for the node's ranks (elastic's ``(entry, entry args, envs, ...)``) with
    local rank ``index``'s environment told the generation it joins (``ENV_GEN``): what a
    replacement, forked or a spare, starts with."""
    envs = dict(args[2])
    envs[index] = {**envs[index], ENV_GEN: str(gen)}
    return (*args[:2], envs, *args[3:])


def joining_gen(env: Mapping[str, str]) -> int:
    """The generation a replacement rank joins; 0 for a rank of the group's first start."""
    value = env.get(ENV_GEN, "")
    return int(value) if value.isdigit() else 0


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective broken by a peer that went away (not the job's own bug)."""
    return isinstance(exc, RuntimeError) and bool(PEER_LOSS.search(f"{type(exc).__name__}: {exc}"))


class GroupSeam:
    """What the rank's runtime gives recovery in place: how to form the group's generation ``gen``
    (the worker's own group set-up on the stage's store) and who to tell that the group changed
    (the stop notice's flags, the checkpoints' cached layout)."""

    def __init__(self, *, stage_dir: Path, attempt: int, restart: str, store: Any, form: Callable[[int], None]) -> None:
        self.root = folder(stage_dir, attempt)
        self.attempt = attempt
        self.restart = restart
        self.store = store
        self.form = form
        self.on_regroup: list[Callable[[], None]] = []


class InPlace:
    """``ctx.checkpoint.in_place(...)``: the job's DDP model (``.model``), the step to go on from
    (``.step``), and ``run(step_fn, *args)``, which recovers a lost peer in place (module doc)."""

    def __init__(self, model: Any, optimizer: Any, wrap: Callable[[Any], Any], *, step: int, wait_s: float,
                 rank: int, world_size: int, seam: GroupSeam, metrics: Any, gen: int,
                 layout: tuple[Callable[[], Any], Callable[[Any], None]] | None = None) -> None:  # fmt: skip
        self.raw, self.optimizer, self._wrap = model, optimizer, wrap
        # the checkpoints' layout of the group (which ranks write): sent to a replacement with the
        # state, so that nobody asks the group for it again in a save (``Checkpoints._regrouped``)
        self._layout = layout
        self.step = step  # completed steps: the job's data position
        self.wait_s = wait_s
        self.rank, self.world_size, self.seam, self.metrics = rank, world_size, seam, metrics
        self.gen = gen
        self._commits = 0
        self._pending: dict[str, Any] | None = None  # a recovery whose first step is not done yet
        optimizer.register_step_post_hook(self._committed)
        if gen:
            self._receive(gen)
        self.model = wrap(model)
        self._arm()

    # --- the job's side -----------------------------------------------------------------------
    def run(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step_fn(*args, **kwargs)``, once: a peer lost under it is replaced in place, and the
        step is done again if its optimizer had not stepped (then its result), else None.
        ``step_fn`` must zero the gradients before its backward and use ``live.model``."""
        while True:
            commits = self._commits
            try:
                result = step_fn(*args, **kwargs)
            except RuntimeError as exc:
                if self.world_size <= 1 or self.seam.store is None or not is_peer_loss(exc):
                    raise  # no keeper here (another backend, several hosts): the restart path
                self._recover(exc)
                if self._commits > commits:
                    self._stepped()
                    return None
                continue
            self._stepped()
            return result

    def _committed(self, *_args: Any) -> None:
        self._commits += 1
        self.step += 1

    # --- a survivor ---------------------------------------------------------------------------
    def _recover(self, exc: RuntimeError) -> None:
        detected = time.time()
        gen = self.gen + 1
        death = self._await_death(gen)
        if death is None:
            raise exc  # no replacement is coming: the restart path
        dead = [int(r) for r in death["ranks"]]
        try:
            self._wait_for_arrivals(gen, dead)
        except Exception:  # noqa: BLE001 - the replacement never came: the original error, the restart path
            raise exc from None
        self._leave_group()
        self.seam.form(gen)
        grouped = time.time()
        source = min(r for r in range(self.world_size) if r not in dead)
        sent = 0
        if self.rank == source:
            from launcher.runtime.peerstate import send_state

            extra = {"metrics_steps": self.metrics.steps if self.metrics is not None else None,
                     "checkpoint_layout": self._layout[0]() if self._layout is not None else None}  # fmt: skip
            for rank in dead:
                sent += send_state(self.raw, self.optimizer, self.step, rank, extra=extra)
        state_done = time.time()
        self._rewrap()
        self.gen = gen
        if self.rank == source:
            self._pending = {
                "attempt": self.seam.attempt, "gen": gen, "dead_ranks": dead, "death": death, "detected_at": detected, "error": f"{type(exc).__name__}: {exc}"[:300],
                "grouped_at": grouped, "state_sent_at": state_done, "state_bytes": sent, "resumed_step": self.step,
            }  # fmt: skip

    def _await_death(self, gen: int) -> dict[str, Any] | None:
        """The keeper's word that it forked generation ``gen``'s replacements, within ``wait_s``."""
        path, declined = death_path(self.seam.root, gen), declined_path(self.seam.root, gen)
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            found = read_json(path)
            if isinstance(found, dict) and found.get("ranks"):
                return found
            if declined.exists():
                return None
            time.sleep(POLL_S)
        return None

    def _wait_for_arrivals(self, gen: int, dead: list[int]) -> None:
        """Until every replacement has started to join; a few milliseconds at a time, not one
        blocking wait: a keeper that gave up (``gen<k>.fallback.json``) is heard at once, and the
        rank can take its signals meanwhile."""
        keys = [arrived_key(self.seam.restart, gen, rank) for rank in dead]
        # the keeper decides when a recovery has taken too long (it then reads where each rank is,
        # and falls back); this rank's own bound, later, guards against a keeper that is gone
        deadline = time.monotonic() + self.wait_s + KEEPER_DECIDES_S
        while not self.seam.store.check(keys):
            if fallback_path(self.seam.root, gen).exists() or time.monotonic() > deadline:
                raise TimeoutError(f"in-place recovery: generation {gen}'s replacement(s) of rank(s) {dead} did not come")
            time.sleep(POLL_S)

    def _leave_group(self) -> None:
        import torch.distributed as dist

        old, self.model = self.model, None
        remove = getattr(old, "_remove_autograd_hooks", None)  # the old reducer's hooks would fire on the next backward
        if callable(remove):
            remove()
        del old
        if dist.is_initialized():
            dist.destroy_process_group()

    def _rewrap(self) -> None:
        for callback in self.seam.on_regroup:
            callback()
        self.model = self._wrap(self.raw)  # a collective: the replacement builds its own at once

    def _stepped(self) -> None:
        """After a completed step: the first one of a recovery closes its record."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        death = pending.pop("death")
        death = read_json(death_path(self.seam.root, pending["gen"])) or death  # now with the replacement's pid and fork time
        died = min(float(death.get("seen_at") or pending["detected_at"]), pending["detected_at"])
        stepped = time.time()
        lost = death.get("steps_at_death")
        record = {
            **pending,
            "in_place": True,
            "dead_pids": death.get("pids"), "exitcodes": death.get("exitcodes"), "replacement_pids": death.get("replacement_pids"),
            "replacements": death.get("replacements"),
            "died_at": died, "seen_by_keeper_at": death.get("seen_at"), "forked_at": death.get("forked_at"), "stepped_at": stepped,
            "detection_s": round(pending["detected_at"] - died, 4), "recovery_s": round(stepped - died, 4),
            "state_s": round(pending["state_sent_at"] - pending["grouped_at"], 4),
            "steps_lost": max(0, int(lost) - pending["resumed_step"]) if isinstance(lost, int) else 0,
        }  # fmt: skip
        write_json_atomic(record_path(self.seam.root, record["gen"]), record)

    # --- a replacement ------------------------------------------------------------------------
    def _receive(self, gen: int) -> None:
        from launcher.runtime.peerstate import receive_state

        death = read_json(death_path(self.seam.root, gen)) or {}
        dead = [int(r) for r in death.get("ranks") or [self.rank]]
        source = min(r for r in range(self.world_size) if r not in dead)
        for callback in self.seam.on_regroup:
            callback()
        header = receive_state(self.raw, self.optimizer, source)
        self.step = header.step
        steps = header.extra.get("metrics_steps")
        if self.metrics is not None and isinstance(steps, int):
            self.metrics.resume_count(steps)
        if self._layout is not None:
            self._layout[1](header.extra.get("checkpoint_layout"))

    def _arm(self) -> None:
        """Tell the keeper this rank may be replaced in place (its pid: a stale file never counts).
        Only a gloo group of CPU tensors: an NCCL group with a dead peer hangs or aborts rather than
        raising in the survivors, and gloo over CUDA tensors (ranks sharing a GPU) has not been
        run on a GPU yet; those take the restart path (the keeper declines an unarmed rank). Where
        no keeper watches the ranks (no store in the seam: another backend, several hosts), nobody
        reads the file: none is written."""
        if self.seam.store is None or not _recoverable(self.raw):
            return
        write_json_atomic(armed_path(self.seam.root, self.rank), {"pid": os.getpid(), "wait_s": self.wait_s, "gen": self.gen}, durable=False)


def _recoverable(model: Any) -> bool:
    """Whether a peer lost under this rank's group is recovered in place (see ``InPlace._arm``)."""
    import torch.distributed as dist

    on_cpu = all(t.device.type == "cpu" for t in model.parameters())
    return on_cpu and dist.is_initialized() and dist.get_backend() == "gloo"
