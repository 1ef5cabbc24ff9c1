"""``run_job``: the whole pipeline as one Python call; the CLI is a thin shell over it.

spec -> nodes (discovery, a cluster file's preflight, or the engine's own pool) -> one plan per
stage -> the engine's handle under the run loop -> aggregate -> result.json, the job's summary and
plots. A run for a scheduler (a Ray cluster's ``--address``, a Slurm partition) goes to its
submitter instead, which follows the run over the remote-run wire to the same ``RunResult``. Every
path returns a ``RunResult``; a notebook gets the same as the CLI.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar, Union

import yaml

from launcher import backends
from launcher.control import cpuclock
from launcher.control.nodes import (
    HostPool, assumed_nodes, cluster_path, preflight_lines, preflight_nodes, recorded_nodes, rendezvous_port, resolve_nodes,
)  # fmt: skip
from launcher.control.planning import RunSizing, check_node_split, checkpoint_root, make_plans, plan_stage, size_run
from launcher.control.run_end import finish_run, masked_spec
from launcher.control.resume import (
    LAUNCH_FILE, LaunchRecord, check_checkpoint_dirs, check_unchanged, finished_stages, nothing_to_resume, record_launch, set_aside,
)  # fmt: skip
from launcher.control.runloop import StopRequest, run_stage
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.procutil import handling_stop_signals
from launcher.records import Failure, FailureReason, PreflightRecord, StageOutcome, new_run_id
from launcher.results.store import RunResult
from launcher.spec.model import LoadedJob, load_job
from launcher.stage.engine import LaunchRequest, StageEngine, Submission, Submitter
from launcher.protocol import StagePaths
from launcher.stage.plan import NodeTarget, StagePlan
from launcher.stage.watch import PlainEvents, RunEvents, TeeEvents

Runner = Union[StageEngine, Submitter]


@dataclass(frozen=True)
class DryRun:
    """What a run would do: the plans and the launch request of each. Nothing was spawned."""

    job: LoadedJob
    plans: tuple[StagePlan, ...]
    requests: tuple[LaunchRequest, ...]  # per plan
    notes: tuple[str, ...] = ()  # what the plan decided that the spec did not say outright


def resolve(job: LoadedJob, backend: str | None, cluster: str | None, address: str | None = None) -> Runner:
    """What runs the job (an engine here, or a scheduler's submitter: the registry's choice), once
    it has refused what it cannot run (nothing started). ``--address`` means the cluster there, for
    the backend whose submitter takes an address, whatever the spec's backend."""
    runner = backends.choose(job, backend=backend, address=address)
    runner.check_job(job, cluster)
    return runner


def check_job(job: LoadedJob, *, backend: str | None = None, cluster: str | None = None) -> str:
    """What ``launch validate`` can check without contacting any host: the backend, the cluster
    file, and on this machine whether the plan fits. Returns what would run; raises as launch would."""
    runner = resolve(job, backend, cluster)
    if isinstance(runner, Submitter) or runner.plans_on_own_cluster:
        return f"{runner.name}: planned on the cluster when it runs"
    path = cluster_path(job, cluster)
    if path is not None:
        from launcher.spec.cluster import load_cluster

        config = load_cluster(path)
        check_node_split(job)
        return f"{runner.name}: {len(config.hosts)} host(s) in {cluster or job.spec.cluster}, checked over SSH when it runs"
    sizing = size_run(job, resolve_nodes(job, None))
    notes = "".join(f"; note: {n}" for n in sizing_lines(sizing))
    return f"{runner.name}: world sizes {list(sizing.world_sizes)} on {sizing.device_type} here{notes}"


