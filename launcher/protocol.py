"""The contract between the launcher and a rank: standard library only.

Both sides import this module and nothing else of each other: the control side writes a
``WorkerConfig`` and reads ``RankReport`` files; the rank runtime reads the config and writes its
report and progress beacon. Paths in a run directory come from ``StagePaths`` alone, and every
environment variable the launcher sets for its own processes starts with ``GPULAUNCH_``.
"""

from __future__ import annotations

import enum
import json
import re
import signal
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from collections.abc import Mapping  # not typing.Mapping: isinstance against it is several times slower, once per beacon
from typing import Any

REPORT_VERSION = 1

# --- environment variables the launcher sets for its own processes (one prefix) -----------------
ENV_HOST = "GPULAUNCH_HOST"  # the node's name as logs and results show it
ENV_STAGE_DIR = "GPULAUNCH_STAGE_DIR"  # every process of a stage carries it (forked ranks too)
ENV_PARENT_PID = "GPULAUNCH_PARENT_PID"  # the agent dies with this process (the launcher, a host wrapper)
ENV_AGENT_PID = "GPULAUNCH_AGENT_PID"  # the ranks die with their agent
ENV_RAY_CONNECT = "GPULAUNCH_RAY_CONNECT"  # inside a Ray job: connect to the cluster, never embed one
ENV_GRANTED_GPU = "GPULAUNCH_GRANTED_GPU"  # the GPU Ray granted this rank's actor
# a rank's device where its scheduler chose it (Ray's fractional GPUs): it overrides the
# local-rank rule (``rank_device``), which holds where the plan alone places ranks (torchrun)
ENV_RANK_DEVICE = "GPULAUNCH_RANK_DEVICE"
ENV_RANK_SERVER_PID = "GPULAUNCH_RANK_SERVER_PID"  # the forkserver that forked this rank
ENV_SLURM_INSIDE = "GPULAUNCH_SLURM_INSIDE"  # set by the sbatch script: the launcher runs inside its Slurm job

# The launcher's stop notice to a rank (a preemption, Ctrl-C, ``launch stop``): ``ctx.should_stop``
# turns true and the job has ``stop_grace_s`` to save and return. SIGUSR1 is the stack dump's.
STOP_NOTICE_SIGNAL = signal.SIGUSR2

# --- tagged lines on an agent's or a host helper's output ---------------------------------------
AGENT_FAILURE_TAG = "gpulaunch-agent-failure: "  # one JSON record per failed rank
HOST_ANSWER_TAG = "gpulaunch-ssh-json: "  # the host helper's one JSON answer
# A node's ranks' beacons and reports, forwarded by its agent on its own output: the one live
# channel from every rank to the run loop, whatever carries the agent's output (a local pipe,
# an SSH session, an srun step). One compact JSON object a line (``rank_event_lines``); one
# longer than a pipe writes at once arrives as numbered parts (``RANK_EVENTS_PART_TAG``).
RANK_EVENTS_TAG = "@gpulaunch-ranks "
RANK_EVENTS_PART_TAG = "@gpulaunch-ranks-part "
# A pipe takes a write of up to PIPE_BUF (4096 bytes on Linux) whole, never interleaved with
# another writer's (the agent's stdout and stderr share one pipe): every forwarded line fits.
LINE_LIMIT = 4000
LOG_PREFIX_SEPARATOR = "| "  # rank lines arrive as "host:rank| text"
# the agent exits with EADDRINUSE's errno when another process bound the rendezvous port first
PORT_IN_USE_EXIT = 98


def rank_device(device_type: str, local_rank: int, ranks_per_gpu: int) -> str:
    """The device a rank computes on: ``cuda:<local_rank // ranks_per_gpu>`` (the node's GPU at
    that index, of those the rank sees: ranks that share a GPU are neighbours), or ``cpu``. The
    one rule: the plan names it, the rank takes it."""
    return f"cuda:{local_rank // ranks_per_gpu}" if device_type == "cuda" else "cpu"


