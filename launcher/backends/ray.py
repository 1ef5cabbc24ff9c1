"""The Ray engine: one Ray actor per rank, reserved together in a placement group.

The actors run the same per-rank runtime as torchrun's workers (``launcher.runtime.worker.run_rank``)
with the env torchrun would give them (``StagePlan.rank_env``, laid out by ``stage.plan.place_ranks``),
and form one torch.distributed process group whose address and port come from rank 0's node.
``RayEngine.session`` starts an embedded local Ray once per run (dashboard on 127.0.0.1) and shuts
it down completely at the end; inside a Ray job (``launch --address``, see
``launcher.backends.ray_jobs``) it connects to that cluster.

Lifecycle of one stage: ``start`` creates the placement group (gang scheduling: all bundles or
none) and the named actors ``<job>-rank<k>``; ``poll`` waits for the group within
``timeouts.rendezvous_s``, then hands every actor its env and runs it. The stage's live channel is
batched per node: one ``NodeRelay`` actor on each node of the stage (no CPU reserved) gathers its
co-located ranks' output lines and beacons and sends everything new of all of them, at most every
``RELAY_BATCH_S`` and at least every ``DRAIN_WAIT_S``, over one TCP connection to the stage's
sink in this process (``ray_sink``: authenticated by a per-stage token, off Ray's object path,
whose cost per answer was most of the driver's CPU at 1,024 actors); a relay that cannot reach
the driver answers over Ray instead (a streaming generator), and a node whose relay is lost falls
back to one ``drain`` per actor, the channel before relays: the launcher's calls grow with the
nodes, not the ranks. Each ``run`` returns the rank's report (looked at every ``RUN_CHECK_S``:
how the launcher learns of a dead actor too). ``stop`` kills the actors and relays and removes the group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, TypeVar

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from launcher.errors import BackendError, LauncherError, PlanError
from launcher.evidence import RankEvidence
from launcher.procutil import cmdline, descendants, kill_now, pid_alive, process_start_ticks, wait_gone
from launcher.protocol import ACTOR_DIED, ENV_RAY_CONNECT, STOP_NOTICE_SIGNAL, RankProgress, RankReport, StagePaths
from launcher.records import RankExit
from launcher.hardware.devices import GpuInfo, NodeInventory
from launcher.backends.ray_sink import RelaySink, Taken
from launcher.backends.ray_inplace import RayKeeper, first_line
from launcher.runtime.hangdump import gather_as_dicts
from launcher.runtime.inplace import ENV_GEN, ENV_KEEPER, KEEPER_LAUNCHER
from launcher.runtime.stepcount import counter_path, read_steps
from launcher.runtime.ray_actor import NodeRelay, RankActor
from launcher.spec.model import RaySettings
from launcher.stage.engine import HandleStatus, LaunchRequest, StageEngine, StageHandle
from launcher.stage.events import RankBeacon, RankExited, RankReported, RanksLost
from launcher.stage.logrouting import LogRouter
from launcher.stage.plan import NodeTarget, RankPlacement, StagePlan, place_ranks

CONNECT_ENV = ENV_RAY_CONNECT  # set by launcher.backends.ray_jobs: connect to the cluster, never embed
# what torchrun gives a script besides the rank layout; a Ray rank gets the same
TORCHRUN_SCRIPT_ENV = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DRAIN_WAIT_S = 0.5
RELAY_BATCH_S = 0.25  # a node's relay answers at most this often (a torchrun agent forwards every 0.25 s)
RELAY_START_S = 20.0  # a relay with no answer by then (not scheduled: its node drained, say): a drain per rank there
RUN_CHECK_S = 0.25  # how often the ranks' run calls are looked at for a report or a dead actor
NODE_DRAIN_CHECK_S = 1.0  # how often a running stage asks the GCS whether one of its nodes is being drained
# The ranks' last words at a stage's end: a bound, not a wait (the drains answer as soon as they
# have them). A relay answers after its stream's current interval and its ranks' last drains
# (NodeRelay.FINAL_WAIT_S); on a loaded machine that took over the 2 s this was, and the last lines were lost.
FINAL_DRAIN_S = 10.0
EVIDENCE_TIMEOUT_S = 30.0  # a task per node: py-spy per rank, the ranks' own accounts (3 s)
_log = logging.getLogger(__name__)


# --- the run-wide session: embedded Ray or a connection to a cluster ------------------------------


def check_dashboard_exposure(host: str, expose: bool) -> None:
    """Binding the dashboard beyond localhost needs ``ray.expose_dashboard`` and token auth on."""
    if host in LOCAL_HOSTS:
        return
    if not expose:
        raise LauncherError(
            f"ray.dashboard_host: {host!r} exposes the Ray dashboard beyond this machine; "
            "set ray.expose_dashboard: true (and keep token auth on) to allow it",
            exit_code=2,
        )
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        raise LauncherError(
            "ray.expose_dashboard: refused because RAY_AUTH_MODE=disabled; an exposed dashboard needs "
            "token auth (unset RAY_AUTH_MODE or set it to 'token')",
            exit_code=2,
        )


def check_single_pool(job: Any) -> None:
    """On Ray the whole cluster is one pool and the placement group picks the nodes, so
    ``resources.nodes`` stays 1; say what to set instead (exit 2, before anything is started)."""
    res = job.spec.resources
    if res.nodes == 1:
        return
    n = res.nodes
    gpus = f"resources.gpus_per_node: {res.gpus_per_node * n}" if isinstance(res.gpus_per_node, int) else "resources.gpus_per_node: auto (every GPU of the cluster)"
    cpus = f"resources.cpu_workers: {res.cpu_workers * n}" if isinstance(res.cpu_workers, int) else "resources.cpu_workers: auto (every CPU of the cluster)"
    total = {"cuda": gpus, "cpu": cpus}.get(res.device, f"{gpus} on GPUs, {cpus} on CPUs")
    raise PlanError(
        f"{job.path}: resources.nodes: {n} is not used with the Ray backend: Ray plans on the whole "
        f"cluster as one pool and its placement group chooses the nodes. Set resources.nodes: 1 with "
        f"the total instead ({total}), and ray.placement: spread (or strict_spread) to put the ranks "
        f"on different nodes"
    )


def job_metadata(spec: Any) -> dict[str, str]:
    """What the dashboard's Jobs view shows for a run (Ray metadata values are strings): the
    spec's world sizes, or "auto" where the job plans them on what the cluster has when it runs."""
    sizes = list(spec.world_sizes or [])
    return {
        "job_name": spec.name,
        "world_size": str(max(sizes)) if sizes else "auto",
        "world_sizes": ",".join(map(str, sizes)) or "auto",
        "spec_hash": spec.fingerprint(),
        "launcher": "gpulaunch",
    }