def sizing_lines(sizing: RunSizing) -> list[str]:
    """What the console, the dry run and ``validate`` say of the sizing: the world sizes skipped
    (why, and what would run them), then what the plan decided that the spec did not say."""
    return [*(s.describe() for s in sizing.skipped), *sizing.notes]


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _one_connection_per_host(fn: _Fn) -> _Fn:
    """Every SSH connection a run opens (the preflight logs in to each host once) is reused by
    its stages and closed when the run ends, however it ends. A local run opens none."""

    @functools.wraps(fn)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        job = args[0] if args else kwargs.get("job")
        if isinstance(job, LoadedJob) and cluster_path(job, kwargs.get("cluster")) is None:
            return fn(*args, **kwargs)  # no cluster file: no SSH client to load
        with backends.host_connections():
            return fn(*args, **kwargs)

    return scoped  # type: ignore[return-value]


@_one_connection_per_host
def dry_run(
    job: LoadedJob,
    *,
    backend: str | None = None,
    out: str | Path = "runs",
    cluster: str | None = None,
    address: str | None = None,
    inventory: str | Path | None = None,
    preflight: bool = False,
) -> DryRun:
    """The plans and what would be started for each (a scheduler's: what would be submitted,
    planned on the nodes it would grant, or on placeholders it says it could not check).
    ``inventory``: a recorded node (``launch devices --json``, an NVML recording) to plan on
    instead of this machine, or of every host of the cluster file. A cluster file's hosts are
    logged in to (GPUs, addresses checked) only with ``preflight``; else they are planned as
    written, with what only a login would tell assumed, and said."""
    runner = resolve(job, backend, cluster, address)
    run_dir = Path(out).resolve() / job.spec.name / "<run-id>"
    if inventory is not None or (cluster_path(job, cluster) is not None and not preflight and not isinstance(runner, Submitter)):
        if isinstance(runner, Submitter):
            raise LauncherError(
                f"--inventory: the {runner.name} backend plans on the nodes its scheduler grants; "
                f"--inventory plans a run of this machine or of a cluster file's hosts",
                exit_code=EXIT_BAD_INPUT,
            )
        given = recorded_nodes(job, cluster, inventory) if inventory is not None else assumed_nodes(job, cluster)
        return _dry_run_on(job, runner, given, run_dir)
    if isinstance(runner, Submitter):
        nodes = runner.target_nodes(job, dry_run=True)
        sizing = size_run(job, nodes) if nodes else None
        plans = make_plans(job, nodes, sizing, run_dir=run_dir, master_port=0, backend=runner.name) if nodes and sizing else []
        requests, notes = runner.dry_run(Submission(job, tuple(plans), Path(out), "<run-id>"))
        return DryRun(job, tuple(plans), tuple(requests), (*(sizing_lines(sizing) if sizing else ()), *notes))
    pool = HostPool.of(job, resolve_nodes(job, cluster))
    sizing = size_run(job, pool.active)
    plans = make_plans(job, pool.active, sizing, run_dir=run_dir, master_port=rendezvous_port(pool.active), backend=runner.name)
    spares = (f"spare host(s) {', '.join(n.name for n in pool.spares)}: used when a host is lost",) if pool.spares else ()
    return DryRun(job, tuple(plans), tuple(runner.launch_request(plan) for plan in plans), (*sizing_lines(sizing), *spares))


def _dry_run_on(job: LoadedJob, runner: Runner, nodes: list[NodeTarget], run_dir: Path) -> DryRun:
    """A dry run on nodes given (recorded), not discovered: the same plans and commands; a port
    stands in for the rendezvous port a run would pick."""
    assert isinstance(runner, StageEngine)
    pool = HostPool.of(job, nodes)
    sizing = size_run(job, pool.active)
    plans = make_plans(job, pool.active, sizing, run_dir=run_dir, master_port=29500, backend=runner.name)
    recorded = dict.fromkeys(note for n in pool.active for note in n.inventory.notes)
    spares = (f"spare host(s) {', '.join(n.name for n in pool.spares)}: used when a host is lost",) if pool.spares else ()
    return DryRun(job, tuple(plans), tuple(runner.launch_request(plan) for plan in plans), (*sizing_lines(sizing), *spares, *recorded))


