"""``ctx.checkpoint`` and ``ctx.should_stop``: what a job saves, what a restarted job gets back,
and the notice that it should save now and return.

Every rank calls ``save`` at the same step, as with ``torch.distributed.checkpoint``:

* replicated state (DDP: every rank holds the same model) is rank 0's: one ``torch.save`` file,
  written where rank 0 runs and, when the hosts share no filesystem, sent once to one rank per
  other host (its local rank 0), which writes its own copy: a restart on any of those hosts, or on
  a spare that one of them hands it to, finds it;
* ``sharded=True`` state (FSDP, or anything whose ranks hold parts) goes through
  ``torch.distributed.checkpoint``: every rank writes its part into one directory that every host
  must see (``checkpoint.dir`` on a shared filesystem); loading reshards to the new world size.

With ``checkpoint.async_save`` a replicated save blocks the step only for a copy: rank 0's state
is copied to host memory (and, where the hosts share no filesystem, serialised and sent to the
other hosts' writers), and the file is written, digested, synced and published on a thread while
the job steps on. One write is in flight at a time (the next ``save`` waits for it first, as do
``load`` and the rank's end, which fails the rank if the write failed); a checkpoint counts as
saved (the beacon's ``ckpt_step``) once it is published. Sharded saves stay synchronous: DCP's
own ``async_save`` runs its final metadata step's collectives from the background, which needs a
process group of its own beside the job's (not built).

``load`` returns the newest complete checkpoint any host has, on this rank's device, or None on a
fresh start. Files are written under a temporary name and published by a rename with a manifest
(step, job, SHA-256 of each file): a checkpoint cut short is never loaded (``launcher.checkpoint_store``).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from launcher.checkpoint_store import (
    MANIFEST,
    STATE_FILE,
    CheckpointError,
    FileDigest,
    Manifest,
    check_files,
    digest_of,
    drop_partials,
    file_digest,
    fsync_path,
    latest,
    partial_dir,
    prune,
    publish,
    step_dir,
    write_manifest,
)
from launcher.protocol import STOP_NOTICE_SIGNAL, WorkerConfig


@dataclass(frozen=True)
class Restored:
    """A checkpoint handed back to the job: what it saved (on this rank's device), and at which step."""

    state: Any
    step: int
    path: Path  # its step-* folder (on the host that had it; the same path on every host)
    manifest: Manifest  # what the writer recorded: job, world size, each file's SHA-256


_NOTICES: list["StopNotice"] = []  # this process's live notices (a Ray actor's process may run several ranks in turn)
_PENDING_REASON = ""  # a notice that came before the job started: the next StopNotice starts with it


def notify_stop(reason: str) -> None:
    """Tell this process's job to stop (the launcher's SIGUSR2, or a Ray actor's method): from
    any thread; a notice that comes before the job runs is kept for it."""
    global _PENDING_REASON
    _PENDING_REASON = _PENDING_REASON or reason
    for notice in list(_NOTICES):
        notice.notify(reason)


def notify_watching_jobs(reason: str) -> bool:
    """Tell this process's jobs that watch ``ctx.should_stop`` and were not told yet; whether
    there was one (a Ray actor's SIGTERM handler: otherwise Ray's own handles it)."""
    watching = [n for n in _NOTICES if n.watched and n.seconds_left is None]
    for notice in watching:
        notice.notify(reason)
    return bool(watching)


def listen_for_stop_notice() -> None:
    """From the rank's first moment, the launcher's notice is taken (never SIGUSR2's default,
    which ends the process); only the main thread can install it."""
    try:
        signal.signal(STOP_NOTICE_SIGNAL, lambda _s, _f: notify_stop("the launcher's stop notice"))
    except ValueError:
        pass


class StopNotice:
    """``ctx.should_stop``: true once the launcher (a preemption, Ctrl-C, ``launch stop``) or the
    rank's host (SIGTERM: a spot VM going away, a scheduler's signal) asked the job to stop. The
    job saves at its next step boundary and returns; ``seconds_left`` says how long it has.

    SIGTERM counts as a notice only once the job has read ``should_stop`` (or registered
    ``on_stop``): a job that never looks is stopped by it at once, as before. ``on_stop``'s
    callback runs in the rank the notice reached, as it came; ``should_stop`` is the group's."""

    def __init__(self, grace_s: float, world_size: int = 1) -> None:
        self.grace_s = grace_s
        self.world_size = world_size
        self._agreed = False
        self._pending: tuple[Any, Any] | None = None
        self._world_group: Any = None
        self.reason = ""
        self.watched = False
        self._at: float | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._previous_term: Any = None
        self.on_watch: Callable[[], None] = lambda: None

    def __enter__(self) -> "StopNotice":
        _NOTICES.append(self)
        if _PENDING_REASON:
            self.notify(_PENDING_REASON)
        return self

    def _watch(self) -> None:
        """The job looks at the notice: from now on a SIGTERM is one. Not before: a Python-level
        handler waits for the main thread to leave C++ (a rank blocked in a collective would
        outlive its SIGTERM), so a job that never looks keeps SIGTERM's default, instant end."""
        if self.watched:
            return
        self.watched = True
        self.on_watch()  # the launcher hears of it at once (its next beacon), not half a second later
        if _NOTICES and _NOTICES[-1] is self:
            try:
                self._previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
            except ValueError:  # not the main thread (a Ray actor's): the launcher's notice still comes
                pass

    def __exit__(self, *_exc: Any) -> None:
        if self._pending is not None:  # every rank posted it: let it finish before the group goes
            try:
                self._pending[0].wait()
            except Exception:  # noqa: BLE001 - a peer that failed: its loss is reported elsewhere
                pass
        _NOTICES.remove(self)
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._at is None:
            self.notify("SIGTERM")
            return
        previous = self._previous_term
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # the default: end now

    def notify(self, reason: str) -> None:
        if self._at is not None:
            return
        self._at, self.reason = time.monotonic(), reason
        for callback in self._callbacks:
            callback()

    @property
    def requested(self) -> bool:
        """Whether the job should stop now, the same answer on every rank at the same call (read
        once per step, on every rank, like a collective): each call posts this rank's flag in a
        small asynchronous all-reduce over the CPU (gloo) and reads the one the call before posted,
        long done by then. A notice is acted on one step after it came; no device sync, no wait."""
        self._watch()
        if self._agreed:
            return True
        group = self._group()
        if group is None:
            self._agreed = self._at is not None
            return self._agreed
        import torch
        import torch.distributed as dist

        flag = None
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._agreed = bool(flag.item())  # a CPU tensor: no device sync
        if self._agreed:
            self._pending = None
            return True
        if flag is None:
            flag = torch.zeros(1, dtype=torch.int32)
        flag.fill_(1 if self._at is not None else 0)  # the same small tensor every call: its all-reduce is done
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True), flag)
        return False

    def regroup(self) -> None:
        """The group re-formed after a rank was replaced in place: the flag posted on the old one
        is dropped (it cannot complete), and the next call posts on the new group, as every
        rank's next call does, the replacement's first included."""
        self._pending = None
        self._world_group = None

    def _group(self) -> Any:
        """The process group the flags travel on: the job's own when it is gloo, else a gloo group
        of the same ranks, made at the first call (every rank's first call: a collective)."""
        if self._world_group is None:
            import torch.distributed as dist

            if self.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
                self._world_group = False
            elif dist.get_backend() == "gloo":
                self._world_group = dist.group.WORLD
            else:
                self._world_group = dist.new_group(backend="gloo")
        return self._world_group or None

    @property
    def seconds_left(self) -> float | None:
        """Seconds until the launcher stops the ranks anyway; None while no stop was asked for."""
        return None if self._at is None else max(0.0, self.grace_s - (time.monotonic() - self._at))

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when a notice comes (in the main thread, between two bytecodes, for a
        signal; in the notifying thread otherwise)."""
        self._watch()
        self._callbacks.append(callback)


class Checkpoints:
    """``ctx.checkpoint``: save and load through the stage's checkpoint directory (module doc)."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: Any,
        on_saved: Callable[[int, int], None] = lambda step, at: None,
        on_resumed: Callable[[int], None] = lambda step: None,
        steps_done: Callable[[], int] = lambda: 0,
    ) -> None:
        self.root = Path(config.checkpoint_dir) if config.checkpoint_dir else config.paths.checkpoints
        self.keep = config.checkpoint_keep
        self._config = config
        self.rank, self.world_size, self.local_rank, self.device = rank, world_size, local_rank, device
        self._on_saved, self._on_resumed, self._steps_done = on_saved, on_resumed, steps_done
        self.async_save = config.checkpoint_async_save
        self._writer: ThreadPoolExecutor | None = None  # the background write's thread (async_save)
        self._staged: Any = None  # the last background write's host copy, reused by the next save (async_save)
        self._in_flight: Future[Any] | None = None
        self.write_s = 0.0  # seconds the background writes took, off the step's path
        self._leaders: list[int] | None = None
        self._leader_group: Any = None
        self._shared: bool | None = None
        self.last_step: int | None = None  # the last step saved, or resumed from
        self.resumed_step: int | None = None
        self.save_s = self.load_s = 0.0
        # recovery in place (``launcher.runtime.inplace``): the worker's seam to its group and its
        # metrics; ``joining``: the generation this rank replaces a lost one in, until ``in_place``
        self.seam: Any = None
        self.metrics: Any = None
        self.joining = 0
        self.live: Any = None  # the job's ``in_place`` (a save broken by a lost peer recovers through it)

    # --- recovery in place ---------------------------------------------------------------------
    def in_place(self, model: Any, optimizer: Any, wrap: Callable[[Any], Any], *, step: int = 0, wait_s: float = 30.0) -> Any:
        """Opt in to recovery in place: returns ``live``, whose ``live.model`` is ``wrap(model)``
        (the job's DDP model, built here and again after a recovery), ``live.step`` the completed
        steps to go on from (``step`` on a start; the peers' count in a rank that replaced a lost
        one), and ``live.run(step_fn, *args)`` runs one step: a rank lost under it is replaced
        while the others keep their processes, the state comes from a survivor's memory, and the
        step is done again if it had not completed. Call it on every rank, after ``load()``, in
        place of building the DDP model. Where the loss cannot be recovered in place (another
        backend, a lost host, no replacement within ``wait_s`` seconds) the error goes on and
        the restart path runs as without it. Every DDP model it builds gets its gradient buckets
        up front (``fix_buckets``): the survivors' rebuilt model reduces its first step as the old
        one reduced its last, so the run stays bit for bit at any world size.
        ``launcher.runtime.inplace`` has the whole story."""
        from launcher.runtime.inplace import GroupSeam, InPlace

        def fixed(raw: Any) -> Any:
            return self.fix_buckets(wrap(raw))

        seam = self.seam or GroupSeam(stage_dir=self._config.paths.root, attempt=self._config.attempt, restart="0", store=None, form=lambda gen: None)
        if self.seam is not None:
            seam.on_regroup.append(self._regrouped)
        gen, self.joining = self.joining, 0
        self.live = InPlace(model, optimizer, fixed, step=step, wait_s=wait_s, rank=self.rank, world_size=self.world_size,
                            seam=seam, metrics=self.metrics, gen=gen if self.seam is not None else 0, layout=(self.carried_layout, self.take_layout))  # fmt: skip
        return self.live

    def _regrouped(self) -> None:
        """The group changed under it. On one host (where recovery in place runs) the layout it
        asked the group for stays true, and the replacement takes it with the state
        (``carried_layout``): asking again would put a collective in the next ``save``, outside
        the job's ``live.run``, where a peer lost during it fails the survivor instead of being
        recovered (seen in the goodput soak). A leaders' group belongs to the old group: then the
        layout is asked again, by every rank (the replacement has none)."""
        if self._leader_group is not None:
            self._leaders, self._leader_group, self._shared = None, None, None

    def carried_layout(self) -> dict[str, Any] | None:
        """The layout a survivor sends a replacement with the state (None: not asked yet, then
        every rank asks at its first save, the replacement too)."""
        if self._leaders is None or self._leader_group is not None:
            return None
        return {"leaders": list(self._leaders), "shared": self._shared}

    def take_layout(self, carried: Any) -> None:
        """A replacement's layout, from the survivor that sent its state (``carried_layout``)."""
        if isinstance(carried, dict) and isinstance(carried.get("leaders"), list):
            self._leaders, self._shared = [int(r) for r in carried["leaders"]], carried.get("shared")

    # --- a DDP model that resumes bit for bit ------------------------------------------------------
    def fix_buckets(self, ddp: Any) -> Any:
        """Give ``ddp`` (a ``DistributedDataParallel`` just built, before its first forward) its
        final gradient-bucket layout now, the same at every step of every attempt; returns it.

        DDP reduces its first step in one layout and, from its second on, in buckets rebuilt in
        the order the gradients became ready; a resumed run's first step is DDP's first again, so
        it reduced in the other layout. At 3 ranks and more an all-reduce sums each element in
        an order set by its place in the bucket, and floating-point sums in another order differ
        in the last bits: the resumed model drifts from the uninterrupted one. Here the buckets
        are rebuilt at once, in parameter order (DDP's own bucket sizes), and never again: no
        cost per step measured on the CPU; but DDP starts its buckets' all-reduces in their
        order, and the first bucket (the first layers) is ready last in the backward, so on a GPU
        a model of several buckets overlaps less of its all-reduces with the backward. Call it on
        a fresh run and a resumed one alike, before the first forward. At 1 or 2 ranks (a sum of
        two has one result), with ``find_unused_parameters=True`` (DDP never rebuilds then) or on
        a torch without the reducer's hooks for it (a warning), the model is left as it is."""
        reducer = getattr(ddp, "reducer", None)
        if self.world_size <= 2 or reducer is None or getattr(ddp, "_has_rebuilt_buckets", False):
            return ddp
        if not (hasattr(reducer, "_push_all_rebuilt_params") and hasattr(reducer, "_rebuild_buckets")):
            import warnings

            warnings.warn("ctx.checkpoint.fix_buckets: this torch's DDP reducer cannot be given its buckets up front; "
                          "a resumed run may differ from an uninterrupted one in the last bits", stacklevel=2)  # fmt: skip
            return ddp
        reducer._push_all_rebuilt_params()  # every parameter, in order, as if its gradient had come
        if reducer._rebuild_buckets():  # a collective: rank 0's layout, on every rank
            ddp._has_rebuilt_buckets = True
        return ddp

    # --- the group's layout ------------------------------------------------------------------
    def _dist(self) -> Any:
        import torch.distributed as dist

        return dist if self.world_size > 1 and dist.is_available() and dist.is_initialized() else None

    def _layout(self) -> list[int]:
        """The node leaders (each host's local rank 0), known to every rank; a collective, once."""
        if self._leaders is None:
            dist = self._dist()
            if dist is None:
                self._leaders = [self.rank]
            else:
                local_ranks: list[Any] = [None] * self.world_size
                dist.all_gather_object(local_ranks, self.local_rank)
                self._leaders = [r for r, lr in enumerate(local_ranks) if lr == 0]
                if len(self._leaders) > 1:
                    self._leader_group = dist.new_group(self._leaders)
        return self._leaders

    def _shared_dir(self) -> bool:
        """Whether every host sees rank 0's checkpoint directory (a shared filesystem): one write
        then serves all. Asked once, with a file rank 0 creates and the other leaders look for."""
        if self._shared is None:
            leaders = self._layout()
            dist = self._dist()
            if dist is None or len(leaders) == 1:
                self._shared = True
                return True
            probe = self.root / f".probe-{self._config.run_id}-{self._config.attempt}"
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                probe.touch()
            dist.barrier()
            seen: list[Any] = [None] * self.world_size
            dist.all_gather_object(seen, probe.exists() if self.rank in leaders else True)
            dist.barrier()
            if self.rank == 0:
                probe.unlink(missing_ok=True)
            self._shared = all(seen)
        return self._shared

    # --- save ----------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], *, step: int, sharded: bool = False) -> Path | None:
        """Save ``state`` (tensors and plain values) as the checkpoint of ``step``; every rank
        calls it. Returns the checkpoint's directory on this rank's host, or None where this rank
        writes nothing. The newest ``checkpoint.keep`` stay."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"ctx.checkpoint.save: step must be an int >= 0, not {step!r}")
        started = time.perf_counter()
        self.wait()  # one write in flight at a time; a failed one fails this save
        at = self._steps_done()
        if sharded:
            folder = self._save_sharded(state, step)
            self._saved(step, at)
        else:
            try:
                folder = self._save_replicated(state, step, at)
            except RuntimeError as exc:
                if self.live is None or not self.live.recovered_between_steps(exc):
                    raise
                # over several hosts a save broadcasts to each host's writer, outside the job's
                # live.run: a peer lost there is recovered here, and this checkpoint given up (the
                # state is in every rank's memory; the next save is the durable one)
                print(f"gpulaunch: the checkpoint of step {step} was cut short by a lost rank, recovered in place: not saved", file=sys.stderr, flush=True)
                folder = None
        self.save_s += time.perf_counter() - started
        return folder

    def _saved(self, step: int, at: int) -> None:
        self.last_step = step
        self._on_saved(step, at)

    def wait(self, *, raise_error: bool = True, timeout_s: float | None = None) -> None:
        """Until the background write in flight (``checkpoint.async_save``) is published, or
        ``timeout_s`` passed; its error, if it failed (``raise_error``: else it is dropped, as on
        a failing rank's way out, which waits no longer than its stop grace)."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return
        try:
            pending.result(timeout=timeout_s)
        except Exception as exc:
            if raise_error:
                raise CheckpointError(f"ctx.checkpoint: the background write of a checkpoint failed: {type(exc).__name__}: {exc}") from exc

    def _submit(self, step: int, at: int, write: Callable[[], Path]) -> Path:
        def run() -> Path:
            started = time.perf_counter()
            folder = write()
            self.write_s += time.perf_counter() - started
            self._saved(step, at)
            return folder

        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="gpulaunch-checkpoint")
        self._in_flight = self._writer.submit(run)
        return step_dir(self.root, step)

    def _manifest(self, step: int, fmt: str, files: Mapping[str, FileDigest]) -> Manifest:
        c = self._config
        return Manifest(step, c.job, c.job_identity, fmt, self.world_size, time.time(), c.run_id, c.attempt, dict(files))

    def _save_replicated(self, state: Mapping[str, Any], step: int, at: int) -> Path | None:
        """What must happen now happens now (with ``async_save``, rank 0's copy of its state to host
        memory; a broadcast to the other hosts' writers is a collective either way); the file is
        written now or, with ``async_save``, on the writer thread. Returns where the checkpoint is
        (or will be), or None where this rank writes nothing."""
        import torch

        write: Callable[[], Path] | None = None
        if self._shared_dir():  # one host, or one filesystem for all: rank 0 writes the one copy
            if self.rank == 0:
                # the previous write is published (save waited for it): its copy takes this one's values
                snapshot = host_copy(state, reuse=self._staged) if self.async_save else state
                self._staged = snapshot if self.async_save else None
                write = lambda: self._write_stream(torch, snapshot, step)  # noqa: E731
        elif self.rank in self._layout():
            payload: list[Any] = [None]
            if self.rank == 0:
                buffer = io.BytesIO()
                torch.save(state, buffer)
                payload = [buffer.getvalue()]
            self._dist().broadcast_object_list(payload, src=0, group=self._leader_group)
            data: bytes = payload[0]
            write = lambda: self._write_bytes(data, step)  # noqa: E731
        if write is None or not self.async_save:
            folder = write() if write is not None else None
            self._saved(step, at)
            return folder
        return self._submit(step, at, write)

    def _partial(self, step: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        partial = partial_dir(self.root, step, f"{os.uname().nodename}-{os.getpid()}")
        partial.mkdir()
        return partial

    def _write_stream(self, torch: Any, state: Mapping[str, Any], step: int) -> Path:
        """torch's own writer to the file (its fastest path), then the file's digest, read back
        from the page cache, on a helper thread while the file goes to disk (fsync)."""
        partial = self._partial(step)
        path = partial / STATE_FILE
        torch.save(state, path)
        with ThreadPoolExecutor(1) as pool:
            digest = pool.submit(file_digest, path)
            fsync_path(path)
            return self._publish(partial, step, {STATE_FILE: digest.result()})

    def _write_bytes(self, payload: bytes, step: int) -> Path:
        partial = self._partial(step)
        with ThreadPoolExecutor(1) as pool:
            digest = pool.submit(digest_of, payload)  # beside the write and its fsync (both let go of the GIL)
            with open(partial / STATE_FILE, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            return self._publish(partial, step, {STATE_FILE: digest.result()})

    def _publish(self, partial: Path, step: int, files: Mapping[str, FileDigest], fmt: str = "torch") -> Path:
        write_manifest(partial, self._manifest(step, fmt, files))
        final = step_dir(self.root, step)
        publish(partial, final)
        prune(self.root, self.keep)
        return final

    def _save_sharded(self, state: Mapping[str, Any], step: int) -> Path | None:
        import torch.distributed.checkpoint as dcp

        dist = self._dist()
        if not self._shared_dir():
            raise CheckpointError(
                f"checkpoint.dir {self.root}: sharded checkpoints need a directory every host shares (a shared filesystem); "
                "set checkpoint.dir to one, or save replicated state (sharded=False)"
            )
        partial = partial_dir(self.root, step, f"{self._config.run_id}-a{self._config.attempt}")
        if self.rank == 0:
            partial.mkdir(parents=True, exist_ok=True)
        if dist is not None:
            dist.barrier()
        dcp.save(dict(state), checkpoint_id=str(partial))
        # each rank digests the files it wrote (rank 0 also the metadata), side by side
        mine = {p.name: file_digest(p) for p in partial.iterdir() if p.name.startswith(f"__{self.rank}_") or (self.rank == 0 and not p.name.startswith("__"))}
        every: list[Any] = [mine]
        if dist is not None:
            every = [None] * self.world_size
            dist.all_gather_object(every, mine)
        if self.rank != 0:
            return None
        files = {name: digest for part in every for name, digest in part.items()}
        return self._publish(partial, step, files, fmt="dcp")

    # --- load ----------------------------------------------------------------------------------
    def load(self, state: Mapping[str, Any] | None = None, *, source: str | Path | None = None, map_location: Any = None) -> Restored | None:
        """The newest complete checkpoint of this job (or the one at ``source``: a ``step-*``
        directory or a checkpoint directory), on ``map_location`` (default: this rank's device);
        None when there is none. Every rank calls it. A sharded checkpoint loads into ``state``
        (its tensors are filled in place, resharded to this world size) and returns it."""
        if self.joining:
            return None  # a replacement: its state comes from a peer in ``in_place``, its peers load nothing now
        self.wait()  # a write in flight is the newest checkpoint once published
        started = time.perf_counter()
        root = Path(source).expanduser() if source is not None else self.root
        found = self._find(root)
        steps = self._gather(found[0].step if found else -1)
        best = max(steps)
        if best < 0 and source is not None:  # asked for one by name: never a silent fresh start
            raise CheckpointError(f"checkpoint {root}: no complete checkpoint there (a step-* folder with its manifest), on any rank's host")
        if best < 0:
            return None
        source_rank = steps.index(best)
        manifest, where = self._broadcast((found[0], str(found[1])) if found and self.rank == source_rank else None, source_rank)
        folder = Path(where)  # the same path on every host
        if manifest.format == "dcp":
            restored = self._load_sharded(state, folder, manifest)
        else:
            payload = self._payload(folder, steps, best, source_rank, keep_copy=root == self.root)
            restored = self._load_bytes(payload, manifest, folder, map_location)
        self.load_s += time.perf_counter() - started
        if self.last_step is None:  # the attempt's first checkpoint: what it resumed from (not a read-back of its own)
            self.resumed_step = best
            self._on_resumed(best)
        self.last_step = best
        return restored

    def _find(self, root: Path) -> tuple[Manifest, Path] | None:
        """The newest checkpoint this rank sees (its manifest read, its files verified when they
        are read): a ``step-*`` folder given as ``root`` is taken as is. Every rank looks, so a
        rank that sees no copy where its host's others do (a container's own /tmp) is served too."""
        if (root / MANIFEST).exists():
            return Manifest.read(root), root
        if root == self.root and self.rank in self._layout():
            drop_partials(root)  # no one writes while the group loads
        return latest(root, self._config.job_identity, verify_files=False)

    def _gather(self, value: int) -> list[int]:
        dist = self._dist()
        if dist is None:
            return [value]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, value)
        return [int(v) for v in every]

    def _broadcast(self, value: Any, src: int, group: Any = None) -> Any:
        dist = self._dist()
        if dist is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def _payload(self, folder: Path, steps: list[int], best: int, source_rank: int, *, keep_copy: bool) -> bytes:
        """The checkpoint's bytes on every rank, verified: each reads its own copy when every rank
        sees one, else the first rank that has it reads it and sends it to all; a host's leader
        that had none keeps a copy (``keep_copy``), so a later restart there finds it."""
        leaders = self._layout()
        if all(step == best for step in steps):
            return _read_state(folder)
        payload = self._broadcast(_read_state(folder) if self.rank == source_rank else None, source_rank)
        if keep_copy and self.rank in leaders and steps[self.rank] != best:
            self._write_bytes(payload, best)
        return payload

    def _load_bytes(self, payload: bytes, manifest: Manifest, folder: Path, map_location: Any) -> Restored:
        """The state, parsed while a helper thread checks the bytes against the manifest's digest:
        it is handed to the job only once they match (a parse of bytes that do not is not trusted)."""
        import torch

        path, expected = folder / STATE_FILE, manifest.files.get(STATE_FILE)
        with ThreadPoolExecutor(1) as pool:
            digest = pool.submit(digest_of, payload)
            try:
                state = torch.load(io.BytesIO(payload), map_location=map_location or self.device, weights_only=True)
            except Exception:
                _check_digest(path, folder, expected, digest.result())  # changed bytes: say that, not what the parse made of them
                raise
            _check_digest(path, folder, expected, digest.result())
        return Restored(state, manifest.step, folder, manifest)

    def _load_sharded(self, state: Mapping[str, Any] | None, folder: Path, manifest: Manifest) -> Restored:
        import torch.distributed.checkpoint as dcp

        if state is None:
            raise CheckpointError(f"checkpoint {folder}: a sharded checkpoint loads into the state it fills: call ctx.checkpoint.load(state)")
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {folder}: not on this host; sharded checkpoints need a checkpoint.dir every host shares")
        check_files(folder, Manifest.read(folder)) if self.rank == 0 else None
        dcp.load(state, checkpoint_id=str(folder))
        return Restored(state, manifest.step, folder, manifest)


def _read_state(folder: Path) -> bytes:
    """The state file of a replicated checkpoint (checked against its digest as it is parsed)."""
    path = folder / STATE_FILE
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read it ({exc.strerror or exc}); delete {folder} to drop the checkpoint") from None


def _check_digest(path: Path, folder: Path, expected: FileDigest | None, got: FileDigest) -> None:
    if expected is None or got != expected:
        raise CheckpointError(f"checkpoint {path}: its contents differ from its manifest (sha256 {got.sha256[:12]}...); delete {folder} to drop the checkpoint")


def host_copy(value: Any, reuse: Any = None) -> Any:
    """``value`` (a state dict: tensors in nested dicts, lists and tuples, plain values) with every
    tensor copied to host memory, detached: what a background write may read while the job's own
    tensors change under it. Plain values are shared (they are not changed in place by a step).

    ``reuse``: an earlier copy of a state of the same layout that nothing reads any more (the
    previous background write's, published): each tensor is copied into its counterpart where
    shape, dtype and strides match, instead of into new memory, whose first touch (a page fault
    per page) is most of a copy: 0.15 s against 0.04-0.06 s for 301.6 MB here.

    A CUDA tensor goes to pinned host memory (kept from save to save through ``reuse``), all the
    device's copies queued at once and waited for once, at the end: pageable memory halves the
    copy's speed and makes each copy wait for the last (PCIe5: 55 against 15 GB/s on an H200)."""
    import torch

    from launcher.runtime.peerstate import wait_for_copies

    devices: set[Any] = set()
    copied = _host_copy(torch, value, reuse, devices)
    wait_for_copies(devices)
    return copied


def _host_copy(torch: Any, value: Any, reuse: Any, devices: set[Any]) -> Any:
    if isinstance(value, torch.Tensor):
        data = value.detach()
        if data.is_cuda:
            devices.add(data.device)
            target = reuse if _same_layout(reuse, data) and reuse.is_pinned() else torch.empty_like(data, device="cpu", pin_memory=True)
            return target.copy_(data, non_blocking=True)
        if _same_layout(reuse, data):
            return reuse.copy_(data)
        return data.to("cpu", copy=True)
    if isinstance(value, Mapping):
        old = reuse if isinstance(reuse, Mapping) else {}
        pairs = [(k, _host_copy(torch, v, old.get(k), devices)) for k, v in value.items()]
        copied = OrderedDict(pairs) if isinstance(value, OrderedDict) else dict(pairs)
        if hasattr(value, "_metadata"):  # a module's state_dict: its versions, which load_state_dict reads
            copied._metadata = value._metadata  # type: ignore[attr-defined]
        return copied
    if isinstance(value, (list, tuple)):
        earlier = list(reuse) if isinstance(reuse, (list, tuple)) and len(reuse) == len(value) else [None] * len(value)
        items = [_host_copy(torch, v, r, devices) for v, r in zip(value, earlier)]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _same_layout(buffer: Any, tensor: Any) -> bool:
    """Whether ``buffer`` (a host tensor) can take ``tensor``'s values as they are."""
    import torch

    return (
        isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and buffer.layout == torch.strided == tensor.layout
        and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype and buffer.stride() == tensor.stride()
        and buffer.data_ptr() != tensor.data_ptr()
    )  # fmt: skip
