"""The runtime inside every rank, shared by all backends.

``python -m launcher.runtime.worker STAGE/worker.json`` is what torchrun starts (``forked_rank`` when
ranks are forked from a forkserver); Ray actors call ``run_rank`` directly. Either way a rank:
records its start-up phases, initialises the process group on its own device, runs the job's
entrypoint (or a torchrun script, unchanged), turns any exception into a report with its
traceback (no decorator needed in user code) and writes that report atomically. Heavy imports
(torch, the job) happen after the phase clock has started.
"""

from __future__ import annotations

import time

_T_STARTED = time.time()

import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Mapping, Sequence  # noqa: E402

from launcher.procutil import (  # noqa: E402
    die_with_parent,
    fast_exit,
    process_spawn_time,
    process_start_ticks,
    write_json_atomic,
)
from launcher.protocol import (  # noqa: E402
    ENV_AGENT_PID,
    ENV_HOST,
    ENV_RANK_DEVICE,
    ENV_RANK_SERVER_PID,
    CheckpointActivity,
    RankError,
    RankReport,
    RankStatus,
    StagePaths,
    WorkerConfig,
    is_peer_loss,
    rank_device,
)
from launcher.runtime.checkpoint import listen_for_stop_notice  # noqa: E402
from launcher.runtime.entry import load_entrypoint  # noqa: E402
from launcher.runtime.rendezvous_store import AGENT_STORE_ENV, serve_store, torch_store  # noqa: E402
from launcher.runtime.hangdump import RankAccount, enable_flight_recorder  # noqa: E402


class ProgressBeacon:
    """Writes this rank's phase and step count to a small file twice a second.

    The launcher's progress display reads these files; the worker never syncs the device for it
    (the step count is a host integer kept by the metrics recorder).
    """

    def __init__(self, path: Path, interval_s: float = 0.5) -> None:
        self.path = path
        self.phase = "starting"
        self.steps: Callable[[], int] = lambda: 0
        self.work_s: Callable[[], float | None] = lambda: None  # own work per step, recent median
        self.work_spread: Callable[[], tuple[float | None, int]] = lambda: (None, 0)  # its spread, and over how many steps
        self._stop = threading.Event()
        self._interval = interval_s
        self._identity = {"pid": os.getpid(), "pid_start": process_start_ticks()}  # see stage_worker_pids
        self._thread = threading.Thread(target=self._loop, name="gpulaunch-progress", daemon=True)
        self.on_tick: Callable[[], None] = lambda: None  # after each write (a stall's request is answered here)
        self.extra: dict[str, Any] = {}  # the checkpoints' fields (RankProgress)
        self.watches_stop: Callable[[], bool] = lambda: False  # the job reads ctx.should_stop
        self.stamps: Callable[[], Mapping[str, float]] = dict  # the rank's phase stamps so far (RankProgress.phases)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def write(self) -> None:
        try:
            beacon = {**self._identity, **self.extra, "phase": self.phase, "steps": self.steps(), "t": time.time()}
            if self.watches_stop():
                beacon["watches_stop"] = True
            stamps = dict(self.stamps())  # a copy: the rank's thread adds stamps meanwhile
            if stamps:
                beacon["phases"] = {k: round(v, 4) for k, v in stamps.items()}
            work_s = self.work_s()
            if work_s is not None:
                mad, steps = self.work_spread()
                beacon.update(work_s=round(work_s, 6), work_n=steps)
                if mad is not None:
                    beacon["work_mad_s"] = round(mad, 6)
            write_json_atomic(self.path, beacon, durable=False)
        except Exception:  # noqa: BLE001 - progress is best effort; the report is what counts
            pass

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.write()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.write()
            try:
                self.on_tick()
            except Exception:  # noqa: BLE001 - the beacon must outlive a failed answer
                pass

    def stop(self) -> None:
        self._stop.set()
        self.write()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _error(exc: BaseException) -> RankError:
    return RankError(
        type=type(exc).__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        time=time.time(),
    )


def _new_report(config: WorkerConfig, env: Mapping[str, str], phases: dict[str, float]) -> RankReport:
    local_rank = int(env["LOCAL_RANK"])
    return RankReport(
        rank=int(env["RANK"]),
        local_rank=local_rank,
        node_rank=int(env.get("GROUP_RANK", "0")),
        world_size=int(env["WORLD_SIZE"]),
        host=env.get(ENV_HOST) or socket.gethostname(),
        device=env.get(ENV_RANK_DEVICE) or rank_device(config.device_type, local_rank, config.ranks_per_gpu),
        phases=phases,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        # where this rank met the others: lets a reader check that concurrent jobs never share one
        rendezvous=f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}",
    )