def ray_processes(session_dir: str | None, before: set[int]) -> dict[int, int | None]:
    """The embedded Ray's processes, pid -> start ticks: this process's descendants that started
    after ``ray.init`` (not in ``before``) and either name Ray's session dir on their command line
    (gcs_server, raylet, dashboard, monitors) or run below one that does (workers, agents, the
    dashboard's subprocesses). Anything else this process started (a notebook's or a service's own
    subprocesses) is not Ray's and is never touched."""
    if not session_dir:
        return {}
    roots = [p for p in descendants(os.getpid()) if p not in before and any(session_dir in arg for arg in cmdline(p))]
    ours = set(roots)
    for root in roots:
        ours.update(descendants(root))
    return {p: process_start_ticks(p) for p in ours - before}


def _kill_leftovers(pids: dict[int, int | None]) -> None:
    """SIGKILL, by pid, what the embedded Ray left behind (checked by start time against reuse)."""
    alive = [p for p in wait_gone(list(pids), 10.0) if process_start_ticks(p) == pids[p]]
    kill_now(alive)
    for pid in alive:  # our own children that died: reap them so no zombie remains
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _embedded_cpus(job: Any) -> int:
    res = job.spec.resources
    wanted = [res.cpu_workers] if isinstance(res.cpu_workers, int) else []
    wanted += list(job.spec.world_sizes or [])
    return max([os.cpu_count() or 1, *wanted])


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """An embedded Ray on 127.0.0.1 alone. Ray swaps 127.0.0.1 for the machine's address (and its
    servers listen on every interface) unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: set for the
    processes ray.init starts (they inherit it) and for this one's already-read constant."""
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_RAY_CLUSTER_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_CLUSTER_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_RAY_CLUSTER_ENV, None)
        else:
            os.environ[_RAY_CLUSTER_ENV] = saved_env


_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def ray_session(job: Any) -> Iterator[None]:
    """Connect to Ray for one run: the user's own ``ray.init``, a cluster (inside a Ray job), or an
    embedded local Ray that is shut down completely, every process of it gone, on exit."""
    settings = job.spec.ray
    check_dashboard_exposure(settings.dashboard_host, settings.expose_dashboard)
    if ray.is_initialized():  # a notebook that called ray.init itself keeps its Ray
        yield
        return
    from ray.job_config import JobConfig

    job_config = JobConfig(metadata=job_metadata(job.spec))
    common = dict(namespace=settings.namespace, log_to_driver=False, logging_level=logging.WARNING, job_config=job_config)
    embedded = not os.environ.get(CONNECT_ENV)
    before = set(descendants(os.getpid())) if embedded else set()
    auth = _AuthWords()
    try:
        if embedded:
            with _loopback_only(), auth.listening(), _keeping_stop_handlers():
                ctx = ray.init(
                    address="local",
                    num_cpus=_embedded_cpus(job),
                    include_dashboard=True,
                    dashboard_host=settings.dashboard_host,
                    object_store_memory=256 * 1024**2,
                    _node_ip_address="127.0.0.1",
                    **common,
                )
        else:
            with _keeping_stop_handlers():
                ctx = ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", **common)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise BackendError(f"cannot start Ray: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if ctx.dashboard_url:
        print(f"Ray dashboard: http://{ctx.dashboard_url}  ({'embedded' if embedded else 'cluster'}, namespace {settings.namespace}{auth.said})",
              file=sys.stderr, flush=True)  # fmt: skip
    if auth.disabled:
        print("gpulaunch: this Ray runs without token authentication: anyone who can reach its ports can run code there "
              "(docs/backends/ray.md, token auth)", file=sys.stderr, flush=True)  # fmt: skip
    session_dir = (getattr(ctx, "address_info", None) or {}).get("session_dir")
    try:
        yield
    finally:
        ours = ray_processes(session_dir, before) if embedded else {}
        ray.shutdown()
        if ours:
            _kill_leftovers(ours)
        if embedded and session_dir:
            forget_discovery(session_dir)