class RankStatus(str, enum.Enum):
    """How one rank ended. ``stopped``: it wrote no report (killed, never started, torn down)."""

    OK = "ok"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class StagePaths:
    """The one place that knows a stage directory's layout (``<run>/world<N>/``)."""

    root: Path

    @classmethod
    def of(cls, run_dir: str | Path, world_size: int) -> "StagePaths":
        return cls(Path(run_dir) / f"world{world_size}")

    @property
    def worker_config(self) -> Path:
        return self.root / "worker.json"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def progress_dir(self) -> Path:
        return self.root / "progress"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def torchelastic(self) -> Path:
        return self.root / "torchelastic"

    def report(self, rank: int) -> Path:
        return self.reports / f"rank{rank}.json"

    def progress(self, rank: int) -> Path:
        return self.progress_dir / f"rank{rank}.json"

    def log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def agent_log_dir(self, node_rank: int) -> Path:
        return self.torchelastic / f"node{node_rank}"

    @property
    def checkpoints(self) -> Path:
        """Where ``ctx.checkpoint`` keeps the stage's checkpoints when the spec names no ``checkpoint.dir``."""
        return self.root / "checkpoints"

    @property
    def hang_dir(self) -> Path:
        """A stalled stage's evidence (on each rank's host while it is gathered; on the launching
        machine, every rank's, once it is)."""
        return self.root / "hang"

    def hang_request(self, rank: int) -> Path:
        """Created on a rank's host to ask that rank for its own account of a stall (its flight
        recorder's last collectives, its threads' stacks). One per rank: on a shared filesystem
        (Slurm) every node's gathering runs at once in the same directory."""
        return self.hang_dir / f"request_rank{rank}"

    def rank_account(self, rank: int) -> Path:
        return self.hang_dir / f"account_rank{rank}.json"

    def flight_record(self, rank: int) -> Path:
        """The rank's whole flight recorder, as torch dumps it: ``torchfrtrace <hang dir> -p fr_trace_rank`` reads them all."""
        return self.hang_dir / f"fr_trace_rank{rank}"


@dataclass(frozen=True)
class WorkerConfig:
    """What every rank's runtime needs; written once per stage as ``worker.json`` (by the same
    launcher the ranks run). Values only: every field is given (``control.planning`` fills them
    from the spec, whose model states each setting's default)."""

    job: str
    stage_dir: str
    device_type: str  # "cuda" or "cpu"
    pg_backend: str  # "nccl" or "gloo"
    # torch's intra-op threads per rank: the plan's share of the node's cores, or the spec's own
    # OMP_NUM_THREADS (the user's setting wins); None where that value is not a plain count, so
    # torch reads OMP_NUM_THREADS itself and the worker leaves it alone
    threads_per_worker: int | None
    entrypoint: str | None
    prepare: str | None  # the job's rank-independent start (module:function), run just before the entrypoint (spec: prepare)
    script: str | None
    args: tuple[str, ...]
    params: Mapping[str, Any]  # resolved: the workload's defaults filled in, as the dry run shows
    rendezvous_timeout_s: float  # bounds the ranks' rendezvous (store connect, every rank arrived)
    # bounds each collective (the process group's timeout); None: torch's default for pg_backend
    collective_timeout_s: float | None
    run_id: str  # the run this stage belongs to (metrics labels)
    # straggler detection: time the job's DDP models (gradient and optimizer hooks; spec: monitoring.stragglers)
    time_ddp: bool
    # ``ctx.checkpoint``: where this stage's checkpoints live on every host (a shared filesystem's
    # path, or the same path on each host's own disk), how many complete ones to keep, and what a
    # checkpoint must carry to be this job's (its name and program: ``job_identity``)
    checkpoint_dir: str
    checkpoint_keep: int
    checkpoint_async_save: bool  # rank 0's save blocks only for a copy; the file is written on a thread (spec: checkpoint.async_save)
    warm_spares: int  # per node, ready for recovery in place with ``prepare`` run (spec: checkpoint.warm_spares)
    job_identity: str
    attempt: int  # 0 for the stage's first start, then one more per restart
    stop_grace_s: float  # a stop notice's deadline: the seconds the job has to save and return (spec: preemption.grace_s)
    # each GPU rank checks its own GPU's health through NVML before it joins the group (spec:
    # preflight.gpu_health): the check reaches the hosts no preflight logs in to (Ray, Slurm nodes)
    gpu_health: bool
    # ranks that share each GPU (spec: resources.ranks_per_gpu); above 1 the group runs on gloo
    ranks_per_gpu: int

    @property
    def paths(self) -> StagePaths:
        return StagePaths(Path(self.stage_dir))

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["params"] = dict(self.params)
        data["args"] = list(self.args)
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "WorkerConfig":
        data = json.loads(text)
        data["args"] = tuple(data["args"])
        return cls(**data)