class _Rank:
    """One rank's run, phase by phase: imports, device, the group, the job, the report."""

    def __init__(self, config: WorkerConfig, env: Mapping[str, str], phases: dict[str, float]) -> None:
        self.config = config
        self.env = env
        self.phases = phases
        self.report = _new_report(config, env, phases)
        self.paths = StagePaths(Path(config.stage_dir))
        self.beacon = ProgressBeacon(self.paths.progress(self.report.rank))
        self.beacon.stamps = lambda: self.phases
        self.beacon.on_tick = RankAccount(self.paths, self.report.rank, phases).maybe_answer
        self.recorder: Any = None
        self.dist: Any = None
        self.undo_ddp_timing: Callable[[], None] = lambda: None
        self.store: Any = None  # the stage's store this rank joined on (a replacement in place joins on it too)
        self.group_sockets: dict[int, str] = {}  # the process group's own sockets (recovery in place shuts them down)
        self.store_server: Any = None  # rank 0's own store, where no agent hosts one (serve_own_store)
        self.set_agent_store = False  # this rank set TORCHELASTIC_USE_AGENT_STORE (serve_own_store)

    def prepare(self, step_hooks: Sequence[Callable[[int, float], None]]) -> tuple[Any, Any]:
        """Import torch and the job, pick the device, make the recorder: (entry function, device)."""
        self.beacon.set_phase("importing")
        import torch
        import torch.distributed as dist

        self.dist = dist
        if self.config.threads_per_worker is not None:  # None: the spec's OMP_NUM_THREADS, read by torch itself
            torch.set_num_threads(self.config.threads_per_worker)
        entry = load_entrypoint(self.config.entrypoint) if self.config.entrypoint else None
        self.phases["imported"] = time.time()
        device = _select_device(torch, self.config, self.report.device, self.report.local_rank)
        self.report.device = str(device)
        from launcher.runtime.metrics import MetricsRecorder
        from launcher.runtime.stepcount import StepCounter, counter_path

        counter = StepCounter.create(counter_path(self.paths, self.report.rank))  # its host reads it once the rank is gone
        recorder = MetricsRecorder(device, on_first_step=lambda: self.phases.setdefault("first_step", time.time()), step_counter=counter)
        for hook in step_hooks:
            recorder.add_step_hook(hook)
        self.recorder = recorder
        self.beacon.steps = self._steps_done
        self.beacon.work_s = recorder.work_clock.recent
        self.beacon.work_spread = recorder.work_clock.spread
        if self.report.world_size > 1 and self.config.time_ddp:  # every DDP model the job builds reports its own work per step
            self.undo_ddp_timing = _time_ddp_models(recorder.work_clock)  # undone in finish()
        return entry, device

    def _prepare(self) -> Any:
        """What the job's ``prepare(params)`` returns, called just before its entrypoint (so its
        time is the job's, as a model built inside ``run`` is); a warm spare that became this
        rank ran it before it had a rank, and it is not run again."""
        from launcher.runtime.spare import NOT_PREPARED, take_prepared

        prepared = take_prepared()
        if prepared is NOT_PREPARED:
            prepared = load_entrypoint(self.config.prepare)(self.config.params) if self.config.prepare else None
        return prepared

    def serve_own_store(self) -> None:
        """Where no agent hosts the stage's store (Ray's ranks; torchrun's agent of node 0 hosts it
        for its ranks), rank 0 serves it, as torch's env:// rendezvous would, but listening on the
        rendezvous address alone where it can (``serve_store``: torch binds every interface);
        then every rank, this one and a ``script:``'s own ``init_process_group`` included, joins
        it as a client, as under torchrun (``TORCHELASTIC_USE_AGENT_STORE``). Every rank sets the
        flag, whatever rank 0 could bind: a torch that prefixes the agent's store by attempt
        (``TORCHELASTIC_RESTART_COUNT``) then prefixes it alike on every rank."""
        if os.environ.get(AGENT_STORE_ENV) == "True" or not os.environ.get("MASTER_ADDR"):
            return
        if self.report.rank == 0:
            from datetime import timedelta

            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            timeout = timedelta(seconds=self.config.rendezvous_timeout_s)
            use_libuv = os.environ.get("USE_LIBUV", "1") == "1"  # as torch's env:// reads it
            self.store_server = serve_store(addr, port, timeout, use_libuv=use_libuv) or torch_store(addr, port, timeout, use_libuv)
        os.environ[AGENT_STORE_ENV] = "True"  # until finish(): a Ray actor may run another rank
        os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
        self.set_agent_store = True

    def join_group(self, device: Any) -> None:
        from launcher.runtime.inplace import arrived_key, group_prefix, joining_gen

        self.beacon.set_phase("rendezvous")
        joined = _rendezvous(self.dist, self.config)
        self.store = joined[0]
        self.phases["joined"] = time.time()  # every rank has arrived
        self.beacon.set_phase("pg_init")
        enable_flight_recorder(_torch_version())  # which collective each rank is in, should the stage stall
        gen = joining_gen(self.env)  # a replacement in place joins its survivors' new generation of the group
        if gen:
            self.store.set(arrived_key(self._restart, gen, joined[1]), "1")
        self.group_sockets = _init_group(self.dist, self.config, device, *joined, prefix=group_prefix(self._restart, gen))
        # Every rank past init before any goes on: a rank whose job ends at once would otherwise
        # destroy its group while a peer the machine has not scheduled yet is still connecting
        # (gloo's connectFullMesh then fails with "Connection closed by peer").
        store, rank, world_size = joined
        _wait_for_every_rank(self.dist, store, rank, world_size, self.config.rendezvous_timeout_s, phase="grouped", hold_store=rank == 0)
        self.phases["pg_ready"] = time.time()

    @property
    def _restart(self) -> str:
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def _seam(self, checkpoint: Any, notice: Any, device: Any) -> None:
        """Recovery in place where a keeper replaces a lost rank: the node's agent
        (``launcher.runtime.keeper``) or the launcher (Ray's driver: ``KEEPER_LAUNCHER``);
        ``ctx.checkpoint.in_place`` re-forms the group through this rank's own set-up."""
        from launcher.runtime.inplace import ENV_KEEPER, KEEPER_LAUNCHER, GroupSeam, joining_gen

        checkpoint.metrics = self.recorder
        if os.environ.get(ENV_KEEPER) not in ("1", KEEPER_LAUNCHER) or self.store is None:
            return
        r = self.report

        def form(gen: int) -> None:
            from launcher.runtime.inplace import group_prefix

            self.group_sockets = _init_group(self.dist, self.config, device, self.store, r.rank, r.world_size, prefix=group_prefix(self._restart, gen))

        timeout_s = self.config.collective_timeout_s or _default_collective_timeout(self.config.pg_backend).total_seconds()
        checkpoint.seam = GroupSeam(
            stage_dir=self.paths.root, attempt=self.config.attempt, restart=self._restart, store=self.store, form=form,
            collective_timeout_s=timeout_s, sockets=lambda: self.group_sockets,
        )
        checkpoint.seam.on_regroup.append(notice.regroup)
        checkpoint.joining = joining_gen(self.env)

    def run_entry(self, entry: Callable[[Any], Any], device: Any) -> None:
        from launcher.runtime.checkpoint import Checkpoints, StopNotice

        r = self.report
        notice = StopNotice(self.config.stop_grace_s, r.world_size)
        self.beacon.watches_stop = lambda: notice.watched
        notice.on_watch = self.beacon.write
        checkpoint = Checkpoints(
            self.config, rank=r.rank, world_size=r.world_size, local_rank=r.local_rank, device=device,
            on_saved=self._saved, on_resumed=self._resumed, steps_done=self._steps_done,
        )  # fmt: skip
        self._seam(checkpoint, notice, device)
        self.beacon.set_phase("running")
        try:
            with notice:  # the job's prepare and entrypoint: a stop notice is theirs to heed
                r.result = _jsonable(entry(self._context(checkpoint, notice, device)))
            checkpoint.wait()  # a background write in flight is published before the rank reports; its failure fails the rank
        finally:
            # the job failed: the write in flight may still make a checkpoint to resume from (within the stop grace)
            checkpoint.wait(raise_error=False, timeout_s=self.config.stop_grace_s)
            r.checkpoint = CheckpointActivity(checkpoint.resumed_step, checkpoint.last_step, round(checkpoint.save_s, 4), round(checkpoint.load_s, 4),
                                              round(checkpoint.write_s, 4))  # fmt: skip
            r.stop_notice = notice.reason or None  # not ``requested``: that is a collective (the group's answer)

    def _context(self, checkpoint: Any, notice: Any, device: Any) -> Any:
        """What the entrypoint receives (``ctx``), its ``prepared`` made now."""
        import torch

        from launcher.runtime.context import WorkerContext

        r = self.report
        return WorkerContext(
            rank=r.rank,
            local_rank=r.local_rank,
            world_size=r.world_size,
            local_world_size=int(self.env.get("LOCAL_WORLD_SIZE", r.world_size)),
            node_rank=r.node_rank,
            host=r.host,
            device=device,
            pg_backend=self.config.pg_backend,
            params=self.config.params,
            metrics=self.recorder,
            stage_dir=self.paths.root,
            threads=torch.get_num_threads(),
            checkpoint=checkpoint,
            stop_notice=notice,
            ranks_per_gpu=self.config.ranks_per_gpu if device.type == "cuda" else 1,
            prepared=self._prepare(),
        )

    def _steps_done(self) -> int:
        """The rank's steps so far, as its beacon says them and a checkpoint is placed among them:
        the job's own count; a DDP job that counts none (a torchrun script, a job that never calls
        ``ctx.metrics.step()``) is counted by its optimizer's steps. (A checkpoint's place counted
        only the job's own: such a job's restart said every step of the attempt lost.)"""
        recorder = self.recorder
        if recorder is None:
            return 0
        return recorder.steps or recorder.work_clock.optimizer_steps

    def _saved(self, step: int, at: int) -> None:
        """A checkpoint published: ``at`` is the rank's step count when the job saved it (a
        background write publishes steps later; what a failure loses counts from ``at``)."""
        self.beacon.extra.update(ckpt_step=step, ckpt_at=at)
        self.beacon.write()

    def _resumed(self, step: int) -> None:
        self.beacon.extra.update(resumed_step=step, ckpt_step=step, ckpt_at=self._steps_done())
        self.beacon.write()

    def _in_place_records(self) -> None:
        """The stage's recoveries in place so far (``in_place/``: every attempt's, on this node),
        in this rank's metrics: ``result.json`` tells each one's story from them."""
        from launcher.runtime.inplace import stage_records

        records = stage_records(self.paths.root)
        if records and self.report.metrics is not None:
            self.report.metrics["in_place"] = records

    def finish(self) -> None:
        """Metrics to the host (kept for a failed rank too), the report written atomically."""
        self.phases["finished"] = time.time()
        self.undo_ddp_timing()  # a Ray actor may run another rank in this process
        if self.recorder is not None:
            try:
                self.report.metrics = self.recorder.to_host()
                self._in_place_records()
            except Exception as exc:  # noqa: BLE001 - a failed rank's device may be unusable
                if self.report.ok:
                    self.report.status, self.report.error = RankStatus.FAILED, _error(exc)
        self.beacon.set_phase("finished" if self.report.ok else "failed")
        self.beacon.stop()
        write_json_atomic(self.paths.report(self.report.rank), self.report.to_dict())
        dist = self.dist
        if dist is not None and dist.is_available() and dist.is_initialized() and self.report.ok:
            dist.destroy_process_group()
        self.store_server = None  # rank 0's store stops listening with its last reference
        if self.set_agent_store:
            os.environ.pop(AGENT_STORE_ENV, None)


