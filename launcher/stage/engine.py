"""The two seams every way of running a job plugs into.

- A **stage engine** starts one stage from its ``StagePlan`` and returns a ``StageHandle``: its
  rank events (beacons, reports, exits, lost hosts; ``launcher.stage.events``), poll, stop, a
  signal to every rank, collect; plus the printable ``LaunchRequest`` for ``--dry-run``. The run
  loop drives the handle and decides the stage's fate; the engine only reports. Engines: torchrun
  on this machine or over SSH, torchrun inside a Slurm allocation (srun), Ray actors.
- A **submitter** hands a whole run to a scheduler, whose allocation runs the launcher again, and
  follows it over the remote-run wire (``launcher.stage.wire``): submit, follow, status, logs,
  stop. It hands back the run's record as the scheduler left it (``launcher.records.SubmittedRun``),
  and the results layer makes the run's result from it (``launcher.results.handed_back``).
  Submitters: Ray Jobs, Slurm batch.
- A **detacher** starts a run loop from here on a cluster's controller host, over the engine's own
  transport, and finds it again by its run id (``launch --cluster FILE --detach``: the torchrun
  engine over SSH).

A new engine is one module with a ``StageEngine`` subclass and one ``launcher.backends.register``
call (see docs/architecture.md, "Adding an engine"). Neither seam imports the control side.
"""

from __future__ import annotations

import contextlib
import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Iterator, Mapping, Protocol, Sequence

from launcher.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, LauncherError
from launcher.evidence import RankEvidence
from launcher.records import SubmittedRun
from launcher.stage.events import StageEvent

if TYPE_CHECKING:
    from launcher.results.store import RunResult
    from launcher.spec.cluster import HostConfig
    from launcher.spec.model import LoadedJob
    from launcher.stage.logrouting import LogRouter
    from launcher.stage.plan import NodeTarget, StagePlan
    from launcher.stage.watch import RunEvents

# ``launcher.run_job`` as the inside half of a submitted run gets it: the control side passes it in
# (a submitter imports nothing of the control side)
RunJob = Callable[..., "RunResult"]


class FinishedRun(Protocol):
    """A run's result as an engine's own watcher reads it (``RunEvents.finished``), without the
    results layer: its document and status."""

    @property
    def data(self) -> Mapping[str, Any]: ...

    @property
    def status(self) -> str: ...


@dataclass(frozen=True)
class LaunchRequest:
    """What an engine or submitter would start for one stage, printable: ``--dry-run`` shows exactly this."""

    backend: str
    commands: tuple[str, ...]  # the commands, scripts or actors, as a user could run or read them
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        return [*self.commands, *(f"({note})" for note in self.notes)]


@dataclass(frozen=True)
class HandleStatus:
    """What the process layer says of a stage: still running, or ended and how."""

    done: bool
    ok: bool = False
    detail: str = ""  # why it ended badly where no rank's report says (an agent's exit, a lost host)
    # the agent could not bind the rendezvous port another process took first: retry on another
    rendezvous_port_in_use: bool = False


class StageHandle(ABC):
    """One running stage. Its channel puts the ranks' events on ``logs.events``; the run loop
    takes them with ``take_events`` and never reads a rank's files itself."""

    def __init__(self, plan: StagePlan, logs: LogRouter) -> None:
        self.plan = plan  # an engine that places ranks itself replaces it with the placed plan
        self.logs = logs

    def emit(self, *events: StageEvent) -> None:
        self.logs.emit(*events)

    def take_events(self, timeout_s: float = 0.0) -> list[StageEvent]:
        """The events that arrived since the last call, waiting up to ``timeout_s`` for one."""
        return self.logs.events.take(timeout_s)

    @abstractmethod
    def poll(self) -> HandleStatus:
        """Non-blocking: has the group ended, and how. Before it says ``done``, the events of
        everything that ended are on the queue (an agent's last lines have been routed)."""

    @abstractmethod
    def stop(self, grace_s: float = 5.0) -> None:
        """Tear everything down (gracefully, then by force); idempotent; returns when all is gone."""

    def signal_ranks(self, signum: int) -> None:
        """Send ``signum`` to every live rank, on every host the engine reaches (SIGUSR1: each
        rank dumps its stacks into its log, on a hang)."""

    def gather_evidence(self) -> list[RankEvidence]:
        """A stalled stage's evidence from every rank, on every host, through the engine's own
        channel (``launcher.runtime.hangdump`` run where the ranks are): stacks read from outside,
        each rank's last collectives. The ranks keep running. An engine that cannot reach its
        ranks' hosts this way has each rank dump its stacks into its log (SIGUSR1) and returns none."""
        self.signal_ranks(signal.SIGUSR1)
        return []

    def collect(self) -> None:
        """After ``stop``: bring the stage's files back where they stayed on other hosts, and
        emit any report the live channel did not deliver (a stream cut short)."""