@dataclass(frozen=True)
class RankError:
    type: str
    message: str
    traceback: str
    time: float

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RankError":
        return cls(
            type=str(data.get("type", "Error")),
            message=str(data.get("message", "")),
            traceback=str(data.get("traceback", "")),
            time=float(data.get("time") or 0.0),
        )


# Errors a rank raises because a *peer* died under it (its collective's connection went away):
# collateral, never the root cause when a rank is known to have died without a report of its own.
PEER_LOSS = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError|remote (process|peer|worker)"
    r"|communicator was aborted|NCCL.*(abort|Watchdog)|peer .*(closed|crashed|died|exited)",
    re.IGNORECASE,
)


def is_peer_loss(error: RankError) -> bool:
    return bool(PEER_LOSS.search(f"{error.type}: {error.message}"))


@dataclass(frozen=True)
class CheckpointActivity:
    """What ``ctx.checkpoint`` did in one rank: the step it resumed from, the last step saved or
    resumed from, and the seconds its saves and loads took (``save_s``: what the job waited for;
    ``write_s``: what the background writes of ``checkpoint.async_save`` took beside it)."""

    resumed_step: int | None = None
    last_step: int | None = None
    save_s: float = 0.0
    load_s: float = 0.0
    write_s: float = 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CheckpointActivity":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# The error types of ranks that went with their host rather than failing themselves (written by
# the launcher, never raised by a rank): a lost SSH host, a lost Slurm node, a Ray actor that died.
HOST_LOST = "HostLost"
NODE_LOST = "NodeLost"
ACTOR_DIED = "ActorDied"