def _stop_on_signals(stop: StopRequest) -> contextlib.AbstractContextManager[None]:
    """Ctrl-C and SIGTERM ask the run loop to tear everything down, then the run reports.

    A second one stops at once: teardown can wait on a rank that ignores SIGTERM or on a host
    that does not answer. What the launcher started dies with it (parent-death signals, the SSH
    lifelines), so nothing is left behind; only the final result.json is not written.
    """

    def handler(signum: int, _frame: Any) -> None:
        if stop:
            print(f"gpulaunch: {signal.Signals(signum).name} again: stopping at once", file=sys.stderr, flush=True)
            raise KeyboardInterrupt
        stop.set(signal.Signals(signum).name)

    return handling_stop_signals(handler)


@_one_connection_per_host
def run_job(
    job: str | Path | LoadedJob,
    *,
    overrides: Sequence[str] = (),
    backend: str | None = None,
    out: str | Path = "runs",
    cluster: str | None = None,
    address: str | None = None,
    events: RunEvents | None = None,
    stop: StopRequest | None = None,
    metrics: bool = True,
    detach: bool = False,
    run_dir: str | Path | None = None,
    resume: bool = False,
) -> RunResult:
    """Run a job spec to its end and return its result (also written to ``result.json``).
    ``metrics=False`` serves no Prometheus endpoint whatever the spec's ``monitoring`` says.
    A run for a scheduler (``address=``, a Ray cluster; the slurm backend) is submitted and
    followed to its end, or, with ``detach`` (Slurm), returned once submitted (status ``pending``,
    its ``job_id`` and ``run_dir`` in the result's data). ``run_dir``: the run directory to run
    into (the launcher inside a scheduler's job gets the one its submitter chose). ``resume``:
    continue the run in ``run_dir`` (``launch resume``): its finished stages are kept, the others
    run again and their jobs load their last checkpoints."""
    cpuclock.begin()  # the launcher's own CPU by phase (result.json's phases.launcher_cpu_s)
    loaded = job if isinstance(job, LoadedJob) else load_job(job, list(overrides))
    events = events or PlainEvents()
    stop = StopRequest() if stop is None else stop  # an unset StopRequest is falsy
    runner = resolve(loaded, backend, cluster, address)
    if isinstance(runner, Submitter):
        return _submit(loaded, runner, out=Path(out), events=events, stop=stop, metrics=metrics, detach=detach)
    if detach:
        raise LauncherError(f"--detach: the {runner.name} backend runs the job from here; a run detaches with --cluster FILE (SSH), --address URL (Ray) or on the slurm backend", exit_code=EXIT_BAD_INPUT)
    nodes: list[NodeTarget] | None = None
    sizing: RunSizing | None = None
    pool: HostPool | None = None
    preflight: PreflightRecord | None = None
    if not runner.plans_on_own_cluster:
        checked, preflight = preflight_nodes(loaded, cluster)
        pool = HostPool.of(loaded, checked)  # hosts beyond resources.nodes are spares
        nodes = pool.active
        sizing = size_run(loaded, nodes)  # impossible requests fail here, before anything is spawned
    cpuclock.mark("preflight")
    run_id = Path(run_dir).name if run_dir else new_run_id()
    run_dir = Path(run_dir) if run_dir else Path(out).resolve() / loaded.spec.name / run_id
    found: list[str] = []
    if nodes is not None and sizing is not None and all(n.ssh is None for n in nodes):  # the checkpoints are on this machine
        found = check_checkpoint_dirs(loaded, [checkpoint_root(loaded, StagePaths.of(run_dir, size)) for size in sizing.world_sizes])
    run_dir = _make_run_dir(loaded, run_dir, out)
    if not resume and not (run_dir / LAUNCH_FILE).exists():
        record_launch(loaded, run_dir, backend, cluster_path(loaded, cluster))
    kept = finished_stages(run_dir) if resume else {}
    cpuclock.mark("run_dir")
    started = time.time()
    for line in found:
        events.message(line)
    for line in preflight_lines(preflight):
        events.message(line)
    with _stop_on_signals(stop), _serving_metrics(loaded, run_id, runner.name, events, metrics) as watched:
        cpuclock.mark("metrics")
        with runner.session(loaded):
            cpuclock.mark("session")
            if pool is None:  # a Ray cluster, a Slurm allocation: plan on what it has, known once connected
                pool = HostPool(runner.pool_nodes(loaded), [])
                sizing = size_run(loaded, pool.active)
            assert sizing is not None
            if pool.spares:
                watched.message(f"spare host(s) {', '.join(n.name for n in pool.spares)}: used when a host is lost")
            outcomes, cut_short = _run_stages(loaded, runner, pool, sizing, run_dir, stop, watched, kept=kept if resume else None)
        return finish_run(
            loaded, runner.name, run_id, run_dir, outcomes, started, watched, cut_short=cut_short, preflight=preflight, skipped=sizing.skipped
        )