class StageEngine(ABC):
    """Turns stage plans into running stages. One instance per run."""

    name: ClassVar[str] = "base"

    def session(self, job: LoadedJob) -> ContextManager[None]:
        """Resources that live for a whole run, across its stages and restarts (a Ray runtime).
        Entered once before the first stage; cleans up on exit."""
        return contextlib.nullcontext()

    def check_job(self, job: LoadedJob, cluster: str | None) -> None:
        """Refuse, before anything starts, what this engine cannot run (raise a LauncherError)."""

    @property
    def plans_on_own_cluster(self) -> bool:
        """True when the nodes to plan on are the engine's own cluster (a Ray cluster, a Slurm
        allocation), known only inside ``session``: ``pool_nodes`` says what they are."""
        return False

    def pool_nodes(self, job: LoadedJob) -> list[NodeTarget]:
        """The engine's cluster as nodes to plan on; asked inside ``session``."""
        raise NotImplementedError(f"{self.name} plans on this machine or a cluster file")

    @abstractmethod
    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        """The engine's own launch request for ``plan``, for ``--dry-run`` (nothing is started)."""

    @abstractmethod
    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        """Start every process of the plan and return without waiting for them (BackendError
        when it cannot start, after stopping whatever it started)."""

    def after_a_notice(self, plan: StagePlan) -> str:
        """How a run stopped after a notice goes on, in the words the summary ends with: by
        default ``launch resume`` of its run directory (a scheduler's engine may requeue itself)."""
        return f"continue with: launch resume {plan.stage_dir.parent}"


@dataclass(frozen=True)
class JobInfo:
    """A submitted run as its scheduler has it (``launch status``)."""

    job_id: str
    status: str  # the scheduler's own word: RUNNING, SUCCEEDED, PENDING, COMPLETED, ...
    terminal: bool
    message: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    entrypoint: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"job_id": self.job_id, "status": self.status, "terminal": self.terminal, "message": self.message,
                "metadata": dict(self.metadata), "entrypoint": self.entrypoint}  # fmt: skip


@dataclass(frozen=True)
class Submission:
    """One run to hand to a scheduler: the spec, its plans on what the scheduler would grant (for
    checks and the dry run; inside the job the launcher plans again on what it got), and where
    its run directory goes."""

    job: LoadedJob
    plans: tuple[StagePlan, ...]
    out: Path
    run_id: str


def settle_submitted(run: SubmittedRun) -> RunResult | None:
    """The run's result, made by the results layer from its submitter's record (and written to
    ``result.json`` once the run has ended); None where no whole result came back and the
    scheduler cannot say why."""
    from launcher.results.handed_back import result_of

    return result_of(run)