# A rank whose collective failed because a peer left waits this long before it says so and
# reports: the process layer (torchrun's agent, every 0.1 s; the Ray backend) stops such ranks as
# collateral meanwhile, so the root cause's traceback is the one the console shows, not followed by
# each peer's "Connection closed by peer" (which a loaded machine lets them print first). A rank
# that is not stopped, say the first to see a lost host, still reports, this much later.
PEER_LOSS_GRACE_S = 2.0


def run_rank(
    config: WorkerConfig,
    env: Mapping[str, str],
    *,
    spawned_at: float | None = None,
    started_at: float | None = None,
    step_hooks: Sequence[Callable[[int, float], None]] = (),
) -> RankReport:
    """Run one rank to completion and return (and write) its report. Never raises for job errors.

    ``step_hooks`` are called as ``hook(steps, host_seconds_since_last_step)`` on every
    ``ctx.metrics.step()`` (the Ray backend exports them as dashboard metrics); host numbers only.
    """
    started = started_at or _T_STARTED
    listen_for_stop_notice()
    phases = {"spawned": spawned_at or started, "started": started}
    from launcher.runtime.inplace import joining_gen

    if joining_gen(env):  # a replacement in place: its start is its own, not the stage's start-up
        phases["replaced"] = phases["spawned"]
    rank = _Rank(config, env, phases)
    rank.beacon.start()
    try:
        entry, device = rank.prepare(step_hooks)
        rank.serve_own_store()
        if entry is None:
            rank.beacon.set_phase("running")
            enable_flight_recorder(_torch_version())  # read when the script makes its process group
            _run_script(config)
        else:
            rank.join_group(device)
            rank.run_entry(entry, device)
        rank.report.status = RankStatus.OK
    except SystemExit as exc:  # a script's sys.exit(): 0/None is success, as under torchrun
        if exc.code in (None, 0):
            rank.report.status = RankStatus.OK
        else:
            rank.report.error = _error(exc)
            traceback.print_exc()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a report
        rank.report.error = _error(exc)
        if rank.report.world_size > 1 and is_peer_loss(rank.report.error):
            rank.beacon.write()  # the step it reached, exact, before it may be stopped in silence
            time.sleep(PEER_LOSS_GRACE_S)  # the usual end: stopped here, as collateral, in silence
        if isinstance(exc, UnfitGpuError):
            print(f"error: {exc}", file=sys.stderr, flush=True)  # a known cause: its line, not a traceback
        else:
            traceback.print_exc()
    finally:
        rank.finish()
    return rank.report