@contextlib.contextmanager
def _keeping_stop_handlers() -> Iterator[None]:
    """``ray.init`` installs its own SIGTERM handler (it exits the process at once): the run's
    handlers, set before it, stay, so a SIGTERM still stops the stage, tears it down and writes
    the result as it does on every other backend."""
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():  # handlers are the main thread's
            for signum, handler in kept.items():
                if handler is not None:
                    signal.signal(signum, handler)


DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # Ray's Prometheus file-SD list of its nodes' metrics ports


def forget_discovery(session_dir: str) -> bool:
    """Remove what the embedded Ray wrote for Prometheus once it is gone: its session's discovery
    file, and the link to it in Ray's temp root (``/tmp/ray/prom_metrics_service_discovery.json``,
    which the shipped Prometheus config reads), left alone when another Ray has taken it since.
    Else Prometheus keeps scraping the dead cluster's ports (targets down). True: it was ours."""
    session = Path(session_dir)
    link = session.parent / DISCOVERY_FILE
    ours = False
    with contextlib.suppress(OSError):
        ours = link.is_symlink() and Path(os.path.realpath(link)).parent == Path(os.path.realpath(session))
        if ours:
            link.unlink()
    with contextlib.suppress(OSError):
        (session / DISCOVERY_FILE).unlink()
    return ours


class _AuthWords(logging.Filter):
    """Ray's own WARNING about its token authentication, said at every ``ray.init`` ("Token
    authentication is enabled ... Set RAY_AUTH_MODE=disabled to opt out"), kept off the console:
    the launcher says it in its own words instead (on: beside the dashboard's address; off: a line
    a user must act on)."""

    LOGGER = "ray._private.authentication.authentication_token_setup"

    def __init__(self) -> None:
        super().__init__()
        self.enabled = self.disabled = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        self.enabled |= "Token authentication is enabled" in text
        self.disabled |= "Token authentication is disabled" in text
        return False

    @contextlib.contextmanager
    def listening(self) -> Iterator[None]:
        logger = logging.getLogger(self.LOGGER)
        logger.addFilter(self)
        try:
            yield
        finally:
            logger.removeFilter(self)

    @property
    def said(self) -> str:
        return ", token auth on" if self.enabled or os.environ.get("RAY_AUTH_MODE") == "token" else ""


# --- the backend -------------------------------------------------------------------------------------


class RayEngine(StageEngine):
    name = "ray"

    def session(self, job: Any) -> Any:
        return ray_session(job)

    @property
    def plans_on_own_cluster(self) -> bool:
        return bool(os.environ.get(CONNECT_ENV))  # inside a Ray job: the cluster, not this node

    def check_job(self, job: Any, cluster: str | None) -> None:
        if cluster or job.spec.cluster:
            where = "--cluster" if cluster else f"{job.path}: cluster"
            raise PlanError(
                f"{where}: a cluster file is for the torchrun backend over SSH; the Ray backend runs on a "
                "Ray cluster (--address, or an embedded Ray on this machine)"
            )
        check_single_pool(job)

    def pool_nodes(self, job: Any) -> list[NodeTarget]:
        """The whole Ray cluster as one pool to plan on: its alive nodes' CPUs and GPUs summed.
        Where each rank lands is the placement group's choice (``ray.placement``); each rank's
        threads are set per node once it is placed. ``check_job`` has already refused
        ``resources.nodes`` > 1."""
        return [pool_node(ray.nodes(), ray.util.get_node_ip_address())]

    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        """What ``--dry-run`` prints: the gang Ray is asked to reserve and the actors it will run."""
        bundle = _bundle(plan.device_type)
        return LaunchRequest(
            "ray",
            (
                f"placement group {plan.job}-world{plan.world_size}: {plan.world_size} x {bundle}, strategy {_settings(plan).placement.upper()}",
                *(f"ray actor {plan.job}-rank{r.rank}: launcher.runtime.worker.run_rank in a {plan.pg_backend} process group" for r in plan.ranks),
            ),
            ("local ranks, threads and the rendezvous follow the nodes the placement group chooses",),
        )

    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        stage = RayStage(plan, logs)
        stage.start()
        return stage


def pool_node(nodes: list[dict[str, Any]], address: str) -> NodeTarget:
    """A Ray cluster's alive nodes (``ray.nodes()``, or the dashboard's list) as one node to plan on."""
    alive = [n for n in nodes if n.get("Alive")]
    cpus = sum(int(n.get("Resources", {}).get("CPU", 0)) for n in alive)
    gpus = sum(int(n.get("Resources", {}).get("GPU", 0)) for n in alive)
    inventory = NodeInventory(
        hostname=f"ray cluster ({len(alive)} nodes)",
        cpu_count=max(1, cpus),
        gpus=tuple(GpuInfo(i, i, "GPU (Ray resource)", 0, None, None, f"ray-gpu-{i}") for i in range(gpus)),
        source="ray",
    )
    return NodeTarget(name="ray", address=address, inventory=inventory, python=sys.executable)


