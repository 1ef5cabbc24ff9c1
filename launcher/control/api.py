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
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar, Union

import yaml

from launcher import backends
from launcher.control import cpuclock
from launcher.control.planning import RunSizing, check_node_split, checkpoint_root, make_plans, plan_stage, size_run
from launcher.control.resume import (
    LAUNCH_FILE, LaunchRecord, check_checkpoint_dirs, check_unchanged, finished_stages, nothing_to_resume, record_launch, set_aside,
)  # fmt: skip
from launcher.control.runloop import StopRequest, run_stage
from launcher.errors import EXIT_BAD_INPUT, LauncherError, PlanError
from launcher.masking import mask_env
from launcher.procutil import free_port, handling_stop_signals
from launcher.records import Failure, FailureReason, PreflightRecord, SkippedWorld, StageOutcome, new_run_id
from launcher.results.aggregate import aggregate
from launcher.results.hooks import make_plots, run_summarize, workload_module
from launcher.results.series import default_summary
from launcher.results.run_record import RunRecord
from launcher.results.store import RunResult, load_result, write_result
from launcher.hardware.devices import NodeInventory, discover
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


def local_node(visible_override: str | None = None) -> NodeTarget:
    inventory = discover(visible_override=visible_override)
    return NodeTarget(name=socket.gethostname(), address="127.0.0.1", inventory=inventory, python=sys.executable)


def cluster_path(job: LoadedJob, cluster: str | None) -> Path | None:
    """The cluster file: ``--cluster`` as given, or the spec's ``cluster`` relative to the spec."""
    if cluster:
        return Path(cluster)
    return None if job.spec.cluster is None else job.base_dir / job.spec.cluster


def resolve_nodes(job: LoadedJob, cluster: str | None) -> list[NodeTarget]:
    """The nodes to plan on, for ``validate`` and ``--dry-run``: no link check, and this
    machine's GPU health is not judged (``preflight_nodes`` does both for a run)."""
    return preflight_nodes(job, cluster, for_run=False)[0]


def preflight_nodes(job: LoadedJob, cluster: str | None, *, for_run: bool = True) -> tuple[list[NodeTarget], PreflightRecord | None]:
    """The hosts a run starts on, checked: this machine, its GPUs refused (exit 2) when one the
    job would use is unhealthy; or every host of a cluster file, its GPUs and the links between
    them, a failed host replaced by a spare (``launcher.backends.preflight_hosts``). A
    ``CUDA_VISIBLE_DEVICES`` in the job's env is what its ranks will see, so it is what counts."""
    path = cluster_path(job, cluster)
    if path is None:
        node = local_node(job.spec.env.get("CUDA_VISIBLE_DEVICES"))
        if for_run:
            check_local_gpus(job, node)
        return [node], None
    check_node_split(job)  # decided by the spec alone: no host is contacted for it
    from launcher.spec.cluster import load_cluster

    hosts = load_cluster(path)
    check_cluster_size(job, len(hosts.hosts), path)
    outcome = backends.preflight_hosts(hosts, job, network=for_run)
    return outcome.targets, outcome.record


def check_cluster_size(job: LoadedJob, hosts: int, path: Path) -> None:
    """More hosts asked for (``nodes``, or an elastic world's ``min``) than the cluster file lists:
    refused before any host is contacted."""
    res = job.spec.resources
    if res.fewest_nodes > hosts:
        asked = f"at least {res.fewest_nodes} (min)" if res.elastic else str(res.nodes)
        raise PlanError(f"{job.path}: resources.nodes: {asked} node(s) requested but {path} lists {hosts} host(s)")


def check_local_gpus(job: LoadedJob, node: NodeTarget) -> None:
    """This machine's GPUs the job would use, as NVML sees them: every problem, or nothing."""
    settings, wanted = job.spec.preflight, job.spec.resources.gpus_used()
    if not settings.gpu_health or wanted == 0:
        return
    problems = node.inventory.unfit_gpus(wanted, min_free_fraction=settings.min_free_gpu_memory)
    if problems:
        hint = "preflight.gpu_health: false (or CUDA_VISIBLE_DEVICES without that GPU) to run anyway"
        raise LauncherError("\n".join([*problems, f"preflight: nothing was started; {hint}"]), exit_code=EXIT_BAD_INPUT)


