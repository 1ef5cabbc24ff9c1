"""The launcher's Prometheus endpoint: ``/metrics`` on 127.0.0.1 while a run is live.

The run loop already reads every rank's progress (the beacons the ranks write twice a second:
host numbers, never a device sync); it hands a :class:`StageSample` to
:meth:`MetricsEndpoint.update` about every 0.5 s, and Prometheus scrapes whatever the latest one
says. Nothing here touches a rank or a device.

Names and labels live here, in one place, for every exporter: this endpoint and the Ray actors
(``ray.util.metrics``) use the same names and label keys. Ray prefixes application metrics with
``ray_``, so one PromQL selector matches both sources::

    {__name__=~"(ray_)?gpulaunch_steps_total", gpulaunch_job="matmul_scaling"}

and ``max by (gpulaunch_job, run_id, world_size, rank) (...)`` folds the two into one series per
rank where both are scraped (an embedded Ray run: the launcher's endpoint and the actors report the
same rank). The job's name is the label ``gpulaunch_job``, never ``job``: Prometheus sets ``job``
itself (the scrape job's name; Ray's service-discovery file says ``job="ray"``).

Exported (with ``ray_`` in front when a Ray actor exports it):

====================================  =======  ==========================================  =====================
name                                  type     labels                                      what
====================================  =======  ==========================================  =====================
gpulaunch_steps_total                 counter  gpulaunch_job run_id world_size rank node   steps done in this stage
gpulaunch_steps_per_second            gauge    ... rank node                               step rate, last 5 s of beacons
gpulaunch_samples_per_second          gauge    ... rank node                               steps/s x samples/step
gpulaunch_step_time_seconds           gauge    ... rank node                               host time per step, recent mean
gpulaunch_last_step_time_seconds      gauge    ... rank node                               host time of the last step
gpulaunch_rank_work_seconds           gauge    ... rank node                               the rank's own compute per step
gpulaunch_straggler                   gauge    ... rank node                               1 while the rank is a straggler
gpulaunch_rank_state                  gauge    ... rank node state                         1 for the rank's current state
gpulaunch_restarts_total              counter  gpulaunch_job run_id world_size             group restarts of this stage
gpulaunch_world_size                  gauge    gpulaunch_job run_id backend                the live stage's world size
gpulaunch_step_seconds                histo.   ... rank node                               per-step host times (Ray only)
====================================  =======  ==========================================  =====================

The endpoint sees snapshots, not single steps, so it exports no histogram; the Ray actor sees
every step (its step hook) and exports ``gpulaunch_step_seconds`` with :data:`STEP_SECONDS_BUCKETS`.
Only the live stage's series are exported: when the world size changes, the old stage's series
are gone from the next scrape, and Prometheus marks them stale at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

# the names and labels, shared with the Ray actors (launcher.metric_names: standard library only)
from launcher.metric_names import (  # noqa: E402
    ENDPOINT_METRICS,
    LAST_STEP_TIME,
    RANK_STATE,
    RANK_WORK,
    RESTARTS,
    SAMPLES_PER_SECOND,
    STEP_TIME,
    STEPS,
    STEPS_PER_SECOND,
    STRAGGLER,
    WORLD_SIZE,
)

RATE_WINDOW_S = 5.0

# Where endpoints announce themselves for Prometheus's file service discovery (see
# configs/prometheus/prometheus.yml): one small JSON file per live run, removed at close. A launcher
# killed outright (SIGKILL, a lost machine) cannot remove its own, so each file names its launcher
# (pid and start time, as labels Prometheus drops after discovery: ``__meta_*``) and every endpoint
# that writes one removes the files of launchers that are gone, when it starts and every
# SD_SWEEP_S while it is live.
DEFAULT_SD_DIR = Path("/tmp/gpulaunch/prom_sd")
SD_DIR_ENV = "GPULAUNCH_PROM_SD_DIR"
SD_SWEEP_S = 10.0
SD_PID_LABEL = "__meta_gpulaunch_pid"
SD_PID_START_LABEL = "__meta_gpulaunch_pid_start"  # procutil.process_start_ticks: with the pid, the process's identity


def default_sd_dir() -> Path:
    return Path(os.environ.get(SD_DIR_ENV) or DEFAULT_SD_DIR)


# --- what the run loop hands over ----------------------------------------------------------------


@dataclass(slots=True)
class RankSample:
    rank: int
    node: str
    state: str  # the rank's phase: "starting", "importing", "running", "finished", "failed", ...
    steps: int
    last_step_s: float | None = None
    mean_step_s: float | None = None
    work_s: float | None = None
    straggler: bool = False
    beacon_t: float | None = None  # when ``steps`` was true (the beacon's time, the rank's clock): times the step rate


@dataclass(frozen=True)
class StageSample:
    job: str
    run_id: str
    backend: str
    world_size: int
    restarts: int
    ranks: tuple[RankSample, ...]
    samples_per_step: int | None  # spec: monitoring.samples_per_step


class _StepRate:
    """Steps per second of one rank from successive readings of its step count, over a short window.

    Each reading is paired with the time the count was true: the beacon's own time stamp when the
    sample carries one (``RankSample.beacon_t``, the rank's clock: only differences are used, so
    another host's clock offset cancels out), else the time of the update. Beacons and updates both
    tick every 0.5 s, out of step: timed by its update, a count is up to a beacon old, which moves
    a 5 s rate by up to 10% from one update to the next; timed by its beacon, it is exact to a step.

    The time before a rank's count first moves (spawning, importing, a resumed job loading its
    checkpoint) is not its pace: the rate starts at the first reading whose count moved, the
    reading before it standing in until a second such reading comes. A restart (the count went
    down) starts again; no fresh reading for a whole window (a rank that stopped writing beacons)
    reads 0.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.points: deque[tuple[float, int]] = deque()
        self.moved = False  # the count has moved since the tracker (re)started
        self.pre_move = False  # points[0] is the reading before the first move (a stand-in)
        self.fresh_at: float | None = None  # update time of the latest new reading
        self.by_update = False  # the readings are timed by their updates (no beacon time)

    def add(self, now: float, steps: int, t: float | None = None) -> float | None:
        at = now if t is None else t
        if self.points:
            last_t, last_steps = self.points[-1]
            if steps < last_steps or at < last_t or (t is None) != self.by_update:  # a restart counts from 0 again
                self.points.clear()
                self.moved = self.pre_move = False
            elif at == last_t:  # the same beacon again: nothing new
                return self.rate(now)
        self.fresh_at, self.by_update = now, t is None
        if not self.points:
            self.points.append((at, steps))
        elif not self.moved and steps == self.points[-1][1]:
            self.points = deque([self.points[-1], (at, steps)])  # still idle: 0 steps/s so far
        elif not self.moved:  # the first move: the idle readings before it go, but the latest
            self.moved = self.pre_move = True
            self.points = deque([self.points[-1], (at, steps)])
        else:
            self.points.append((at, steps))
            if self.pre_move:  # a second reading since the move: the stand-in goes
                self.points.popleft()
                self.pre_move = False
        while len(self.points) > 2 and at - self.points[1][0] >= self.window_s:
            self.points.popleft()  # keep one point at or beyond the window's start
        return self.rate(now)

    def rate(self, now: float) -> float | None:
        if len(self.points) < 2:
            return None
        if self.fresh_at is not None and now - self.fresh_at >= self.window_s:
            return 0.0  # no new reading for a whole window: the rank is not stepping (or not saying)
        (t0, s0), (t1, s1) = self.points[0], self.points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