def _time_ddp_models(clock: Any) -> Callable[[], None]:
    """Straggler detection's DDP timing; a torch whose DDP this cannot wrap runs the job untimed."""
    from launcher.runtime.workclock import install_ddp_timing

    try:
        return install_ddp_timing(clock)
    except (AttributeError, KeyError, ImportError) as exc:
        print(f"gpulaunch: DDP models not timed for straggler detection ({type(exc).__name__}: {exc})", file=sys.stderr)
        return lambda: None


def _select_device(torch: Any, config: WorkerConfig, planned: str, local_rank: int) -> Any:
    """The rank's device, as the plan named it (``protocol.rank_device``, or its scheduler's
    choice), made current."""
    device = torch.device(planned)
    if device.type != "cuda":
        return device
    visible = torch.cuda.device_count()
    if device.index >= visible:
        raise RuntimeError(
            f"local rank {local_rank} was given {device} but this process sees {visible} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    if config.gpu_health:  # before this process makes a context on it
        from launcher.hardware.nvml import granted_gpu_problems

        problems = granted_gpu_problems(device.index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if problems:
            raise UnfitGpuError(f"{device} is unfit for the job: {'; '.join(problems)} (spec: preflight.gpu_health)")
    torch.cuda.set_device(device)
    return device


class UnfitGpuError(RuntimeError):
    """The GPU a rank was granted is unhealthy (NVML): the rank does not start on it."""


def _rendezvous(dist: Any, config: WorkerConfig) -> tuple[Any, int, int]:
    """Join the job's rendezvous, bounded by ``timeouts.rendezvous_s``: returns once every rank
    has arrived, with the store the process group will be built on, this rank and the world size.

    ``init_process_group(timeout=...)`` alone cannot bound the rendezvous and the collectives
    separately: that one value is the env:// store's timeout, bounds gloo's connection to every
    peer (ProcessGroupGloo's context timeout) and is the group's collective timeout. So the
    rendezvous is done here, through the same env:// handler torch uses, and ends with a barrier
    on the store; ``_init_group`` then builds the group with the collective timeout. The store
    is a client of the one node 0's agent serves (torchrun) or rank 0 serves (``serve_own_store``),
    either listening on the rendezvous address alone where it can.
    """
    from datetime import timedelta

    rendezvous_timeout = timedelta(seconds=config.rendezvous_timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=rendezvous_timeout))
    store.set_timeout(rendezvous_timeout)
    _wait_for_every_rank(dist, store, rank, world_size, config.rendezvous_timeout_s)
    return store, rank, world_size


def _init_group(dist: Any, config: WorkerConfig, device: Any, store: Any, rank: int, world_size: int, prefix: str = "default_pg") -> dict[int, str]:
    """Build the process group on the rendezvous' store, every collective bounded by
    ``timeouts.collective_s`` (torch's default for the backend if unset). The store keeps that
    timeout too: NCCL exchanges the ids of communicators it creates later there. ``prefix``: the
    group's keys in the store (another for each generation of a group re-formed in place).
    Returns the sockets the group opened (recovery in place shuts them down when it leaves it)."""
    from datetime import timedelta

    from launcher.runtime.inplace import opened_between, socket_fds

    kwargs: dict[str, Any] = {
        "backend": config.pg_backend,
        # the key layout init_process_group gives its own env:// store
        "store": dist.PrefixStore(prefix, store),
        "rank": rank,
        "world_size": world_size,
    }
    if config.collective_timeout_s is not None:  # else torch's per-backend default applies
        kwargs["timeout"] = timedelta(seconds=config.collective_timeout_s)
    if device.type == "cuda" and config.pg_backend == "nccl":
        # eager NCCL init: a bad GPU fails here, not at the first collective (gloo over CUDA
        # tensors, where ranks share a GPU, binds no device: its collectives stage through the host)
        kwargs["device_id"] = device
    before = socket_fds()
    dist.init_process_group(**kwargs)
    store.set_timeout(kwargs.get("timeout") or _default_collective_timeout(config.pg_backend))
    return opened_between(before, socket_fds())


def _wait_for_every_rank(
    dist: Any, store: Any, rank: int, world_size: int, timeout_s: float, phase: str = "arrived", hold_store: bool = False
) -> None:
    """Return once all ``world_size`` ranks have reached this point (``phase`` names it); fail
    after ``timeout_s``. ``hold_store``: the rank serving the store (rank 0 on Ray) also waits
    until every rank has seen the barrier open, so its store outlives every peer's wait."""
    from datetime import timedelta

    # per restart of the group: torchrun's agent store outlives a restart of its workers
    key = f"gpulaunch/{phase}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if store.add(key, 1) == world_size:
        store.set(key + "/all", "1")
    try:
        store.wait([key + "/all"], timedelta(seconds=timeout_s))
        if store.add(key + "/passed", 1) == world_size:
            store.set(key + "/passed/all", "1")
        if hold_store:
            store.wait([key + "/passed/all"], timedelta(seconds=timeout_s))
    except dist.DistStoreError as exc:  # the wait timed out (a lost store raises DistNetworkError)
        try:
            arrived = str(store.add(key, 0))
        except Exception:  # noqa: BLE001 - the count is only for the message
            arrived = "?"
        raise TimeoutError(
            f"{'rendezvous' if phase == 'arrived' else 'process group set-up'}: {arrived} of {world_size} ranks "
            f"arrived within timeouts.rendezvous_s={timeout_s:g}s "
            f"(rank {rank} waited for the others): {exc}"
        ) from exc


def _default_collective_timeout(pg_backend: str) -> Any:
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    return nccl if pg_backend == "nccl" and nccl is not None else constants.default_pg_timeout


def _run_script(config: WorkerConfig) -> None:
    """Run a torchrun-style script exactly as torchrun would: same argv shape, same env."""
    import runpy

    assert config.script is not None
    sys.argv = [config.script, *config.args]
    sys.path.insert(0, str(Path(config.script).parent))
    runpy.run_path(config.script, run_name="__main__")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _enable_stack_dumps() -> None:
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher's stack dump on a hang


def forked_rank(worker_json: str) -> None:
    """One rank forked from the node's forkserver (``start_method: forkserver``); torchrun calls
    it with the rank's environment already set. Ends like ``main``: exit handlers run, and a
    failed rank exits non-zero (its report is written either way)."""
    started = time.time()
    server = int(os.environ.get(ENV_RANK_SERVER_PID, "0"))
    # the server's death takes its ranks with it (it ends with the agent, which ends with us)
    die_with_parent(signal.SIGKILL, server if server and server != os.getpid() else None)
    _enable_stack_dumps()
    config = WorkerConfig.from_json(Path(worker_json).read_text())
    report = run_rank(config, os.environ, spawned_at=process_spawn_time(), started_at=started)
    # A forked child leaves through os._exit: run the exit handlers a normal exit would run.
    import atexit

    atexit._run_exitfuncs()
    if not report.ok:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    agent = os.environ.get(ENV_AGENT_PID, "")
    # the agent's death takes its workers with it (and if it died before we asked, exit now)
    die_with_parent(signal.SIGKILL, int(agent) if agent.isdigit() else None)
    _enable_stack_dumps()
    config = WorkerConfig.from_json(Path(argv[0]).read_text())
    report = run_rank(config, os.environ, spawned_at=process_spawn_time())
    code = 0 if report.ok else 1
    if config.entrypoint is not None:
        # The report is written and the process group destroyed: skip the interpreter teardown
        # (~0.4 s with torch loaded). Script mode keeps a normal exit, exactly as under torchrun.
        fast_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
