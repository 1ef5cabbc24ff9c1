"""``run_job``: the whole pipeline as one Python call (the CLI is a thin shell over it).

spec -> nodes (discovery) -> plan per stage -> backend under the supervisor -> aggregate ->
result.json, plots and the summary. A notebook user gets the same ``RunResult`` as the CLI.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from launcher import backends
from launcher.backends.base import Backend
from launcher.devices import discover
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.plan import LaunchPlan, NodeTarget, device_notes, make_plans, plan_stage, stage_sizes
from launcher.procutil import free_port, handling_stop_signals
from launcher.results import RunResult, aggregate
from launcher.spec import LoadedJob, load_job, mask_env
from launcher.supervisor import StageOutcome, StopRequest, run_stage


@dataclass(frozen=True)
class DryRun:
    """What a run would do: the plans and the exact commands. Nothing was spawned."""

    job: LoadedJob
    plans: tuple[LaunchPlan, ...]
    commands: tuple[tuple[str, ...], ...]  # per plan, per node
    notes: tuple[str, ...] = ()  # what the plan decided that the spec did not say outright


def local_node(visible_override: str | None = None) -> NodeTarget:
    inventory = discover(visible_override=visible_override)
    return NodeTarget(name=socket.gethostname(), address="127.0.0.1", inventory=inventory, python=sys.executable)


def resolve_nodes(job: LoadedJob, cluster: str | None) -> list[NodeTarget]:
    """This machine, or every host of a cluster file after its preflight checks. A
    ``CUDA_VISIBLE_DEVICES`` in the job's env is what its ranks will see, so it is what counts."""
    path = _cluster_path(job, cluster)
    if path is None:
        return [local_node(job.spec.env.get("CUDA_VISIBLE_DEVICES"))]
    from launcher.cluster import load_cluster, preflight

    return preflight(load_cluster(path), job)


def _cluster_path(job: LoadedJob, cluster: str | None) -> Path | None:
    """The cluster file: ``--cluster`` as given, or the spec's ``cluster`` relative to the spec."""
    if cluster:
        return Path(cluster)
    return None if job.spec.cluster is None else job.base_dir / job.spec.cluster


def _backend(job: LoadedJob, backend: str | None, cluster: str | None) -> tuple[str, type[Backend]]:
    """The backend's name and class, once it has refused what it cannot run (nothing started)."""
    name = backend or job.spec.backend
    if name not in backends.names():
        raise LauncherError(f"--backend: unknown backend '{name}' (expected one of: {', '.join(backends.names())})", exit_code=EXIT_BAD_INPUT)
    backend_cls = backends.get_backend(name)
    backend_cls.check_job(job, cluster)
    return name, backend_cls


def _masked_spec(job: LoadedJob) -> dict[str, Any]:
    """The effective spec as stored in the run directory and result.json: secrets masked."""
    effective = job.spec.model_dump(mode="json")
    effective["env"] = mask_env(effective["env"])
    return effective


def _rendezvous_port(nodes: Sequence[NodeTarget]) -> int:
    first = nodes[0]
    if first.ssh is None:
        return free_port("127.0.0.1")
    from launcher.cluster import remote_free_port

    return remote_free_port(first)


def check_job(job: LoadedJob, *, backend: str | None = None, cluster: str | None = None) -> str:
    """What ``launch validate`` can check without contacting any host: the backend, the cluster
    file, and on this machine whether the plan fits. Returns what would run; raises as launch would."""
    name, backend_cls = _backend(job, backend, cluster)
    if backend_cls.schedules_onto_cluster():
        return f"{name}: planned on the cluster when it runs"
    path = _cluster_path(job, cluster)
    if path is not None:
        from launcher.cluster import load_cluster

        config = load_cluster(path)
        return f"{name}: {len(config.hosts)} host(s) in {cluster or job.spec.cluster}, checked over SSH when it runs"
    nodes = resolve_nodes(job, None)
    device_type, sizes = stage_sizes(job, nodes)
    notes = "".join(f"; note: {n}" for n in device_notes(job, nodes, device_type))
    return f"{name}: world sizes {sizes} on {device_type} here{notes}"


def dry_run(job: LoadedJob, *, backend: str | None = None, out: str | Path = "runs", cluster: str | None = None) -> DryRun:
    name, backend_cls = _backend(job, backend, cluster)
    nodes = resolve_nodes(job, cluster)
    run_dir = Path(out).resolve() / job.spec.name / "<run-id>"
    plans = make_plans(job, nodes, run_dir=run_dir, master_port=_rendezvous_port(nodes), backend=name)
    commands = tuple(tuple(backend_cls.describe_plan(plan)) for plan in plans)
    notes = tuple(device_notes(job, nodes, plans[0].worker.device_type)) if plans else ()
    return DryRun(job, tuple(plans), commands, notes)