class _Collector:
    """Turns the latest StageSample into metric families at scrape time (only the live stage)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sample: StageSample | None = None
        self.rates: dict[int, float | None] = {}

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration; names are fixed above

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self.lock:
            sample, rates = self.sample, dict(self.rates)
        if sample is None:
            return
        fams = {
            m.name: (CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily)(m.name, m.help, labels=m.labels)
            for m in ENDPOINT_METRICS
        }
        ws = str(sample.world_size)
        for r in sample.ranks:
            labels = [sample.job, sample.run_id, ws, str(r.rank), r.node]
            fams[STEPS.name].add_metric(labels, float(r.steps))
            rate = rates.get(r.rank)
            if rate is not None:
                fams[STEPS_PER_SECOND.name].add_metric(labels, rate)
                if sample.samples_per_step:
                    fams[SAMPLES_PER_SECOND.name].add_metric(labels, rate * sample.samples_per_step)
            for spec, value in ((STEP_TIME, r.mean_step_s), (LAST_STEP_TIME, r.last_step_s), (RANK_WORK, r.work_s)):
                if value is not None:
                    fams[spec.name].add_metric(labels, float(value))
            fams[STRAGGLER.name].add_metric(labels, 1.0 if r.straggler else 0.0)
            fams[RANK_STATE.name].add_metric(labels + [r.state], 1.0)
        fams[RESTARTS.name].add_metric([sample.job, sample.run_id, ws], float(sample.restarts))
        fams[WORLD_SIZE.name].add_metric([sample.job, sample.run_id, sample.backend], float(sample.world_size))
        yield from fams.values()


class MetricsEndpoint:
    """``/metrics`` for one run, on its own registry (several runs in one process never clash).

    ``start()`` binds (port 0: any free port) and returns the port; ``update()`` takes the latest
    :class:`StageSample` (cheap: no I/O); ``close()`` stops the server thread and frees the port.
    Usable as a context manager.
    """

    def __init__(self, *, rate_window_s: float = RATE_WINDOW_S, clock: Any = time.monotonic, sd_sweep_s: float = SD_SWEEP_S) -> None:
        self.registry: CollectorRegistry | None = None  # made when serving starts (prometheus_client imported then)
        self._collector = _Collector()
        self._starting: threading.Thread | None = None  # start(wait=False): the serving's set-up, on its own thread
        self._wake_r = self._wake_w = -1  # close() writes to the pipe the serving loop watches
        self._rate_window_s = rate_window_s
        self._clock = clock
        self._rates: dict[tuple[str, int, int], _StepRate] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sd_file: Path | None = None
        self._sd_sweep_s = sd_sweep_s
        self._sweeping = threading.Event()  # set: the sweeper stops
        self._sweeper: threading.Thread | None = None
        self.host: str | None = None
        self.port: int | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def start(
        self, host: str = "127.0.0.1", port: int = 0, *, sd_dir: os.PathLike[str] | str | None = None, sd_name: str | None = None,
        wait: bool = True,
    ) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); returns the bound port.

        ``sd_dir``: also write ``<sd_dir>/<sd_name>.json``, a Prometheus file-SD target list
        naming this endpoint (the scrape config in configs/prometheus/ reads that directory), so a
        free port needs no configuration; removed again by :meth:`close`. Before writing it, and
        every ``sd_sweep_s`` until :meth:`close`, the files there whose launcher is gone go
        (:func:`sweep_sd_dir`).

        ``wait=False``: return once the port is bound (a port in use still raises here); the rest
        (importing prometheus_client, the server thread, the discovery file) goes on on a thread of
        its own, so a launcher spawns its ranks meanwhile; a scrape that comes first waits in the
        socket's backlog. ``close`` waits for it.
        """
        if self._server is not None or self._starting is not None:
            raise RuntimeError(f"metrics endpoint already serving on {self.url}")
        listener = _listen(host, port)
        self.host, self.port = host, int(listener.getsockname()[1])
        if wait:
            self._serve(listener, sd_dir, sd_name)
        else:
            self._starting = threading.Thread(target=self._serve, args=(listener, sd_dir, sd_name), name="gpulaunch-metrics-start", daemon=True)
            self._starting.start()
        return self.port

    def _serve(self, listener: socket.socket, sd_dir: os.PathLike[str] | str | None, sd_name: str | None) -> None:
        try:
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(self._collector)
            self._server = _http_server(listener, self.registry)
        except BaseException:
            listener.close()
            raise
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=_serve_until_woken, args=(self._server, self._wake_r), name="gpulaunch-metrics", daemon=True)
        self._thread.start()
        if sd_dir is not None:
            directory = Path(sd_dir)
            sweep_sd_dir(directory)
            self._sd_file = _write_sd_file(directory, sd_name or f"gpulaunch-{os.getpid()}-{self.port}", self.target)
            self._sweeping.clear()
            self._sweeper = threading.Thread(target=self._sweep, args=(directory,), name="gpulaunch-sd-sweep", daemon=True)
            self._sweeper.start()

    def _sweep(self, directory: Path) -> None:
        while not self._sweeping.wait(self._sd_sweep_s):
            try:
                sweep_sd_dir(directory)
            except Exception:  # noqa: BLE001 - best effort: the run goes on whatever the directory holds
                pass

    @property
    def target(self) -> str:
        host = self.host or "127.0.0.1"
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.target}/metrics"

    def close(self) -> None:
        """Stop serving and free the port; idempotent."""
        if self._starting is not None:
            self._starting.join(timeout=10)
            self._starting = None
        self._sweeping.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
            self._sweeper = None
        if self._sd_file is not None:
            with contextlib.suppress(OSError):
                self._sd_file.unlink()
            self._sd_file = None
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if thread is not None:
            os.write(self._wake_w, b"x")  # the serving loop ends now, not at its next poll
            thread.join(timeout=5)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
        if server is not None:
            server.server_close()

    def __enter__(self) -> "MetricsEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- data --------------------------------------------------------------------------------------
    def update(self, sample: StageSample) -> None:
        """Take the latest progress of the live stage (from one thread, the run loop's). Step
        rates come from successive updates; a new stage (another world size or run) starts its
        ranks' rates afresh, and its series replace the old stage's at the next scrape."""
        now = self._clock()
        rates: dict[int, float | None] = {}
        live = set()
        for r in sample.ranks:
            key = (sample.run_id, sample.world_size, r.rank)
            live.add(key)
            tracker = self._rates.get(key)
            if tracker is None:
                tracker = self._rates[key] = _StepRate(self._rate_window_s)
            rates[r.rank] = tracker.add(now, r.steps, r.beacon_t)
        for key in [k for k in self._rates if k not in live]:
            del self._rates[key]
        with self._collector.lock:
            self._collector.sample = sample
            self._collector.rates = rates

    def clear(self) -> None:
        """Export nothing (between stages, say) until the next update."""
        with self._collector.lock:
            self._collector.sample = None
            self._collector.rates = {}
        self._rates.clear()


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (port 0: a free one), as prometheus_client's own server
    would bind it (the address's family, SO_REUSEADDR); a port in use says which."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family, backlog=64)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc


def _http_server(listener: socket.socket, registry: CollectorRegistry) -> Any:
    """prometheus_client's WSGI server for ``registry`` (what its ``start_http_server`` makes, quiet
    handler included) on the bound ``listener``; the caller runs its ``serve_forever``."""
    from wsgiref.simple_server import WSGIRequestHandler

    from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

    class Server(ThreadingWSGIServer):
        address_family = listener.family

    server = Server(listener.getsockname()[:2], QuietHandler, bind_and_activate=False)
    server.socket.close()
    server.socket = listener
    server.server_address = address = listener.getsockname()
    server.server_name, server.server_port = str(address[0]), int(address[1])  # what HTTPServer.server_bind sets (no reverse DNS lookup)
    server.setup_environ()
    server.set_app(make_wsgi_app(registry))
    return server


def _serve_until_woken(server: Any, wake: int) -> None:
    """``server.serve_forever``, but ended at once by a byte on ``wake`` (``serve_forever`` and its
    ``shutdown`` look for the end only between polls: every run's end waited up to 0.5 s for it)."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(server.socket, selectors.EVENT_READ)
        selector.register(wake, selectors.EVENT_READ)
        while True:
            ready = selector.select()
            if any(key.fd == wake for key, _ in ready):
                return
            server.handle_request()  # a connection is waiting: accepted now, served on its own thread


def _write_sd_file(directory: Path, name: str, target: str) -> Path:
    """``[{"targets": ["127.0.0.1:PORT"], "labels": {owner}}]`` in ``directory/name.json``, written
    atomically; the owner is this process (pid and start time). The directory is shared by every
    user's runs (like /tmp): made world-writable with the sticky bit."""
    from launcher.procutil import process_start_ticks

    if not directory.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o1777)
    owner = {SD_PID_LABEL: str(os.getpid())}
    started = process_start_ticks()
    if started is not None:
        owner[SD_PID_START_LABEL] = str(started)
    path = directory / f"{name}.json"
    tmp = directory / f".{name}.json.tmp"
    tmp.write_text(json.dumps([{"targets": [target], "labels": owner}]))
    os.replace(tmp, path)
    return path