@dataclass
class RankReport:
    """What one rank reports at its end (``reports/rank<k>.json``), or what the launcher knows of
    a rank that wrote none. Serialised with ``to_dict`` at the edge (files, result.json)."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    host: str
    device: str
    status: RankStatus = RankStatus.FAILED
    phases: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    result: Any = None
    error: RankError | None = None
    hostname: str | None = None
    pid: int | None = None
    restart: int = 0
    rendezvous: str | None = None
    last_phase: str | None = None  # for a rank that wrote no report: where its beacon stopped
    checkpoint: CheckpointActivity | None = None  # what ctx.checkpoint did in this rank
    stop_notice: str | None = None  # why the job was told to stop (it may have returned early for it)
    log: str | None = None  # the rank's log file, when it exists
    report_version: int = REPORT_VERSION

    @property
    def ok(self) -> bool:
        return self.status == RankStatus.OK

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return {k: v for k, v in data.items() if v is not None or k in ("result", "error")}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RankReport":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["status"] = RankStatus(values.get("status", RankStatus.FAILED))
        if isinstance(values.get("error"), Mapping):
            values["error"] = RankError.from_dict(values["error"])
        if isinstance(values.get("checkpoint"), Mapping):
            values["checkpoint"] = CheckpointActivity.from_dict(values["checkpoint"])
        return cls(**values)

    @classmethod
    def failed(cls, *, error_type: str, message: str, traceback_text: str | None = None, at: float, **who: Any) -> "RankReport":
        """A rank that failed before (or without) its runtime writing a report: same schema, so
        the aggregate and the root-cause ranking treat it like any other."""
        return cls(**who, status=RankStatus.FAILED, error=RankError(error_type, message, traceback_text or message, at))


@dataclass(slots=True)
class RankProgress:
    """A rank's beacon (``progress/rank<k>.json``): its phase and host step count, twice a second."""

    phase: str = "spawning"
    steps: int = 0
    t: float | None = None
    pid: int | None = None
    pid_start: float | int | None = None
    work_s: float | None = None  # own work per step (not waiting for peers), median of recent steps
    work_mad_s: float | None = None  # how much those steps vary: their median absolute deviation
    work_n: int | None = None  # how many recent steps the figure covers
    # checkpoints (``ctx.checkpoint``): the last step saved, the rank's own step count when it was
    # saved (what a failure after it loses), the step this attempt resumed from
    ckpt_step: int | None = None
    ckpt_at: int | None = None
    resumed_step: int | None = None
    watches_stop: bool | None = None  # the job reads ctx.should_stop: a stop notice lets it save first
    # the rank's own phase stamps so far (spawned, started, imported, joined, pg_ready, first_step):
    # a rank stopped before it writes its report (Ctrl-C) still dates the stage's phases exactly
    phases: Mapping[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "RankProgress":
        # read for every beacon of every rank (2,048 a second at 1,024 ranks): one lookup per key,
        # and the keys a running rank rarely writes looked at only when present
        if not isinstance(data, Mapping):
            return cls()
        get = data.get
        steps, t, pid, work, mad, n = get("steps", 0), get("t"), get("pid"), get("work_s"), get("work_mad_s"), get("work_n")
        progress = cls(
            phase=str(get("phase", "spawning")),
            steps=int(steps) if isinstance(steps, _NUMBER) else 0,
            t=float(t) if isinstance(t, _NUMBER) else None,
            pid=pid if isinstance(pid, int) else None,
            pid_start=get("pid_start"),
            work_s=float(work) if isinstance(work, _NUMBER) else None,
            work_mad_s=float(mad) if isinstance(mad, _NUMBER) else None,
            work_n=int(n) if isinstance(n, int) else None,
        )
        if not _COMMON_BEACON_KEYS.issuperset(data):
            progress.ckpt_step = _int_or_none(get("ckpt_step"))
            progress.ckpt_at = _int_or_none(get("ckpt_at"))
            progress.resumed_step = _int_or_none(get("resumed_step"))
            progress.watches_stop = True if get("watches_stop") is True else None
            progress.phases = _stamps(get("phases"))
        return progress


_NUMBER = (int, float)
_COMMON_BEACON_KEYS = frozenset(("phase", "steps", "t", "pid", "pid_start", "work_s", "work_mad_s", "work_n"))


def _stamps(value: Any) -> dict[str, float] | None:
    if not isinstance(value, Mapping):
        return None
    return {str(k): float(v) for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)} or None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def rank_event_lines(*, beacons: Mapping[int, Mapping[str, Any]] | None = None, report: Mapping[str, Any] | None = None, key: str = "") -> list[str]:
    """The lines a node's agent forwards: the beacons of its ranks that changed (rank -> the
    beacon file's content) and/or one rank's report (as its file holds it). One line when it fits
    ``LINE_LIMIT``; else numbered parts, ``key`` telling this message's parts from others'."""
    data: dict[str, Any] = {}
    if beacons:
        data["beacons"] = {str(rank): dict(beacon) for rank, beacon in beacons.items()}
    if report is not None:
        data["report"] = dict(report)
    payload = json.dumps(data, separators=(",", ":"), default=str)  # ASCII: a character is a byte
    if len(RANK_EVENTS_TAG) + len(payload) <= LINE_LIMIT:
        return [RANK_EVENTS_TAG + payload]
    room = LINE_LIMIT - len(RANK_EVENTS_PART_TAG) - len(key) - 24
    parts = [payload[i : i + room] for i in range(0, len(payload), room)]
    return [f"{RANK_EVENTS_PART_TAG}{key} {i}/{len(parts)} {part}" for i, part in enumerate(parts)]


class RankEventParts:
    """Puts a long forwarded message back together from its parts (which arrive in order, each
    whole, possibly between other lines); ``feed`` returns the whole line once the last part came."""

    def __init__(self) -> None:
        self._parts: dict[str, list[str]] = {}

    def feed(self, line: str) -> str | None:
        try:
            key, position, part = line[len(RANK_EVENTS_PART_TAG) :].split(" ", 2)
            index, total = (int(x) for x in position.split("/"))
        except ValueError:
            return None
        parts = self._parts.setdefault(key, [])
        if index != len(parts):  # a part was lost: drop the message (the report's fetch makes up for it)
            self._parts.pop(key, None)
            return None
        parts.append(part)
        if len(parts) < total:
            return None
        del self._parts[key]
        return RANK_EVENTS_TAG + "".join(parts)


def decode_rank_events(line: str) -> tuple[dict[int, RankProgress], RankReport | None] | None:
    """The beacons and the report a forwarded line carries; None for any other line (or one
    that does not parse: it was cut short, and it is bookkeeping either way)."""
    if not line.startswith(RANK_EVENTS_TAG):
        return None
    try:
        data = json.loads(line[len(RANK_EVENTS_TAG) :])
        beacons = {int(rank): RankProgress.from_dict(beacon) for rank, beacon in (data.get("beacons") or {}).items()}
        report = RankReport.from_dict(data["report"]) if isinstance(data.get("report"), Mapping) else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return beacons, report