def resume_run(
    run_dir: str | Path, *, events: RunEvents | None = None, stop: StopRequest | None = None, metrics: bool = True
) -> RunResult:
    """``launch resume RUN_DIR``: the run in ``run_dir`` continued, same run id, same directory,
    as it was launched (spec, overrides, backend, cluster file); its unfinished stages' jobs load
    their last checkpoints. Refuses a spec that changed since the run."""
    folder = Path(run_dir).resolve()
    refusal = backends.resume_refusal(folder)
    if refusal is not None:  # a scheduler's run: the scheduler continues it, not this machine
        raise LauncherError(f"launch resume {folder}: {refusal}", exit_code=EXIT_BAD_INPUT)
    record = LaunchRecord.read(folder)
    loaded = load_job(record.spec, list(record.overrides))
    check_unchanged(loaded, record, folder)
    if (done := nothing_to_resume(folder, record.spec)) is not None:  # a run that succeeded: its record stays as it is, byte for byte
        said, result = done
        (events or PlainEvents()).message(said)
        return RunResult(result, folder, tuple(str(folder / p) for p in result.get("plots") or ()))
    return run_job(loaded, backend=record.backend, cluster=record.cluster, run_dir=folder, resume=True, events=events, stop=stop, metrics=metrics)


def _submit(loaded: LoadedJob, runner: Submitter, *, out: Path, events: RunEvents, stop: StopRequest, metrics: bool, detach: bool) -> RunResult:
    """Plan on what the scheduler would grant (impossible requests fail here, before anything is
    submitted), hand the run over, and follow it, serving /metrics here from what the wire brings."""
    run_id = new_run_id()
    nodes = runner.target_nodes(loaded)
    run_dir = out.resolve() / loaded.spec.name / run_id
    plans = make_plans(loaded, nodes, size_run(loaded, nodes), run_dir=run_dir, master_port=0, backend=runner.name) if nodes else []
    submission = Submission(loaded, tuple(plans), out, run_id)
    with _serving_metrics(loaded, run_id, runner.name, events, metrics and not detach) as watched:
        return runner.submit(submission, events=watched, stop=stop, detach=detach)


@contextlib.contextmanager
def _serving_metrics(loaded: LoadedJob, run_id: str, backend: str, events: RunEvents, wanted: bool) -> Iterator[RunEvents]:
    """The run's events, also feeding a Prometheus endpoint on 127.0.0.1 while the run is live
    (``monitoring.enabled`` and ``metrics=True``); closed when the run ends, however it ends."""
    settings = loaded.spec.monitoring
    if not (wanted and settings.enabled):
        yield events
        return
    from launcher.monitoring.live import MetricsEvents

    metrics = MetricsEvents(loaded.spec.name, run_id, backend, settings.samples_per_step)
    try:
        url = metrics.start(settings.port)
    except OSError as exc:
        raise LauncherError(f"monitoring.port: {exc}; pick another port, 0 for a free one, or --no-metrics", exit_code=EXIT_BAD_INPUT) from None
    try:
        events.message(f"metrics: {url}")
        yield TeeEvents(events, metrics)
    finally:
        metrics.close()