def sweep_sd_dir(directory: Path) -> list[Path]:
    """Remove the file-SD entries in ``directory`` whose launcher is gone; the paths removed.

    An entry's launcher is gone when the pid it names is not running, or runs another process
    (its start time differs: the pid was reused). An entry that names no launcher (written before
    entries did, or by hand) goes when each of its targets is on this machine's loopback and
    refuses connections: nothing serves there any more. Another user's entry stays (the sticky
    directory lets only its owner remove it), as does one that cannot be read."""
    removed: list[Path] = []
    try:
        paths = sorted(p for p in directory.glob("*.json") if not p.name.startswith("."))
    except OSError:
        return removed
    for path in paths:
        try:
            dead = _sd_entry_is_dead(path)
        except Exception:  # noqa: BLE001 - an entry nobody can make sense of (a pid out of range, say) is left as it is
            dead = False
        if dead:
            try:
                path.unlink()
            except OSError:  # gone already (another launcher swept it), or not ours to remove
                continue
            removed.append(path)
    return removed


def _sd_entry_is_dead(path: Path) -> bool:
    try:
        groups = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return False
    owners: set[tuple[int, int | None]] = set()
    targets: list[str] = []
    for group in groups:
        labels = group.get("labels")
        labels = labels if isinstance(labels, dict) else {}
        pid, started = labels.get(SD_PID_LABEL), labels.get(SD_PID_START_LABEL)
        if isinstance(pid, str) and pid.isdigit():
            owners.add((int(pid), int(started) if isinstance(started, str) and started.isdigit() else None))
        found = group.get("targets")
        targets.extend(t for t in (found if isinstance(found, list) else []) if isinstance(t, str))
    if owners:
        return not any(_is_running(pid, started) for pid, started in owners)
    return bool(targets) and all(_refuses_connections(t) for t in targets)


def _is_running(pid: int, started: int | None) -> bool:
    """Whether ``pid`` runs and is still the process that started at ``started`` (clock ticks)."""
    from launcher.procutil import pid_alive, process_start_ticks

    if not pid_alive(pid):
        return False
    if started is None:
        return True
    now = process_start_ticks(pid)
    return now is None or now == started  # None: hidden from us (another user's) or just gone: kept this time


def _refuses_connections(target: str) -> bool:
    """Whether ``host:port`` is on this machine's loopback and nothing listens there."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    if host not in ("127.0.0.1", "::1", "localhost") or not port.isdigit():
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