@dataclass
class HostPool:
    """The hosts a run's stages use (``resources.nodes`` of them, in the cluster file's order) and
    the spares after them: a host lost in an attempt is replaced by the next spare for the restart
    (and for every later stage)."""

    active: list[NodeTarget]
    spares: list[NodeTarget]
    fewest: int = 0  # an elastic world goes on without a lost host while this many are left (0: not elastic)

    @classmethod
    def of(cls, job: LoadedJob, nodes: Sequence[NodeTarget]) -> "HostPool":
        wanted, res = job.spec.resources.nodes, job.spec.resources
        fewest = res.fewest_nodes if res.elastic else 0
        return cls(list(nodes[:wanted]), list(nodes[wanted:]), fewest) if len(nodes) > wanted else cls(list(nodes), [], fewest)

    def replace_lost(self, hosts: set[str]) -> str:
        """Put a spare where each lost host was (its node rank: the plan keeps its shape), or, in an
        elastic world with no spare left, go on without it while ``fewest`` hosts remain; what
        happened, in one line."""
        said = []
        for name in sorted(hosts):
            index = next((i for i, n in enumerate(self.active) if n.name == name), None)
            if index is None:
                continue
            if self.spares:
                spare = self.spares.pop(0)
                self.active[index] = spare
                said.append(f"{name} lost: its ranks go to the spare host {spare.name}")
            elif self.fewest and len(self.active) - 1 >= self.fewest:
                del self.active[index]
                said.append(f"{name} lost and no spare host is left: the job goes on with {len(self.active)} host(s) (elastic, at least {self.fewest})")
            else:
                said.append(f"{name} lost and no spare host is left: the restart tries it again")
        return "; ".join(said)


def resolve(job: LoadedJob, backend: str | None, cluster: str | None, address: str | None = None) -> Runner:
    """What runs the job (an engine here, or a scheduler's submitter: the registry's choice), once
    it has refused what it cannot run (nothing started). ``--address`` means the cluster there, for
    the backend whose submitter takes an address, whatever the spec's backend."""
    runner = backends.choose(job, backend=backend, address=address)
    runner.check_job(job, cluster)
    return runner


def masked_spec(job: LoadedJob) -> dict[str, Any]:
    """The effective spec as stored in the run directory and result.json: secrets masked."""
    effective = job.spec.model_dump(mode="json")
    effective["env"] = mask_env(effective["env"])
    return effective


def rendezvous_port(nodes: Sequence[NodeTarget]) -> int:
    first = nodes[0]
    if first.ssh is None:
        return free_port("127.0.0.1")
    return backends.host_free_port(first)


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


def recorded_nodes(job: LoadedJob, cluster: str | None, inventory: str | Path) -> list[NodeTarget]:
    """The nodes a dry run plans on from a recorded inventory: this machine's place taken by the
    recorded node, or every host of the cluster file given the recorded node's GPUs and CPUs."""
    from launcher.hardware.devices import InventoryFileError, load_inventory

    try:
        recorded = load_inventory(inventory, visible_override=job.spec.env.get("CUDA_VISIBLE_DEVICES"))
    except InventoryFileError as exc:
        raise LauncherError(str(exc), exit_code=EXIT_BAD_INPUT) from None
    if cluster_path(job, cluster) is None:
        return [NodeTarget(name=recorded.hostname, address="127.0.0.1", inventory=recorded, python=sys.executable)]
    return _cluster_hosts_as(job, cluster, recorded)


def assumed_nodes(job: LoadedJob, cluster: str | None) -> list[NodeTarget]:
    """A cluster file's hosts as written, for a dry run that logs in to none: the GPUs the spec
    names (``gpus_per_node: N``; with ``auto``, none known: CPU workers, or one GPU where the spec
    demands ``device: cuda``) and this machine's CPU count stand in for what a login would tell."""
    from launcher.hardware.devices import GpuInfo, usable_cpu_count

    res = job.spec.resources
    counted = isinstance(res.gpus_per_node, int)
    gpus = 0 if res.device == "cpu" else res.gpus_per_node if isinstance(res.gpus_per_node, int) else (1 if res.device == "cuda" else 0)
    what = f"{gpus} GPU(s) per host as resources.gpus_per_node says" if counted else (
        f"{gpus} GPU per host" if gpus else "no GPU (resources.cpu_workers ranks per host)")  # fmt: skip
    cpus = usable_cpu_count()
    note = (
        f"hosts not logged in to: planned as written with {what} and this machine's {cpus} CPU(s) assumed, "
        f"the rendezvous port picked at the start; --preflight logs in and checks them, --inventory FILE plans them as a recorded node"
    )
    placeholder = tuple(GpuInfo(i, i, "GPU (assumed)", 0, None, None, f"assumed-{i}") for i in range(gpus))
    return _cluster_hosts_as(job, cluster, NodeInventory("", cpus, placeholder, "assumed", None, (note,)))


def _cluster_hosts_as(job: LoadedJob, cluster: str | None, inventory: NodeInventory) -> list[NodeTarget]:
    """Every host of the cluster file, each given ``inventory`` (under its own name): no login."""
    from launcher.spec.cluster import load_cluster

    path = cluster_path(job, cluster)
    assert path is not None
    check_node_split(job)
    hosts = load_cluster(path).hosts
    check_cluster_size(job, len(hosts), path)
    return [
        NodeTarget(name=h.name, address=h.address, inventory=replace(inventory, hostname=h.name), python=h.python, ifname=h.ifname, ssh=h)
        for h in hosts
    ]


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
        raise LauncherError(f"--detach: the {runner.name} backend runs the job from here; only slurm submits it", exit_code=EXIT_BAD_INPUT)
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