def _make_run_dir(loaded: LoadedJob, run_dir: Path, out: str | Path) -> Path:
    """The run directory with the effective spec in it (one a submitter made already is kept)."""
    if (run_dir / "spec.yaml").is_file():
        return run_dir
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
        (run_dir / "spec.yaml").write_text(yaml.safe_dump(masked_spec(loaded), sort_keys=False))
    except OSError as exc:
        raise LauncherError(
            f"--out {out}: cannot create the run directory {run_dir}: {exc.strerror or exc}; expected a writable directory",
            exit_code=EXIT_BAD_INPUT,
        ) from None
    return run_dir


def _run_stages(
    loaded: LoadedJob,
    engine: StageEngine,
    pool: HostPool,
    sizing: RunSizing,
    run_dir: Path,
    stop: StopRequest,
    events: RunEvents,
    *,
    kept: Mapping[int, StageOutcome] | None = None,
) -> tuple[list[StageOutcome], Failure | None]:
    """Every stage in turn until one does not succeed. The failure, when a stage could not start
    or a stop came between stages (the stages before it are kept). ``kept``: resuming, the
    stages that had succeeded (not run again); every other stage's old files are set aside."""
    device_type = sizing.device_type
    for note in sizing_lines(sizing):
        events.note(note)
    outcomes: list[StageOutcome] = []
    for size in sizing.world_sizes:
        if kept is not None and size in kept:
            events.message(f"world size {size}: succeeded before the resume; kept")
            outcomes.append(kept[size])
            continue
        if kept is not None and (aside := set_aside(StagePaths.of(run_dir, size))) is not None:
            events.message(f"world size {size}: resuming; the interrupted attempt's files are in {aside}")
        if stop:
            return outcomes, Failure(FailureReason.INTERRUPTED, f"stopped by {stop.reason} before the stage of world size {size}")
        events.stage_started(loaded.spec.name, size, device_type, engine.name)
        try:
            plans = _plan_factory(loaded, pool, size, sizing, run_dir, engine.name)
            outcome = run_stage(plans, engine, stop=stop, events=events, replace_hosts=pool.replace_lost, adopt_hosts=pool.adopt)
        except LauncherError as exc:  # the stage could not start (a host, a port, an agent)
            reason = FailureReason.INTERRUPTED if stop else FailureReason.NOT_STARTED
            return outcomes, Failure(reason, f"the stage of world size {size} could not start: {exc}")
        finally:
            events.stage_finished()
        outcomes.append(outcome)
        if not outcome.ok:
            break
    return outcomes, None


def _plan_factory(job: LoadedJob, pool: HostPool, size: int, sizing: RunSizing, run_dir: Path, backend_name: str) -> Callable[[int], StagePlan]:
    """Plans for one stage; every attempt (restart) gets a freshly chosen rendezvous port, on the
    pool's hosts as they are then (a lost one replaced by a spare). An elastic world that lost a
    host runs the attempt on the hosts left: fewer ranks, the stage's directory and checkpoints."""
    nominal_nodes = len(pool.active)

    def make(attempt: int) -> StagePlan:
        nodes = list(pool.active)
        port = rendezvous_port(nodes)
        world = size if len(nodes) == nominal_nodes else size // nominal_nodes * len(nodes)
        return plan_stage(job, nodes, world, sizing.device_type, run_dir=run_dir, master_port=port, backend=backend_name, attempt=attempt,
                          stage_size=size, spares=pool.spares)  # fmt: skip

    return make