class RayStage(StageHandle):
    """One stage's actors: scheduling (the gang), then running, then stopped."""

    relay_per_node = True  # False: one drain per actor, the channel before relays (benchmarks/ray_event_path.py measures both)
    relay_socket = True  # False: the relays answer over Ray's streams, the channel before the sink
    run_check_s = RUN_CHECK_S  # 0: every turn, as before

    def __init__(self, plan: StagePlan, logs: LogRouter) -> None:
        super().__init__(plan, logs)
        self._pg: Any = None
        self._actors: list[Any] = []
        self._probes: dict[int, dict[str, Any]] = {}
        self._probe_refs: dict[Any, int] = {}
        self._runs: dict[Any, int] = {}
        self._drains: dict[Any, int] = {}  # a rank's own drain in flight (no relay on its node)
        self._relays: dict[str, Any] = {}  # node id -> its NodeRelay
        self._relay_streams: dict[Any, str] = {}  # a node's stream of answers -> the node id
        self._relay_drains: dict[Any, str] = {}  # a node's last drain at the stage's end -> the node id
        self._relay_silent: dict[str, float] = {}  # node id -> when its relay must have answered
        self._relay_serves: dict[Any, str] = {}  # a relay's serve call (its answers over the sink) -> the node id
        self._sink: RelaySink | None = None  # where the relays send their answers (None: over Ray's streams)
        self._next_run_check = 0.0
        self._node_ranks: dict[str, list[int]] = {}  # node id -> its ranks
        self._stage_dirs: dict[int, str] = {}  # rank -> its files' folder on its node (another node's is its own)
        self._reports: dict[int, RankReport] = {}
        self._died: dict[int, str] = {}
        self._state = "new"
        self._deadline = 0.0
        self._failure = ""
        self._next_drain_check = 0.0
        self._noticed_drain = False
        self._run_args: dict[int, tuple[str, dict[str, str], bool]] = {}  # rank -> its run call's arguments (a replacement's too)
        self._keeper: RayKeeper | None = None  # recovery in place of a lost actor (``launcher.backends.ray_inplace``)
        self._replacement_probes: dict[int, Any] = {}  # rank -> its replacement actor's probe (its pid, for the stop)

    def start(self) -> None:
        if not ray.is_initialized():
            raise BackendError("the Ray engine runs inside its session (use launcher.run_job)")
        self.plan.stage_dir.mkdir(parents=True, exist_ok=True)
        bundle = _bundle(self.plan.device_type, self.plan.worker.ranks_per_gpu)
        strategy = _settings(self.plan).placement.upper()
        self._pg = placement_group([dict(bundle) for _ in self.plan.ranks], strategy=strategy, name=f"{self.plan.job}-world{self.plan.world_size}")
        self._deadline = time.monotonic() + self.plan.worker.rendezvous_timeout_s
        for r in self.plan.ranks:
            name = f"{self.plan.job}-rank{r.rank}"
            try:
                actor = self._new_actor(name, r.rank)
            except ValueError as exc:
                self.stop()
                namespace = ray.get_runtime_context().namespace
                raise BackendError(f"cannot create actor {name} in namespace {namespace}: {exc} (another run of this job?)") from None
            self._actors.append(actor)
            self._probe_refs[actor.probe.remote(r.rank == 0)] = r.rank
        self._state = "scheduling"

    def _new_actor(self, name: str, rank: int) -> Any:
        """Rank ``rank``'s actor, in its bundle of the stage's placement group (its node, its reservation)."""
        bundle = _bundle(self.plan.device_type, self.plan.worker.ranks_per_gpu)
        return ray.remote(RankActor).options(
            name=name,
            namespace=ray.get_runtime_context().namespace,
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_concurrency=4,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
        ).remote(self.plan.job, rank)

    def _respawn(self, rank: int, gen: int) -> Any:
        """A new actor in lost rank ``rank``'s place, its run started to join generation ``gen`` of the group."""
        actor = self._new_actor(f"{self.plan.job}-rank{rank}-gen{gen}", rank)
        config_json, env, same_node = self._run_args[rank]
        self._actors[rank] = actor
        self._runs[actor.run.remote(config_json, {**env, ENV_GEN: str(gen)}, same_node)] = rank
        self._drains[actor.drain.remote(DRAIN_WAIT_S)] = rank  # its node's relay counts the lost one gone
        self._replacement_probes[rank] = actor.probe.remote(False)
        return actor

    # poll ---------------------------------------------------------------------------------------
    def poll(self) -> HandleStatus:
        if self._state == "scheduling":
            self._poll_scheduling()
        if self._state == "running":
            self._pump_logs()
            if time.monotonic() >= self._next_run_check:
                # one ray.wait over every rank's run (0.5 ms of CPU at 1,024) as often as a report
                # or a death needs to be seen, not every turn of the run loop
                self._next_run_check = time.monotonic() + self.run_check_s
                self._poll_runs()
                self._poll_serves()
            self._watch_node_drains()
        if self._state == "failed":
            return HandleStatus(done=True, ok=False, detail=self._failure)
        if self._state == "running" and len(self._reports) == len(self.plan.ranks):
            ok = all(r.ok for r in self._reports.values())
            return HandleStatus(done=True, ok=ok, detail="" if ok else "a rank reported a failure")
        return HandleStatus(done=False)

    def _poll_scheduling(self) -> None:
        for rank, ref in _take_ready(self._probe_refs):
            try:
                self._probes[rank] = ray.get(ref)
            except RayError as exc:
                self._fail(f"actor {self.plan.job}-rank{rank} could not start: {first_line(exc)}")
                return
        if not self._probe_refs:
            self._launch_runs()
        elif time.monotonic() > self._deadline:
            self._fail(self._gang_timeout_message())

    def _gang_timeout_message(self) -> str:
        n, bundle = len(self.plan.ranks), _bundle(self.plan.device_type)
        try:
            available = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        except RayError:
            available, total = {}, {}
        return (
            f"gang scheduling timed out after timeouts.rendezvous_s={self.plan.worker.rendezvous_timeout_s:g}s: "
            f"the Ray cluster could not reserve {n} x {bundle} together (all or nothing, "
            f"placement {_settings(self.plan).placement}); cluster total {total}, available {available}"
        )

    def _launch_runs(self) -> None:
        """Every rank is placed: plan the layout the placement group chose, then run the ranks."""
        node_cpus = _node_cpus()
        placements = [self._placement(rank, probe, node_cpus) for rank, probe in sorted(self._probes.items())]
        placed = self.plan = place_ranks(self.plan, placements)  # the run loop reads hosts and devices from here
        local_node = ray.get_runtime_context().get_node_id()
        keeps = placed.world_size > 1  # a lost actor replaced in place, where the job opted in (``ray_inplace``)
        for slot, actor in zip(placed.ranks, self._actors):
            env = {**placed.rank_env(slot), **TORCHRUN_SCRIPT_ENV, **({ENV_KEEPER: KEEPER_LAUNCHER} if keeps else {})}
            worker = placed.worker_for(placed.nodes[slot.node_rank])
            same_node = self._probes[slot.rank]["node_id"] == local_node
            self._run_args[slot.rank] = (worker.to_json(), env, same_node)
            self._runs[actor.run.remote(*self._run_args[slot.rank])] = slot.rank
            self._node_ranks.setdefault(self._probes[slot.rank]["node_id"], []).append(slot.rank)
        if keeps:
            self._keeper = RayKeeper(attempt=worker.attempt, world_size=placed.world_size, stage_dir=self.plan.stage_dir, respawn=self._respawn,
                                     log=self._say)  # fmt: skip
        self._start_channel()
        self._state = "running"

    def _start_channel(self) -> None:
        """The live channel: a relay per node, the launcher's one call for the node's answers
        (over the stage's sink, or Ray's stream where there is none), or a drain per rank."""
        if self.relay_per_node and self.relay_socket:
            self._sink = self._open_sink()
        for node_id, ranks in self._node_ranks.items():
            relay = None
            if self.relay_per_node:
                try:
                    relay = self._relays[node_id] = self._make_relay(node_id, ranks)
                except (RayError, ValueError) as exc:
                    _log.info("no relay on node %s (%s): a drain per rank there", node_id[:12], first_line(exc))
            if relay is None:
                for rank in ranks:
                    self._drains[self._actors[rank].drain.remote(DRAIN_WAIT_S)] = rank
            elif self._sink is not None:
                self._relay_serves[relay.serve.remote(DRAIN_WAIT_S, RELAY_BATCH_S)] = node_id
                self._relay_silent[node_id] = time.monotonic() + RELAY_START_S
            else:
                self._start_stream(node_id)

    def _open_sink(self) -> RelaySink | None:
        """The stage's sink, on the address the relays reach this driver at (Ray's address of
        its node: 127.0.0.1 for an embedded Ray); None (the relays answer over Ray) if it cannot listen."""
        try:
            return RelaySink(ray.util.get_node_ip_address())
        except (OSError, RayError) as exc:
            _log.info("no sink for the relays (%s): their answers over Ray's streams", first_line(exc))
            return None

    def _start_stream(self, node_id: str) -> None:
        relay = self._relays[node_id]
        self._relay_streams[relay.stream.options(num_returns="streaming").remote(DRAIN_WAIT_S, RELAY_BATCH_S)] = node_id
        self._relay_silent[node_id] = time.monotonic() + RELAY_START_S

    def _make_relay(self, node_id: str, ranks: list[int]) -> Any:
        """A ``NodeRelay`` pinned to the node (its ranks' beacon files are there), no CPU reserved,
        told the sink's address and the stage's token (at its creation: never sent again)."""
        remote_relay = ray.remote(NodeRelay).options(
            num_cpus=0,
            max_concurrency=2,  # its serve (or stream) and the stage's last drain
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        sink = self._sink.address_for(node_id) if self._sink is not None else None
        return remote_relay.remote({rank: self._actors[rank] for rank in ranks}, sink)

    @staticmethod
    def _placement(rank: int, probe: dict[str, Any], node_cpus: dict[str, float]) -> RankPlacement:
        """Where Ray put a rank, as the planner needs it: its node's CPUs are Ray's count capped
        by the cores the actor may run on (not the whole cluster's CPUs over the world size)."""
        known = [c for c in (node_cpus.get(probe["node_id"]), probe.get("cpus")) if c]
        return RankPlacement(
            rank=rank,
            node_id=probe["node_id"],
            host=probe["hostname"],
            address=probe["node_ip"],
            cpus=int(min(known, default=1)),
            ifname=probe.get("ifname"),
            gpu_ids=tuple(probe["gpu_ids"]),
            port=probe.get("port"),
        )

    def _poll_runs(self) -> None:
        for rank, ref in _take_ready(self._runs):
            try:
                self._reports[rank] = RankReport.from_dict(ray.get(ref))
            except RayActorError as exc:
                if self._keeper is not None and self._keeper.take(rank, self._actors, str(exc), self._steps_at_death(rank)):
                    continue  # a new actor takes its place; the survivors wait for it (``ray_inplace``)
                self._died_of(rank, str(exc))
                self._fail(f"actor {self.plan.job}-rank{rank} died: {first_line(exc)}")
            except RayTaskError as exc:  # run_rank never raises for job errors: a launcher bug
                self._died_of(rank, str(exc))
                self._fail(f"actor {self.plan.job}-rank{rank} raised: {first_line(exc)}")
            else:
                self.emit(RankReported(self._reports[rank]))
        if any(not r.ok for r in self._reports.values()) and self._state != "failed":
            self._state = "failed"
            bad = sorted(k for k, r in self._reports.items() if not r.ok)
            self._failure = f"rank(s) {bad} failed"
        if self._keeper is not None:
            self._tend_keeper(self._keeper)

    def _tend_keeper(self, keeper: RayKeeper) -> None:
        """A recovery in place under way: given up once the stage failed otherwise, looked at, and
        a loss that was not recovered made the stage's failure (the restart path)."""
        if self._state == "failed" and keeper.recovery is not None:
            keeper.give_up(self._actors, "another rank ended during the recovery")
        given_up = keeper.poll(self._actors)
        if given_up is not None:
            rank, why = given_up
            self._died_of(rank, why)
            self._fail(f"actor {self.plan.job}-rank{rank} died: {why}")

    def _say(self, line: str) -> None:
        """A line of the launcher's own about the stage, in its output (as rank 0's host's)."""
        self.logs.route(line, self._host(0))

    def _steps_at_death(self, rank: int) -> int | None:
        """A lost rank's exact step count, where its files are on this node (else unknown)."""
        if not self._run_args[rank][2]:
            return None
        return read_steps(counter_path(StagePaths(Path(self._stage_dirs.get(rank, self.plan.stage_dir))), rank))

    def _poll_serves(self) -> None:
        """A relay's serve call that ended: it could not reach the sink (its answers over Ray's
        stream from now on), its connection broke, or the relay is gone (a drain per rank there)."""
        for node_id, ref in _take_ready(self._relay_serves):
            if node_id not in self._relays:
                continue  # already handed back (its connection closed first)
            try:
                served = ray.get(ref)
            except RayError as exc:
                self._relay_lost(node_id, False, exc)
                continue
            if served.get("connected"):
                self._relay_lost(node_id, False, ConnectionError(served.get("detail")))
            else:
                _log.info("the relay of node %s cannot reach this driver (%s): its answers over Ray", node_id[:12], served.get("detail"))
                self._start_stream(node_id)

    def _watch_node_drains(self) -> None:
        """A node of this stage being drained (the autoscaler's or KubeRay's preemption, a spot
        node's notice, ``ray drain-node``) is a stop notice to every rank: a job that watches
        ``ctx.should_stop`` saves and returns before the node goes (``launch resume`` continues it)."""
        if self._noticed_drain or time.monotonic() < self._next_drain_check:
            return
        self._next_drain_check = time.monotonic() + NODE_DRAIN_CHECK_S
        draining = _draining_nodes()
        mine = {probe["node_id"]: rank for rank, probe in self._probes.items()}
        hit = [(node, deadline_ms) for node, deadline_ms in draining.items() if node in mine]
        if not hit:
            return
        self._noticed_drain = True
        node, deadline_ms = hit[0]
        left = f", {max(0.0, deadline_ms / 1e3 - time.time()):.0f} s before it goes" if deadline_ms else ""
        host = self._host(mine[node])
        self.logs.route(f"gpulaunch: Ray is draining node {host} ({node[:12]}){left}: stop notice to every rank", host)
        self.signal_ranks(STOP_NOTICE_SIGNAL)

    def _died_of(self, rank: int, detail: str) -> None:
        """A rank whose actor died without a Python exception; its peers then fail on closed
        connections. Dated by its last sign of life (its beacon) so the root cause is this rank."""
        self._died[rank] = detail
        host = self._host(rank)
        self.emit(RankExited(RankExit(rank=rank, exitcode=None, host=host)),
                  RanksLost((rank,), host, ACTOR_DIED, first_line(detail), traceback=detail))  # fmt: skip

    def _host(self, rank: int) -> str:
        return self.plan.ranks[rank].host

    def _pump_logs(self, final: bool = False) -> None:
        self._pump_relays(final)
        for rank, ref in _take_ready(self._drains, timeout_s=FINAL_DRAIN_S if final else 0):
            try:
                drained = ray.get(ref)
            except RayError:
                continue  # the actor is gone; its last lines are in Ray's log files
            host = self._host(rank)
            for line in drained["lines"]:
                self.logs.write_rank_line(rank, host, line)
            if drained.get("beacon"):
                self.emit(RankBeacon(rank, RankProgress.from_dict(drained["beacon"]), host=host))
            if drained.get("stage_dir"):
                self._stage_dirs[rank] = drained["stage_dir"]
            if not final:
                self._drains[self._actors[rank].drain.remote(DRAIN_WAIT_S)] = rank

    def _pump_relays(self, final: bool = False) -> None:
        """Each node's answers: every line and new beacon of its ranks (at the end, its last drain too)."""
        if final:
            self._final_relays()
            return
        if self._sink is not None:
            self._take_sink(self._sink.take())
        if self._relay_streams:
            self._take_streams(final)
        if self._relay_silent:
            now = time.monotonic()
            for node_id in [n for n, due in self._relay_silent.items() if due < now]:
                self._relay_lost(node_id, final, TimeoutError(f"no answer within {RELAY_START_S:g}s"))

    def _take_sink(self, taken: Taken, final: bool = False) -> None:
        for node_id, answer in taken.answers:
            self._relayed(answer)
            self._relay_silent.pop(node_id, None)
        for node_id in taken.closed:
            if node_id in self._relays and not final:
                self._relay_lost(node_id, final, ConnectionError("its connection to this driver closed"))

    def _take_streams(self, final: bool) -> None:
        streams = list(self._relay_streams)
        ready: list[Any] = ray.wait(streams, num_returns=len(streams), timeout=0)[0]
        for stream in ready:
            node_id = self._relay_streams[stream]
            try:
                self._relayed(ray.get(next(stream)))
            except (StopIteration, RayError) as exc:  # the relay is gone (its node too, or only it)
                self._relay_lost(node_id, final, exc)
            else:
                self._relay_silent.pop(node_id, None)

    def _final_relays(self) -> None:
        """Each node's last answer (its ranks' last words), after all its relay sent before it.
        The sink is read meanwhile: a relay whose connection is full sends, then answers."""
        deadline = time.monotonic() + FINAL_DRAIN_S
        finals: dict[str, dict[str, Any]] = {}
        while self._relay_drains and time.monotonic() < deadline:
            if self._sink is not None:
                self._take_sink(self._sink.take(), final=True)
            wait_s = 0.05 if self._sink is not None else max(0.0, deadline - time.monotonic())
            for node_id, ref in _take_ready(self._relay_drains, timeout_s=wait_s):
                with contextlib.suppress(RayError):
                    finals[node_id] = ray.get(ref)
        if self._sink is not None:
            sent = {node_id: int(answer.get("seq", 0)) for node_id, answer in finals.items()}
            self._take_sink(self._sink.wait_for(sent, max(0.0, deadline - time.monotonic())), final=True)
        if self._relay_streams:
            self._take_streams(final=True)
        for answer in finals.values():
            self._relayed(answer)

    def _relay_lost(self, node_id: str, final: bool, exc: BaseException) -> None:
        """A node whose relay is gone or cut off: one drain per rank there, as before relays (a
        relay still alive is killed: it would take its ranks' lines beside their own drains)."""
        relay = self._relays.pop(node_id, None)
        for stream in [s for s, n in self._relay_streams.items() if n == node_id]:
            del self._relay_streams[stream]
        self._relay_silent.pop(node_id, None)
        if relay is not None:
            with contextlib.suppress(Exception):
                ray.kill(relay, no_restart=True)
        live = [r for r in self._node_ranks.get(node_id, []) if r not in self._died and r not in self._reports]
        _log.info("the relay of node %s is gone (%s): a drain per rank there", node_id[:12], first_line(exc))
        if not final:
            for rank in live:
                self._drains[self._actors[rank].drain.remote(DRAIN_WAIT_S)] = rank

    def _relayed(self, drained: dict[str, Any]) -> None:
        """One node's answer: its ranks' lines into their logs, their new beacons as one batch of events."""
        for rank, lines in drained["lines"].items():
            host = self._host(rank)
            for line in lines:
                self.logs.write_rank_line(rank, host, line)
        beacons = drained["beacons"]
        if beacons:
            self.emit(*(RankBeacon(rank, RankProgress.from_dict(b), host=self._host(rank)) for rank, b in beacons.items()))
        for rank, stage_dir in drained["dirs"].items():
            if stage_dir:
                self._stage_dirs[rank] = stage_dir

    def _fail(self, message: str) -> None:
        if self._state != "failed":
            self._state, self._failure = "failed", message

    # stop / collect -------------------------------------------------------------------------------
    def stop(self, grace_s: float = 5.0) -> None:
        if self._state == "stopped":
            return
        with contextlib.suppress(RayError):
            if self._state in ("running", "failed") and self._actors:
                for node_id, relay in self._relays.items():  # last words of every rank, then the kill
                    self._relay_drains[relay.drain.remote(0.0, 0.0, True)] = node_id
                relayed = {r for node_id in self._relays for r in self._node_ranks[node_id]}
                for rank in range(len(self._actors)):
                    if rank not in self._died and rank not in self._drains.values() and rank not in relayed:
                        self._drains[self._actors[rank].drain.remote(0.0)] = rank
                self._pump_logs(final=True)
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        local = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        pids = [p["pid"] for p in self._probes.values() if p["node_id"] == local]
        pids += [p["pid"] for p in self._replacements_probed() if p["node_id"] == local]
        for actor in (*self._actors, *self._relays.values()):
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        self._wait_names_free(grace_s * 2)
        wait_gone([p for p in pids if pid_alive(p)], grace_s)
        self._state = "stopped"

    def _replacements_probed(self) -> list[dict[str, Any]]:
        """What the replacement actors that answered their probe said (their pids, their nodes)."""
        refs = list(self._replacement_probes.values())
        ready = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs and ray.is_initialized() else []
        found = []
        for ref in ready:
            with contextlib.suppress(RayError):
                found.append(ray.get(ref))
        return found

    def _wait_names_free(self, timeout_s: float) -> None:
        """Actor names are reused by the next stage or restart: wait until Ray has released them."""
        if not ray.is_initialized():
            return
        deadline = time.monotonic() + timeout_s
        names = [f"{self.plan.job}-rank{r.rank}" for r in self.plan.ranks[: len(self._actors)]]
        while names and time.monotonic() < deadline:
            names = [n for n in names if _actor_exists(n)]
            if names:
                time.sleep(0.05)

    def gather_evidence(self) -> list[RankEvidence]:
        """Every rank's evidence, gathered on its own node by a task pinned there (not by the
        actor: a frozen or blocked actor cannot answer), the nodes in parallel."""
        by_place: dict[tuple[str, str], list[int]] = {}
        for rank, probe in sorted(self._probes.items()):
            by_place.setdefault((probe["node_id"], self._stage_dirs.get(rank, str(self.plan.stage_dir))), []).append(rank)
        task = ray.remote(num_cpus=0, max_retries=0)(gather_as_dicts)
        refs = {
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(stage_dir, self._host(ranks[0]), ranks): ranks
            for (node_id, stage_dir), ranks in by_place.items()
        }
        found: list[RankEvidence] = []
        for ref, ranks in refs.items():
            try:
                found += [RankEvidence.from_dict(e) for e in ray.get(ref, timeout=EVIDENCE_TIMEOUT_S)]
            except (RayError, TimeoutError) as exc:
                found += [RankEvidence(r, self._host(r), None, "unknown", "none", note=f"not gathered: {first_line(exc)}") for r in ranks]
        return sorted(found, key=lambda e: e.rank)

    def signal_ranks(self, signum: int) -> None:
        """``signum`` to every rank's actor, wherever in the cluster it runs (SIGUSR1: its stacks
        into its output, which the drain brings here)."""
        for actor in self._actors:
            with contextlib.suppress(Exception):
                actor.signal.remote(int(signum))


def _draining_nodes() -> dict[str, int]:
    """Node id -> the drain's deadline (ms since the epoch; 0: none) for every node the GCS is
    draining. Ray offers this through its internal state accessor only: an API that moved or
    failed means no drain is seen (the stage runs on as before)."""
    try:
        from ray._private.state import state

        draining = state.get_draining_nodes()
    except Exception:  # noqa: BLE001 - an internal API: never worth a failed run
        return {}
    return {str(node): int(deadline or 0) for node, deadline in (draining or {}).items()}


def _node_cpus() -> dict[str, float]:
    """Node id -> the CPUs Ray offers on that node, for every alive node."""
    try:
        return {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")}
    except RayError:
        return {}


_K = TypeVar("_K")


def _take_ready(pending: dict[Any, _K], timeout_s: float = 0) -> list[tuple[_K, Any]]:
    """Remove from ``pending`` (object ref -> rank or node) the refs that are ready; return them as (rank, ref)."""
    refs = list(pending)
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return [(pending.pop(ref), ref) for ref in ready]


def _actor_exists(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    except RayError:
        return False
    return True


def _bundle(device_type: str, ranks_per_gpu: int = 1) -> dict[str, float]:
    """One rank's reservation: a CPU, and its GPU when the job runs on GPUs (a fraction of one,
    1/ranks_per_gpu, where ranks share them: Ray's fractional GPUs)."""
    return {"CPU": 1.0, "GPU": 1.0 / ranks_per_gpu} if device_type == "cuda" else {"CPU": 1.0}


def _settings(plan: StagePlan) -> RaySettings:
    """The spec's ``ray:`` block, as the plan carries it (``StagePlan.engine_settings``)."""
    settings = plan.engine_settings
    assert isinstance(settings, RaySettings), "a Ray stage's plan carries the spec's ray: block"
    return settings


__all__ = ["RayEngine", "ray_session", "check_dashboard_exposure"]
