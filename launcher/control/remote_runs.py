"""Runs that outlive the machine that launched them: the launching side.

``launch JOB --cluster FILE --detach`` checks what it can here (the spec, the cluster file, the
sizes), then starts the run loop on the cluster's controller host (``controller:`` in the
cluster file, else its first host) as ``python -m launcher.control.detached_controller run`` in a session
of its own, and returns with the run id. ``attach`` follows it (the same live view as a
foreground run: the controller's remote-run wire through one ssh connection), ``stop``,
``status``, ``logs``, ``fetch`` and ``resume`` find it by its run id on that host. The controller
host is reached through the registry's detacher (``launcher.backends.detacher``: the engine whose
run loop it runs, over that engine's transport); no engine is named here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from launcher import backends
from launcher.control.api import resolve
from launcher.control.nodes import check_cluster_size, cluster_path
from launcher.control.run_end import masked_spec
from launcher.control.planning import check_node_split
from launcher.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, EXIT_OK, LauncherError
from launcher.records import RunStatus, new_run_id
from launcher.results.store import RunResult
from launcher.spec.cluster import ClusterConfig, HostConfig, load_cluster
from launcher.spec.model import LoadedJob
from launcher.stage.engine import Detacher, JobInfo, StageEngine
from launcher.stage.watch import RunEvents, TeeEvents
from launcher.stage.wire import WireReader, readable


@dataclass(frozen=True)
class Detached:
    """A run started on its controller host."""

    run_id: str
    run_dir: str  # on the controller host
    host: str
    pid: int
    cluster: str = ""  # the cluster file it was started with (``--cluster``, or the spec's ``cluster``)


def wants_detached(job: LoadedJob, *, backend: str | None, cluster: str | None, address: str | None) -> bool:
    """Whether ``--detach`` means a controller on the cluster: an engine run from here (not a
    scheduler's submitter) on the hosts of a cluster file."""
    if cluster_path(job, cluster) is None:
        return False
    return isinstance(resolve(job, backend, cluster, address), StageEngine)


def controller_of(cluster: str | Path) -> HostConfig:
    return load_cluster(cluster).controller_host


def _remote() -> Detacher:
    """What reaches a run on a cluster file's controller host (the registry's detacher)."""
    remote = backends.detacher()
    if remote is None:
        raise LauncherError("no engine here runs detached on a cluster's controller host", exit_code=EXIT_BAD_INPUT)
    return remote


def detach(job: LoadedJob, *, backend: str | None, cluster: str | None, out: str, metrics: bool) -> Detached:
    """Check the run here (nothing is started when it would be refused), then start its
    controller on the cluster and return once it runs."""
    runner = resolve(job, backend, cluster, None)
    remote = backends.detacher(runner.name)
    if remote is None:
        runs = " or ".join(backends.detacher_names())
        raise LauncherError(f"--detach with a cluster file runs the {runs} backend's run loop on the cluster, not {runner.name}", exit_code=EXIT_BAD_INPUT)
    path = cluster_path(job, cluster)
    assert path is not None
    config = load_cluster(path)
    check_node_split(job)
    check_cluster_size(job, len(config.hosts), path)
    effective = job.spec.model_dump(mode="json")
    effective.update(backend=runner.name, extends=None, cluster=None)
    if job.spec.script:
        effective["script"] = str(job.script_path())  # the controller runs in this directory, not the spec's
    payload = {
        "run_id": new_run_id(),
        "job": job.spec.name,
        "out": out,
        "cwd": os.getcwd(),
        "backend": runner.name,
        "metrics": metrics,
        "spec": "# the effective spec this detached run runs (secrets unmasked: readable by you only)\n" + yaml.safe_dump(effective, sort_keys=False),
        "shown_spec": yaml.safe_dump(masked_spec(job), sort_keys=False),
        "cluster": cluster_text(config),
    }
    host = config.controller_host
    started = remote.start(host, payload)
    return Detached(str(started["run_id"]), str(started["run_dir"]), host.name, int(started["pid"]), str(path))


def cluster_text(config: ClusterConfig) -> str:
    """The cluster file as the controller reads it: every host with every setting written out
    (paths absolute: the key and known_hosts must be at the same paths on the controller)."""
    hosts = [h.model_dump(mode="json") for h in config.hosts]
    return str(yaml.safe_dump({"hosts": hosts}, sort_keys=False))


def attach(cluster: str, run: str, events: RunEvents) -> int:
    """The run's live view from its start, until it ends (its summary; its exit code). Ctrl-C
    (KeyboardInterrupt) leaves it running: the caller says so."""
    host = controller_of(cluster)
    remote = _remote()
    reader = WireReader(_OnController(events, host.name), remote.engine)
    end: dict[str, Any] | None = None
    with remote.following(host, run, wait=True) as lines:
        for line in lines:
            end = remote.end_of(line)
            if end is not None:
                break
            reader.feed_line(line)
    reader.close()
    return _ended(host, run, end or {}, events, cluster)


class _OnController(TeeEvents):
    """The controller's events as they are, but for where its ``/metrics`` endpoint is: the
    controller host's loopback, not this machine's."""

    def __init__(self, events: RunEvents, host: str) -> None:
        super().__init__(events)
        self.host = host

    def message(self, text: str) -> None:
        if text.startswith("metrics: http://127.0.0.1:"):
            port = text.rsplit(":", 1)[1].split("/")[0]
            text = f"{text} on {self.host}'s loopback (from here: ssh -L {port}:127.0.0.1:{port} {self.host})"
        super().message(text)


def _ended(host: HostConfig, run: str, end: dict[str, Any], events: RunEvents, cluster: str) -> int:
    result = end.get("result")
    where = Path(str(end.get("run_dir") or run))
    if isinstance(result, dict) and result.get("status"):
        events.finished(RunResult(result, where, tuple(str(where / p) for p in result.get("plots") or ())))
        events.message(f"the run directory is on {host.name}; launch fetch {run} --cluster {cluster} brings it here")
        try:
            return RunStatus(str(result["status"])).exit_code
        except ValueError:
            return EXIT_JOB_FAILED
    code = end.get("exit_code")
    events.message(f"run {run}: {end.get('message') or 'ended without its result'}")
    return int(code) if isinstance(code, int) and code != EXIT_OK else EXIT_JOB_FAILED


def status(cluster: str, run: str) -> JobInfo:
    return _remote().job_info(controller_of(cluster), run)


def stop(cluster: str, run: str, *, wait_s: float = 180.0) -> JobInfo:
    return _remote().stop(controller_of(cluster), run, wait_s=wait_s)


def logs(cluster: str, run: str, *, follow: bool, rank: int | None, echo: Callable[[str, str], None]) -> None:
    """The controller's output as the run showed it (``host:rank text`` and the launcher's
    words), or one rank's lines (``rank``), to now or (``follow``) until the run ends."""
    remote = _remote()
    with remote.following(controller_of(cluster), run, wait=follow) as lines:
        for line in lines:
            if remote.end_of(line) is not None:
                break
            shown = readable(line)
            if shown is None:
                continue
            source, text = shown
            if rank is not None and source.rpartition(":")[2] != str(rank):
                continue
            echo(source, text)


def fetch(cluster: str, run: str, out: str, say: Callable[[str], None]) -> Path:
    return _remote().fetch(controller_of(cluster), run, Path(out), say=say)


def resume(cluster: str, run: str) -> Detached:
    """The run's controller started again on its host, resuming the run from its last checkpoints."""
    host = controller_of(cluster)
    started = _remote().resume(host, run)
    return Detached(str(started["run_id"]), str(started["run_dir"]), host.name, int(started["pid"]))