class Submitter(ABC):
    """Hands whole runs to a scheduler that runs the launcher inside its allocation."""

    name: ClassVar[str] = "base"
    # where it submits is an address (``--address``, ``run_job(address=)``): a run given one goes to it
    takes_address: ClassVar[bool] = False
    address_kind: ClassVar[str] = "a cluster"  # what its --address names, in messages ("a Ray cluster")
    # what the launcher inside the scheduler's job needs besides the launcher's own dependencies
    # (checked, one line and exit 2, before anything else is imported there)
    needs: ClassVar[tuple[str, ...]] = ()
    usage: ClassVar[str] = ""  # the inside entry's arguments after its name, for the usage line

    def __init__(self, address: str | None = None) -> None:
        self.address = address  # where the scheduler is, for those that need one (a Ray dashboard)

    @classmethod
    @abstractmethod
    def claims(cls, job_id: str, address: str | None) -> bool:
        """Whether ``job_id`` (as ``launch status|logs|stop`` got it) is one of this scheduler's."""

    @classmethod
    def address_of(cls, job: LoadedJob) -> str | None:
        """The address the spec's settings name for this submitter (``takes_address``), if any."""
        return None

    @classmethod
    def takes_run(cls, job: LoadedJob, address: str | None, env: Mapping[str, str]) -> bool:
        """Whether a run of ``job`` on this backend is submitted (rather than started here by the
        engine of the same name): ``address`` the cluster address given or named by the spec,
        ``env`` this process's environment (the launcher inside the job is not submitted again)."""
        return False

    @classmethod
    def resume_refusal(cls, run_dir: Path) -> str | None:
        """Why ``launch resume`` must leave ``run_dir`` alone when it is one of this scheduler's
        runs (its scheduler continues it), else None."""
        return None

    @classmethod
    def run_inside(cls, argv: Sequence[str], run_job: RunJob) -> int | None:
        """The inside half: ``python -m launcher.control.submitted NAME ARGV...``, run by the
        scheduler's job, runs the launcher there with ``run_job`` (the control side's, passed in)
        and reports over the remote-run wire; returns the process's exit code (None: ``argv`` is
        not what it takes; the usage line is printed)."""
        raise NotImplementedError(f"{cls.name}: no inside entry")

    def check_job(self, job: LoadedJob, cluster: str | None = None) -> None:
        """Refuse what this scheduler can never run, before anything is submitted (LauncherError)."""

    def target_nodes(self, job: LoadedJob, *, dry_run: bool = False) -> list[NodeTarget] | None:
        """The nodes the scheduler would grant, to plan on before submitting (in a dry run: or
        placeholders, saying so in ``dry_run``'s notes); None when it cannot say (the plan is
        made inside the job, on what it got)."""
        return None

    @abstractmethod
    def dry_run(self, submission: Submission) -> tuple[list[LaunchRequest], list[str]]:
        """What would be submitted (one request per plan, or one for the whole run) and notes."""

    def submit(self, submission: Submission, *, events: RunEvents, stop: object | None, detach: bool) -> RunResult:
        """Submit, follow the run to its end over the remote-run wire (or return once submitted,
        with ``detach``) and return its result, with the exit code a run from here would have:
        the submitter's ``submit_run`` hands back the run's record, the results layer makes the
        result (and ``result.json``), ``events.finished`` shows it."""
        return self._result(self.submit_run(submission, events=events, stop=stop, detach=detach), events)

    def attach(self, run_or_job_id: str, *, out: Path, events: RunEvents) -> RunResult | None:
        """Follow a run submitted earlier (``attach_run``) to its end: its result, shown by
        ``events.finished``; None where the following stopped and the run goes on."""
        run = self.attach_run(run_or_job_id, out=out, events=events)
        return None if run is None else self._result(run, events)

    def _result(self, run: SubmittedRun, events: RunEvents) -> RunResult:
        result = settle_submitted(run)
        if result is None:
            raise self.without_result(run)
        if run.pending_hint is None:
            events.finished(result)
        return result

    @abstractmethod
    def submit_run(self, submission: Submission, *, events: RunEvents, stop: object | None, detach: bool) -> SubmittedRun:
        """Submit, follow the run to its end over the remote-run wire (or return once submitted,
        with ``detach``: ``pending_hint`` set) and hand back its record as the scheduler left it.
        Reads and writes no result: the results layer makes it from the record."""

    def attach_run(self, run_or_job_id: str, *, out: Path, events: RunEvents) -> SubmittedRun | None:
        """Follow a run submitted earlier (``--detach``, or one whose ``launch`` went away) with
        the same live view as a foreground run, from its start, to its end: its record (the run
        directory brought under ``out`` where it is not there already). SIGINT and SIGTERM stop
        the following only, never the run: None. A run that has ended already: its record at once."""
        raise LauncherError(f"launch attach: the {self.name} scheduler's runs cannot be attached to", exit_code=EXIT_BAD_INPUT)

    def without_result(self, run: SubmittedRun) -> LauncherError:
        """The error when no whole result came back and ``run.ended_without`` does not say why."""
        ended = f"ended {run.state}" if run.state else "ended"
        return LauncherError(f"{self.name} job {run.job_id} {ended} without its result", exit_code=EXIT_JOB_FAILED)

    @abstractmethod
    def status(self, job_id: str) -> JobInfo:
        """The job's state (LauncherError with exit 2 for an unknown id)."""

    @abstractmethod
    def logs(self, job_id: str, *, follow: bool, echo: Callable[[str, str], None]) -> None:
        """The job's output as the run showed it (``host:rank text``); the wire's lines left out."""

    @abstractmethod
    def stop(self, job_id: str) -> JobInfo:
        """Stop the job and wait until it has ended; its final state."""


class Detacher(ABC):
    """Runs that outlive the machine that launched them: the run loop of an engine run from here
    (``engine``), started on a cluster's controller host over the engine's transport, and found
    there again by its run id (``launch --cluster FILE --detach``, ``attach``, ``status``,
    ``logs``, ``stop``, ``fetch``, ``resume``). The control side reaches it through the registry
    (``launcher.backends.detacher``)."""

    engine: ClassVar[str] = "base"  # the engine whose run loop the controller runs

    @abstractmethod
    def start(self, host: HostConfig, payload: Mapping[str, Any]) -> Mapping[str, Any]:
        """Make the run directory on ``host`` and start the controller there; once it runs: its
        ``run_id``, ``run_dir`` and ``pid``."""

    @abstractmethod
    def resume(self, host: HostConfig, run: str) -> Mapping[str, Any]:
        """Start the controller of ``run`` again, resuming its run from its last checkpoints."""

    @abstractmethod
    def job_info(self, host: HostConfig, run: str) -> JobInfo: ...

    @abstractmethod
    def stop(self, host: HostConfig, run: str, *, wait_s: float) -> JobInfo:
        """Stop the controller (it stops the run and writes its result); its final state."""

    @abstractmethod
    def following(self, host: HostConfig, run: str, *, wait: bool) -> ContextManager[Iterator[str]]:
        """The controller's output lines (the remote-run wire) from its start; with ``wait``, on
        until it has ended. Its last line is the end line (``end_of``)."""

    @abstractmethod
    def end_of(self, line: str) -> dict[str, Any] | None:
        """The follower's end line, parsed: how the controller ended (None for any other line)."""

    @abstractmethod
    def fetch(self, host: HostConfig, run: str, out: Path, *, say: Callable[[str], None]) -> Path:
        """Bring the run directory home, into ``out/<job>/<run-id>``."""