def preflight_lines(record: PreflightRecord | None) -> list[str]:
    """What the console says of the preflight: each host left out (and its spare), the links."""
    if record is None:
        return []
    lines = [swap.describe() for swap in record.left_out]
    net = record.network
    if net is not None and net.median_gbit_s is not None:
        slowest = min((link for link in net.links if link.gbit_s is not None), key=lambda link: link.gbit_s or 0.0)
        hosts = len({link.src for link in net.links} | {link.dst for link in net.links})
        lines.append(f"network: {len(net.links)} links between {hosts} hosts in {net.seconds:.1f} s, "
                     f"median {net.median_gbit_s:.3g} Gbit/s, slowest {slowest.describe()}")
    return lines


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
            outcome = run_stage(plans, engine, stop=stop, events=events, replace_hosts=pool.replace_lost)
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
        return plan_stage(job, nodes, world, sizing.device_type, run_dir=run_dir, master_port=port, backend=backend_name, attempt=attempt, stage_size=size)

    return make


def finish_run(
    loaded: LoadedJob,
    backend_name: str,
    run_id: str,
    run_dir: Path,
    outcomes: list[StageOutcome],
    started: float,
    events: RunEvents,
    *,
    cut_short: Failure | None = None,
    preflight: PreflightRecord | None = None,
    skipped: Sequence[SkippedWorld] = (),
) -> RunResult:
    """Aggregate, summarise, plot, write result.json and tell the watcher. ``cut_short``: the
    failure when a stage could not start, or a stop came between stages. The record is built
    once and every addition makes a new one; the document is made from it at the end."""
    t_agg = time.time()
    record = aggregate(
        outcomes, job=loaded.spec.name, run_id=run_id, backend=backend_name, spec=masked_spec(loaded),
        spec_hash=loaded.spec.fingerprint(), params=loaded.params, started_at=started, cut_short=cut_short,
        previous=load_result(run_dir),  # a run resumed: its record so far, every attempt of it kept
    )  # fmt: skip
    module, summary = _summary(loaded, record)
    record = replace(record, run_dir=str(run_dir), summary=summary, preflight=preflight, skipped_worlds=tuple(skipped))
    document = record.to_dict()  # what the job's plot hook and TensorBoard read, as they always have
    plots, plot_error = make_plots(document, run_dir, module)
    tensorboard, tensorboard_error = _write_tensorboard(document, run_dir)
    record = replace(
        record, plots=plots, plot_error=plot_error, tensorboard=tensorboard, tensorboard_error=tensorboard_error,
        phases={**record.phases, "aggregate": round(time.time() - t_agg, 4)},
    )  # fmt: skip
    record = replace(record, launcher_cpu=cpuclock.record())  # up to here: the launcher's own CPU by phase
    write_result(run_dir, record)
    run = RunResult.of(record, run_dir)
    events.finished(run)
    return run


def _summary(loaded: LoadedJob, record: RunRecord) -> tuple[Any, dict[str, Any]]:
    """The job's module (for its hooks) and the run's summary: the aggregate's figures, the job's
    ``summarize`` output, or for a job without one, every series its ranks logged."""
    summary = dict(record.summary)
    module, error = _workload_module(loaded)
    if error:
        summary["error"] = error
    document = record.to_dict()
    summary.update(run_summarize(document, module, loaded.params))
    if getattr(module, "summarize", None) is None:  # no hooks: every logged series, per rank
        summary.update(default_summary(document))
    return module, summary


def _write_tensorboard(result: Mapping[str, Any], run_dir: Path) -> tuple[str | None, str | None]:
    """Every ``ctx.metrics`` series as TensorBoard scalars, once, at the end (``tensorboard
    --logdir runs/``): their directory relative to the run's, or what went wrong; nothing when the
    optional ``tensorboard`` package is not installed."""
    from launcher.results.tensorboard import write_scalars

    try:
        written = write_scalars(result, run_dir)
    except Exception as exc:  # noqa: BLE001 - an optional extra must never cost the run its results
        return None, f"{type(exc).__name__}: {exc}"
    return ("tensorboard" if written else None), None


def _workload_module(loaded: LoadedJob) -> tuple[Any, str | None]:
    """The job's module for its hooks (found on the spec's PYTHONPATH too), or what its own import
    raised: noted in the summary, and the run's results stay."""
    try:
        return workload_module(loaded.spec.entrypoint, loaded.spec.env.get("PYTHONPATH", "")), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the workload's own import
        return None, f"importing the workload: {type(exc).__name__}: {exc}"
