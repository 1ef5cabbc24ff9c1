"""Recovery in place: a lost rank is replaced while the surviving ranks keep their processes.

The job opts in with ``live = ctx.checkpoint.in_place(model, optimizer, wrap=...)`` (in place of
building its DDP model itself) and runs each step through ``live.run(step_fn, *args)``. Then:

* a peer's death breaks the step's collective; the error (gloo: connection closed by peer) is
  raised in each survivor's ``live.run`` (a survivor whose collective waits on a peer that says
  nothing, a host powered off or another survivor waiting too, is woken by its own watch: the
  keeper's word of the loss in the store, its sockets then shut, ``InPlace._watch``), which waits (up to ``wait_s``) for the keeper of the
  lost rank's node (``launcher.runtime.keeper``, in that node's torchrun agent) to say in the
  stage's store that it forked a replacement (``KeeperWord``: a survivor on any host reads it).
  No word from it (another backend, a lost host, a job error): the error goes on as before, and
  the launcher's restart path runs, unchanged;
* the survivors leave the broken group (its connections shut down, the group itself kept a while:
  ``Retired``) and form generation ``k`` of it (a new prefix in the stage's store) with the
  replacement, which takes the lost rank's place (same rank, same world);
* the lowest surviving rank sends the state, tensor by tensor, from its memory into the
  replacement's own tensors (``launcher.runtime.peerstate``): DDP replicas are identical, so any
  survivor holds the state at the last completed step (where a step's all-reduce completed on
  some survivors only, the lowest of those sends, to every rank behind it: ``state_transfer``). A step broken before its optimizer step
  is done again (its state had not moved): no step is lost, and where the job's data order is
  deterministic the model stays what an uninterrupted run's would be, bit for bit;
* every rank builds its DDP model again (``wrap``: the old one's reducer belongs to the old
  group) and steps on; the first step done writes ``in_place/gen<k>.json``, the recovery's
  record (who died, when it was seen, when every rank stepped again, steps lost), which the
  rank's metrics carry to ``result.json``, and tells the keeper, through the store, that the
  recovery is over.

The replacement runs the job's code from its start (its imports came with the fork from the
agent's rank server): until its ``in_place`` call, its ``ctx.checkpoint.load()`` answers None
without a collective (the survivors are not loading), and ``in_place`` fills its model and
optimizer from the peer and hands back the step to go on from (``live.step``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from launcher.procutil import read_json, write_json_atomic
from launcher.protocol import PEER_LOSS

ENV_GEN = "GPULAUNCH_IN_PLACE_GEN"  # set by the keeper in a replacement rank: the generation it joins
ENV_KEEPER = "GPULAUNCH_IN_PLACE_KEEPER"  # who replaces a lost rank: "1", the node's torchrun agent (every node of a fixed world); KEEPER_LAUNCHER
KEEPER_LAUNCHER = "launcher"  # ENV_KEEPER's value where the launcher itself replaces a lost rank (Ray's driver: a new actor)
FOLDER = "in_place"  # under the stage directory: the keeper's and the ranks' files
_RECORD_NAME = re.compile(r"gen\d+(\.fallback)?\.json")
POLL_S = 0.005  # how often a survivor looks for the keeper's word (a key or two of the stage's store): ``poll_s``
RETIRE_S = 10.0  # a left group whose sockets were shut down is dropped this long after (``Retired``)
WATCH_S = 0.25  # how often a rank's watch reads the store for the keeper's word of a loss: ``watch_s``
KEEPER_DECIDES_S = 15.0  # a survivor waits this much longer than ``wait_s`` for a replacement: the keeper's fallback comes first


def poll_s(world_size: int) -> float:
    """How often a survivor of a ``world_size`` world looks for the keeper's word: ``POLL_S``,
    less often in a large world, where every survivor asks the one store at once (1,024 ranks at
    0.1 s: 20,000 small reads a second while a recovery waits)."""
    return min(0.1, max(POLL_S, world_size / 10_000))


def state_transfer(steps: Sequence[int]) -> tuple[int, list[int]]:
    """Who sends the state and who takes it, from every rank's completed steps in the new group
    (a replacement's: -1). The survivors need not agree: a peer dying during a step's all-reduce
    can end it on some survivors (gloo's ring finishes at different moments on different ranks),
    which then step, and fail it on others. So the lowest rank with the most steps sends, and
    every rank with fewer (the replacements, and survivors a step behind) takes its state: the
    step was complete where it completed, and every rank goes on from it, none a step ahead."""
    most = max(steps)
    return steps.index(most), [rank for rank, done in enumerate(steps) if done < most]


def watch_s(world_size: int) -> float:
    """How often each rank's watch (``InPlace._watch``) asks the stage's store whether a loss was
    announced: ``WATCH_S``, less often in a large world (1,024 ranks: once a second each, about a
    thousand small reads a second at the store, all the time)."""
    return max(WATCH_S, world_size / 1000)


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


class KeeperWord:
    """What the nodes' keepers and the ranks tell each other about each generation, in the stage's
    store, which every host's ranks and agents reach (a node's files only its own: a survivor on
    another host than the lost rank would never read its keeper's). The keys of attempt
    ``attempt`` (a restart starts them again):

    * ``gen``: the generations begun (a counter): a keeper takes the next for its recovery;
    * ``busy``: the keeper (its token) whose recovery is under way: one at a time in the stage,
      so that two hosts' keepers never form two different generations from one group;
    * ``gen<k>/death``: the keeper's word that it started generation ``k``'s replacements (JSON:
      the dead ranks, their pids, when the loss was seen...), published whole;
    * ``gen<k>/outcome``: how generation ``k`` ended: ``recovered`` (the rank that sent the
      state, once every rank stepped again), ``fallback`` (the keeper gave up: the restart path)
      or ``declined`` (a rank ended in a way the keeper does not recover: nobody waits)."""

    def __init__(self, store: Any, attempt: int) -> None:
        self.store = store
        self.attempt = attempt
        self.prefix = f"gpulaunch/in_place/a{attempt}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _read(self, name: str) -> dict[str, Any] | None:
        key = self._key(name)
        if not self.store.check([key]):
            return None
        found = json.loads(self.store.get(key))
        return found if isinstance(found, dict) else None

    def claim(self, token: str) -> int | None:
        """The next generation for this keeper's recovery, or None while another's is under way."""
        if self.store.compare_set(self._key("busy"), "", token) != token.encode():
            return None
        return int(self.store.add(self._key("gen"), 1))

    def release(self, token: str) -> None:
        self.store.compare_set(self._key("busy"), token, "")

    def decline(self, why: str) -> dict[str, Any]:
        """No replacement is coming for a loss (a job error, a rank that had not opted in): the
        generation every survivor waits for settled ``declined``, so they stop waiting; its record."""
        gen = self.begun() + 1  # the generation every survivor, on any host, waits for
        record = {"attempt": self.attempt, "gen": gen, "why": why}
        self.settle(gen, "declined", record)
        return record

    def fall_back(self, record: Mapping[str, Any], token: str) -> None:
        """The keeper ``token`` gives its generation up (``fallback_record``): the survivors on
        every host stop waiting, and the next loss may be claimed."""
        self.settle(int(record["gen"]), "fallback", record)
        self.release(token)

    def arm(self, rank: int, record: Mapping[str, Any]) -> None:
        """Rank ``rank`` opted in (its pid, ``wait_s``, the generation it joined): for a keeper
        that reads no node's files (the launcher, for a lost host; Ray's driver, through a
        survivor: ``launcher.runtime.store_keeper``)."""
        self._publish(f"armed/{rank}", record)

    def armed(self, rank: int) -> dict[str, Any] | None:
        return self._read(f"armed/{rank}")

    def begun(self) -> int:
        """How many generations were begun (the group's current one, where all recovered)."""
        return int(self.store.add(self._key("gen"), 0))

    def _publish(self, name: str, value: Mapping[str, Any]) -> None:
        """``value`` under ``name``, at the store once this returns: a client's ``set`` is sent
        without an answer, so another client could still miss it; the ``check`` after it, on the
        same connection, is answered only once the store has applied the ``set``."""
        key = self._key(name)
        self.store.set(key, json.dumps(dict(value)))
        self.store.check([key])

    def publish_death(self, gen: int, death: Mapping[str, Any]) -> None:
        self._publish(f"gen{gen}/death", death)

    def death(self, gen: int) -> dict[str, Any] | None:
        return self._read(f"gen{gen}/death")

    def settle(self, gen: int, kind: str, record: Mapping[str, Any]) -> None:
        self._publish(f"gen{gen}/outcome", {**record, "outcome": kind})

    def outcome(self, gen: int) -> dict[str, Any] | None:
        return self._read(f"gen{gen}/outcome")


def fallback_record(attempt: int, gen: int, dead_ranks: Sequence[int], died_at: float, why: str, stuck: Sequence[str] = ()) -> dict[str, Any]:
    """Generation ``gen``'s loss not recovered in place: the restart path's record of it
    (``gen<k>.fallback.json``, the store's outcome, ``recoveries[]`` in result.json)."""
    return {"attempt": attempt, "gen": gen, "in_place": False, "dead_ranks": list(dead_ranks), "died_at": died_at,
            "fallback_at": time.time(), "why": why, "stuck": list(stuck)}  # fmt: skip


def socket_fds() -> dict[int, str]:
    """This process's open sockets: descriptor -> the kernel's name of it (``socket:[inode]``);
    none where there is no ``/proc`` (then a left group's sockets are not shut down: ``Retired``)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    found = {}
    for name in names:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:"):
                found[int(name)] = target
    return found


def opened_between(before: Mapping[int, str], after: Mapping[int, str]) -> dict[int, str]:
    """The sockets in ``after`` that ``before`` did not have: a process group's own, where
    ``before``/``after`` surround its forming (its connection to every peer, its listener)."""
    return {fd: name for fd, name in after.items() if before.get(fd) != name}


def shut_down(sockets: Mapping[int, str]) -> int:
    """``shutdown(2)`` each of ``sockets`` still open as itself (not a reused descriptor), without
    closing it (its owner, gloo, does that when the group goes): a collective blocked on it fails at
    once, here and at its peer, which sees the connection closed. Returns how many were shut.

    Each is shut through a duplicate of its descriptor, checked to name the group's socket: gloo
    closes its own descriptors as its connections fail, at the same time (a descriptor closed
    under a ``socket(fileno=...)`` failed a survivor with EBADF in the goodput soak)."""
    import socket

    shut = 0
    for fd, name in sockets.items():
        try:
            own = os.dup(fd)
        except OSError:
            continue  # closed already: gloo is done with it
        try:
            sock = socket.socket(fileno=own)
        except OSError:
            os.close(own)
            continue
        with sock:
            try:
                if os.readlink(f"/proc/self/fd/{own}") != name:
                    continue  # the descriptor was closed and reused: not the group's socket
                # never a listener: gloo's accept loop aborts the process on the error that would wake it
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
                    shut += 1
            except OSError:
                pass  # a connection already broken
    return shut


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

    def __init__(self, *, stage_dir: Path, attempt: int, restart: str, store: Any, form: Callable[[int], None],
                 collective_timeout_s: float = 1800.0, sockets: Callable[[], Mapping[int, str]] = dict) -> None:  # fmt: skip
        self.root = folder(stage_dir, attempt)
        self.attempt = attempt
        self.restart = restart
        self.store = store
        self.word = KeeperWord(store, attempt) if store is not None else None
        self.form = form
        # a left group's collectives end by then at the latest (failed or timed out): see Retired
        self.collective_timeout_s = collective_timeout_s
        self.sockets = sockets  # the current group's own sockets (``opened_between`` its forming)
        self.on_regroup: list[Callable[[], None]] = []


class Retired:
    """A left generation's process group and DDP model, kept until their release is harmless.

    A gloo group is freed by joining its worker threads, which wait for the collective each is
    in. Freed at the leave, that deadlocked: the old DDP model's reducer held the last reference
    and freed it holding the GIL, while a worker finishing a broken collective waited for the GIL
    to free it (the work keeps the thread-local state it was queued with, and torch's backward
    puts a Python object there, its ``contextvars`` context; 3 faults of 153 in the goodput soak,
    py-spy --native; pytorch#179291 is of this kind). Freed at a step later, from the main thread,
    the join waited for ever on a worker still blocked in a collective (1 fault in 9 over four
    hosts, the cause of that block not found). So a survivor that finds its group broken shuts its
    sockets down at once (``shut_down``: every collective of it fails at once, here and at the
    peers, which a collective waiting on another survivor, not on the dead rank, needs: gloo has
    no abort; done only at the leave, a survivor two hosts away heard of a lost host 4 s late), keeps
    the group and the model here, and ``RETIRE_S`` later lets them go on a thread of their own:
    the model first (a garbage collection there frees it even from a reference cycle, the group
    still held), then the group, which torch frees without the GIL. Should a worker never end,
    only that thread waits, and ``os._exit`` (torch's process start runs no destructor) ends it
    with the rank. Where the sockets could not be shut (no ``/proc``), two collective timeouts
    pass first."""

    def __init__(self, group: Any, model: Any, release_at: float) -> None:
        self.group = group
        self.model = model
        self.release_at = release_at  # time.monotonic()


def release(retired: list[Retired]) -> threading.Thread:
    """Let ``retired`` go on a daemon thread (``Retired``); returns it."""

    def drop() -> None:
        import gc

        for item in retired:
            item.model = None
        gc.collect()
        for item in retired:
            item.group = None

    thread = threading.Thread(target=drop, name="gpulaunch-retire", daemon=True)
    thread.start()
    return thread


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
        self.retired: list[Retired] = []  # the groups this rank left, oldest first
        self._shut = 0  # the broken group's sockets shut down (at the detection, by the watch)
        # the generation the main thread is in or recovering to, and the lock that orders it
        # against the watch's shutdown (which must never reach a generation formed since)
        self._lock = threading.Lock()
        self._recovering = gen
        self.nudged: list[int] = []  # the generations whose loss this rank heard of from its watch
        optimizer.register_step_post_hook(self._committed)
        if gen:
            self._receive(gen)
        self.model = wrap(model)
        if self._arm() and world_size > 1 and seam.word is not None:
            threading.Thread(target=self._watch, args=(watch_s(world_size),), name="gpulaunch-inplace-watch", daemon=True).start()

    # --- the job's side -----------------------------------------------------------------------
    def run(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step_fn(*args, **kwargs)``, once: a peer lost under it is replaced in place, and the
        step is done again if its optimizer had not stepped (then its result), else None.
        ``step_fn`` must zero the gradients before its backward and use ``live.model``."""
        while True:
            commits, at = self._commits, self.step
            try:
                result = step_fn(*args, **kwargs)
            except RuntimeError as exc:
                if self.world_size <= 1 or self.seam.store is None or not is_peer_loss(exc):
                    raise  # no keeper here (another backend, several hosts): the restart path
                self._recover(exc)
                if self._commits > commits or self.step != at:  # this step is done (here, or by the peer whose state came)
                    self._stepped()
                    return None
                continue
            self._stepped()
            return result

    def recovered_between_steps(self, exc: BaseException) -> bool:
        """A collective of the job's own between two steps (a checkpoint's save) broken by a lost
        peer: recovered as under ``run`` (the state is the last step's); True where it was, and
        the caller gives that collective up: the replacement goes on at the next step, as the
        survivors do then. The error goes on where it is not a peer's loss (False) or where no
        replacement comes (the restart path)."""
        if self.world_size <= 1 or self.seam.store is None or not isinstance(exc, RuntimeError) or not is_peer_loss(exc):
            return False
        self._recover(exc)
        return True

    def _committed(self, *_args: Any) -> None:
        self._commits += 1
        self.step += 1

    # --- a survivor ---------------------------------------------------------------------------
    def _recover(self, exc: RuntimeError) -> None:
        detected = time.time()
        gen = self.gen + 1
        # The group is broken for good (recovered or not, nobody uses it again): its connections
        # shut down now, so that a survivor blocked on this one (not on the dead rank: a ring's
        # neighbour, another host) hears it at once, not once this rank leaves after the arrivals.
        with self._lock:
            self._recovering = gen
            self._shut += shut_down(self.seam.sockets())
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
        source, behind = state_transfer(self._steps_of_all(self.step))
        sent = 0
        if self.rank == source:
            from launcher.runtime.peerstate import send_state

            extra = {"metrics_steps": self.metrics.steps if self.metrics is not None else None,
                     "checkpoint_layout": self._layout[0]() if self._layout is not None else None}  # fmt: skip
            for rank in behind:
                sent += send_state(self.raw, self.optimizer, self.step, rank, extra=extra)
        elif self.rank in behind:  # a survivor whose step's all-reduce failed where the source's had completed
            self._take_state(source)
        state_done = time.time()
        self._rewrap()
        self.gen = gen
        if self.rank == source:
            self._pending = {
                "attempt": self.seam.attempt, "gen": gen, "dead_ranks": dead, "death": death, "detected_at": detected, "error": f"{type(exc).__name__}: {exc}"[:300],
                "grouped_at": grouped, "state_sent_at": state_done, "state_bytes": sent, "resumed_step": self.step,
                "survivors_behind": [r for r in behind if r not in dead],  # their step's all-reduce failed where it completed here
            }  # fmt: skip

    def _await_death(self, gen: int) -> dict[str, Any] | None:
        """The keeper's word that it started generation ``gen``'s replacements, within ``wait_s``
        (from the keeper of whichever host lost the rank)."""
        word = self.seam.word
        assert word is not None
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            found = word.death(gen)
            if found is not None and found.get("ranks"):
                return found
            if word.outcome(gen) is not None:
                return None  # declined: no replacement is coming
            time.sleep(poll_s(self.world_size))
        return None

    def _wait_for_arrivals(self, gen: int, dead: list[int]) -> None:
        """Until every replacement has started to join; a few milliseconds at a time, not one
        blocking wait: a keeper that gave up (its ``fallback`` outcome) is heard at once, and the
        rank can take its signals meanwhile."""
        word = self.seam.word
        assert word is not None
        keys = [arrived_key(self.seam.restart, gen, rank) for rank in dead]
        # the keeper decides when a recovery has taken too long (it then reads where each rank is,
        # and falls back); this rank's own bound, later, guards against a keeper that is gone
        deadline = time.monotonic() + self.wait_s + KEEPER_DECIDES_S
        while not self.seam.store.check(keys):
            if word.outcome(gen) is not None or time.monotonic() > deadline:
                raise TimeoutError(f"in-place recovery: generation {gen}'s replacement(s) of rank(s) {dead} did not come")
            time.sleep(poll_s(self.world_size))

    def _leave_group(self) -> None:
        import torch.distributed as dist

        shut = self._shut + shut_down(self.seam.sockets())  # shut at the detection; any opened since, now
        self._shut = 0
        old, self.model = self.model, None
        remove = getattr(old, "_remove_autograd_hooks", None)  # the old reducer's hooks would fire on the next backward
        if callable(remove):
            remove()
        if dist.is_initialized():
            group = dist.distributed_c10d._get_default_group()
            wait_s = RETIRE_S if shut else 2 * self.seam.collective_timeout_s
            self.retired.append(Retired(group, old, time.monotonic() + wait_s))
            dist.destroy_process_group()  # out of torch's tables; the group lives on in self.retired

    def _release_retired(self) -> threading.Thread | None:
        """Let the left groups whose time has come go (``Retired``), off this thread."""
        now = time.monotonic()
        due = [item for item in self.retired if item.release_at <= now]
        if not due:
            return None
        self.retired = [item for item in self.retired if item.release_at > now]
        return release(due)

    def _rewrap(self) -> None:
        for callback in self.seam.on_regroup:
            callback()
        self.model = self._wrap(self.raw)  # a collective: the replacement builds its own at once

    def _stepped(self) -> None:
        """After a completed step: the first one of a recovery closes its record."""
        if self.retired:
            self._release_retired()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        death = pending.pop("death")
        word = self.seam.word
        death = (word.death(pending["gen"]) if word is not None else None) or death  # now with the replacement's pid and fork time
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
        if word is not None:
            word.settle(record["gen"], "recovered", record)  # the lost rank's keeper may be on another host

    def _watch(self, every_s: float) -> None:
        """The rank's watch, on a thread of its own: a survivor hears of a loss from its collective's
        error, but only from the connection that collective waits on. gloo fails a pending call
        only on an error of its own pair, so a survivor waiting on a peer that says nothing (a
        host powered off: no connection is closed; or another survivor that waits as well) stays
        in it while its other connections are closed (the soak's stall "C": one survivor in its
        backward's all-reduce, every other already forming the next generation), until the keeper
        gives up. The watch reads the store for the keeper's word of the next generation's loss;
        where the main thread has not begun that recovery, it shuts this rank's sockets of the
        group down: every pending call fails here at once (gloo: connection closed), and the main
        thread recovers as from any peer's loss. It ends with the store (the stage ending)."""
        word = self.seam.word
        assert word is not None
        while True:
            time.sleep(every_s)
            gen = self.gen + 1
            if self._recovering >= gen:
                continue  # the main thread is on it
            try:
                death = word.death(gen)
            except Exception:  # noqa: BLE001 - the store is gone: the stage is ending
                return
            if not death or not death.get("ranks"):
                continue
            with self._lock:
                if self._recovering < gen and self.gen + 1 == gen:  # the group is still the broken one
                    self._shut += shut_down(self.seam.sockets())
                    self.nudged.append(gen)
                    print(f"gpulaunch: rank {self.rank} heard of generation {gen}'s loss (ranks {death['ranks']}) from the store, "
                          "not from its collective: its connections shut, it recovers", file=sys.stderr, flush=True)

    # --- a replacement ------------------------------------------------------------------------
    def _receive(self, gen: int) -> None:
        """A replacement joining generation ``gen``: the state from the survivor with the most
        steps (``state_transfer``), taken before its DDP model is built."""
        source, _ = state_transfer(self._steps_of_all(-1))  # a replacement has no step of its own
        for callback in self.seam.on_regroup:
            callback()
        self._take_state(source)

    def _steps_of_all(self, mine: int) -> list[int]:
        """Every rank's completed steps in the new group (a collective, survivors and replacements
        alike): the survivors need not agree (``state_transfer``)."""
        import torch.distributed as dist

        steps: list[Any] = [None] * self.world_size
        dist.all_gather_object(steps, mine)
        return [int(s) for s in steps]

    def _take_state(self, source: int) -> None:
        """The model, the optimizer and the step from rank ``source`` (``peerstate``)."""
        from launcher.runtime.peerstate import receive_state

        header = receive_state(self.raw, self.optimizer, source)
        self.step = header.step
        steps = header.extra.get("metrics_steps")
        if self.metrics is not None and isinstance(steps, int):
            self.metrics.resume_count(steps)
        if self._layout is not None:
            self._layout[1](header.extra.get("checkpoint_layout"))

    def _arm(self) -> bool:
        """Tell the keeper this rank may be replaced in place (its pid: a stale file never counts).
        Only a gloo group, of CPU tensors or of CUDA tensors (ranks sharing a GPU: the state goes
        through pinned host memory, ``peerstate``): an NCCL group with a dead peer hangs or aborts
        rather than raising in the survivors; it takes the restart path (the keeper declines an
        unarmed rank). Where
        no keeper watches the ranks (no store in the seam: another backend, several hosts), nobody
        reads the file: none is written."""
        if self.seam.store is None or not _recoverable(self.raw):
            return False
        armed = {"pid": os.getpid(), "wait_s": self.wait_s, "gen": self.gen}
        write_json_atomic(armed_path(self.seam.root, self.rank), armed, durable=False)
        if self.seam.word is not None:  # for a keeper that reads no node's files: the launcher (a lost host, a lost Ray actor)
            self.seam.word.arm(self.rank, armed)
        return True


def _recoverable(model: Any) -> bool:
    """Whether a peer lost under this rank's group is recovered in place (see ``InPlace._arm``)."""
    import torch.distributed as dist

    where = {t.device.type for t in model.parameters()}
    return where <= {"cpu", "cuda"} and dist.is_initialized() and dist.get_backend() == "gloo"