def _plan_factory(
    job: LoadedJob, nodes: Sequence[NodeTarget], size: int, device_type: str, run_dir: Path, backend_name: str
) -> Callable[[int], LaunchPlan]:
    """Plans for one stage; every attempt (restart) gets a freshly chosen rendezvous port."""

    def make(attempt: int) -> LaunchPlan:
        port = _rendezvous_port(nodes)
        return plan_stage(job, nodes, size, device_type, run_dir=run_dir, master_port=port, backend=backend_name)

    return make


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


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


def run_job(
    job: str | Path | LoadedJob,
    *,
    overrides: Sequence[str] = (),
    backend: str | None = None,
    out: str | Path = "runs",
    cluster: str | None = None,
    ui: Any = None,
    stop: StopRequest | None = None,
) -> RunResult:
    """Run a job spec to its end and return its result (also written to ``result.json``)."""
    from launcher.console import RunUI

    loaded = job if isinstance(job, LoadedJob) else load_job(job, list(overrides))
    name, backend_cls = _backend(loaded, backend, cluster)
    nodes: list[NodeTarget] | None = None
    if not backend_cls.schedules_onto_cluster():
        nodes = resolve_nodes(loaded, cluster)
        stage_sizes(loaded, nodes)  # impossible requests fail here, before anything is spawned
    ui = ui or RunUI()
    stop = stop or StopRequest()
    run_id = new_run_id()
    run_dir = Path(out).resolve() / loaded.spec.name / run_id
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
        (run_dir / "spec.yaml").write_text(yaml.safe_dump(_masked_spec(loaded), sort_keys=False))
    except OSError as exc:
        raise LauncherError(
            f"--out {out}: cannot create the run directory {run_dir}: {exc.strerror or exc}; expected a writable directory",
            exit_code=EXIT_BAD_INPUT,
        ) from None
    started = time.time()
    outcomes: list[StageOutcome] = []
    cut_short: dict[str, str] | None = None
    with _stop_on_signals(stop), backend_cls.session(loaded):
        if nodes is None:  # a Ray cluster: plan on what it has, known once connected
            nodes = backend_cls.pool_nodes(loaded)
        device_type, sizes = stage_sizes(loaded, nodes)
        for note in device_notes(loaded, nodes, device_type):
            ui.note(note)
        for size in sizes:
            if stop:
                cut_short = {"reason": "interrupted", "summary": f"stopped by {stop.reason} before the stage of world size {size}"}
                break
            ui.stage_started(loaded.spec.name, size, device_type, name)
            try:
                outcome = run_stage(
                    _plan_factory(loaded, nodes, size, device_type, run_dir, name),
                    backend_cls,
                    stop=stop,
                    echo=ui.echo,
                    on_progress=ui.progress,
                )
            except LauncherError as exc:  # the stage could not start (a host, a port, an agent)
                reason = "interrupted" if stop else "not_started"
                cut_short = {"reason": reason, "summary": f"the stage of world size {size} could not start: {exc}"}
                break
            finally:
                ui.stage_finished()
            outcomes.append(outcome)
            if not outcome.ok:
                break
    return finish_run(loaded, name, run_id, run_dir, outcomes, started, ui, cut_short=cut_short)


def finish_run(
    loaded: LoadedJob,
    backend_name: str,
    run_id: str,
    run_dir: Path,
    outcomes: list[StageOutcome],
    started: float,
    ui: Any,
    *,
    cut_short: dict[str, str] | None = None,
) -> RunResult:
    """Aggregate, plot, write result.json and show the summary. ``cut_short``: the failure when
    a stage could not start, or a stop came between stages; the stages before it are kept."""
    from launcher.results import attach_plots, write_result

    t_agg = time.time()
    pythonpath = loaded.spec.env.get("PYTHONPATH", "")  # where the launcher finds the job's hooks too
    result = aggregate(
        outcomes,
        job=loaded.spec.name,
        run_id=run_id,
        backend=backend_name,
        spec=_masked_spec(loaded),
        spec_hash=loaded.spec.fingerprint(),
        entrypoint=loaded.spec.entrypoint,
        params=loaded.params,
        started_at=started,
        pythonpath=pythonpath,
    )
    result["run_dir"] = str(run_dir)
    if cut_short is not None:
        result["status"] = "interrupted" if cut_short["reason"] == "interrupted" else "failed"
        result["failure"] = dict(cut_short)
    plots = attach_plots(result, run_dir, loaded.spec.entrypoint, pythonpath)
    result["phases"]["aggregate"] = round(time.time() - t_agg, 4)
    write_result(run_dir, result)
    ui.finished(result, str(run_dir))
    return RunResult(result, run_dir, tuple(plots))
