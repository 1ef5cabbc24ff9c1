"""What runs inside each Ray actor: one rank of the job.

The Ray counterpart of ``launcher.runtime.agent`` + ``launcher.runtime.worker`` under torchrun: the actor captures
its own output for the launcher to stream, checks that Ray's ``CUDA_VISIBLE_DEVICES`` rewrite gave
it the GPU it was granted, and then runs the shared per-rank runtime (``launcher.runtime.worker.run_rank``)
with a step hook that exports step counters and times as Ray metrics for the dashboard. Each
node of a stage also runs one ``NodeRelay``, which drains its co-located ranks' new output lines
and reads their beacons, and sends them to the launcher over one authenticated connection
(``launcher.runtime.relay_wire``; over Ray where the launcher cannot be reached), so the launcher
sees every rank live on whichever node it runs (a node without a relay: one ``drain`` per actor).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

import ray

from launcher import metric_names as names
from launcher.runtime import relay_wire
from launcher.runtime.relay_wire import SinkAddress
from launcher.procutil import read_json, write_json_atomic
from launcher.protocol import ENV_GRANTED_GPU, ENV_HOST, ENV_RANK_DEVICE, STOP_NOTICE_SIGNAL, RankReport, WorkerConfig
from launcher.runtime.checkpoint import notify_stop, notify_watching_jobs
from launcher.hardware.devices import usable_cpu_count



class _OutputTee:
    """Captures this process's fds 1 and 2 (Python and C output alike) line by line for the
    launcher, and still writes everything to Ray's own log files."""

    def __init__(self, limit: int = 100_000) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=limit)
        self.cond = threading.Condition()
        read_fd, write_fd = os.pipe()
        self._original = os.dup(1)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        threading.Thread(target=self._pump, args=(read_fd,), daemon=True, name="gpulaunch-tee").start()

    def _pump(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for raw in pipe:
                with contextlib.suppress(OSError):
                    os.write(self._original, raw)
                with self.cond:
                    self.lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
                    self.cond.notify_all()

    def drain(self, wait_s: float) -> list[str]:
        with self.cond:
            if not self.lines and wait_s > 0:
                self.cond.wait(wait_s)
            out = list(self.lines)
            self.lines.clear()
        return out


class _StepMetrics:
    """Ray metrics for the dashboard, under the names and labels the launcher's own Prometheus
    endpoint uses (``launcher.metric_names``: ``gpulaunch_job``, never ``job``, which Prometheus
    owns). The step hook only bumps host numbers (no device sync); a thread exports them once a second."""

    RECENT = 50  # steps in the recent mean of the step time

    def __init__(self, job: str, run_id: str, world_size: int, rank: int, node: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.tags = names.rank_tags(job, run_id, world_size, rank, node)
        keys = names.RANK_LABELS
        self.counter = Counter(names.STEPS.name, description=names.STEPS.help, tag_keys=keys)
        self.mean = Gauge(names.STEP_TIME.name, description=names.STEP_TIME.help, tag_keys=keys)
        self.last = Gauge(names.LAST_STEP_TIME.name, description=names.LAST_STEP_TIME.help, tag_keys=keys)
        self.hist = Histogram(
            names.STEP_SECONDS.name, description=names.STEP_SECONDS.help, boundaries=list(names.STEP_SECONDS_BUCKETS), tag_keys=keys
        )
        self.pending: collections.deque[float] = collections.deque(maxlen=10_000)
        self.recent: collections.deque[float] = collections.deque(maxlen=self.RECENT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="gpulaunch-metrics")
        self._thread.start()

    def hook(self, _steps: int, seconds: float) -> None:  # in the step loop: host numbers only
        self.pending.append(seconds)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.flush()

    def flush(self) -> None:
        batch = []
        while self.pending:
            batch.append(self.pending.popleft())
        if not batch:
            return
        self.recent.extend(batch)
        with contextlib.suppress(Exception):  # metrics are best effort; the report is what counts
            self.counter.inc(len(batch), tags=self.tags)
            self.last.set(batch[-1], tags=self.tags)
            self.mean.set(sum(self.recent) / len(self.recent), tags=self.tags)
            for seconds in batch[-1000:]:
                self.hist.observe(seconds, tags=self.tags)

    def close(self) -> None:
        self._stop.set()
        self.flush()


class RankActor:
    """One rank. Threaded (``max_concurrency``) so the launcher can drain output while it runs."""

    def __init__(self, job: str, rank: int) -> None:
        self.job, self.rank = job, rank
        self.tee = _OutputTee()
        self.started = time.time()
        self.beacon_path: str | None = None  # this rank's beacon file, once it runs
        self.stage_dir: str | None = None  # where its files are on this node (a hang's evidence is gathered there)
        # the launcher's stack dump on a hang (RayStage.signal_ranks), as in a torchrun rank
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        # A SIGTERM to this process (its node going away, a scheduler's signal) is the job's stop
        # notice, as in a torchrun rank. The job runs in one of the actor's threads, where its own
        # handler (StopNotice) cannot be installed; the constructor runs in the main thread.
        self._ray_sigterm = signal.getsignal(signal.SIGTERM)
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """A job that reads ``ctx.should_stop`` and was not told yet: told now (it saves and
        returns). Else Ray's own handler, as before (a SystemExit in the main thread: the worker
        exits, though the rank's thread runs on to its end)."""
        if notify_watching_jobs("SIGTERM"):
            return
        if callable(self._ray_sigterm):
            self._ray_sigterm(signum, frame)
        elif self._ray_sigterm != signal.SIG_IGN:  # no handler of Ray's: the default, end now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def probe(self, want_port: bool) -> dict[str, Any]:
        ip = ray.util.get_node_ip_address()
        port = None
        if want_port:
            from launcher.procutil import free_port

            port = free_port(ip)
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ip,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "port": port,
            "ifname": interface_of(ip),
            "cpus": usable_cpu_count(),
        }

    def drain(self, wait_s: float, beacon: bool = True) -> dict[str, Any]:
        """The output lines since the last drain (waiting up to ``wait_s`` for one) and the rank's
        latest beacon: the live channel to the launcher (or to its node's ``NodeRelay``, which
        reads the beacon file itself: ``beacon=False``), on any node of the cluster."""
        lines = self.tee.drain(wait_s)
        latest = read_json(self.beacon_path) if self.beacon_path and beacon else None
        return {"lines": lines, "beacon": latest if isinstance(latest, dict) else None, "stage_dir": self.stage_dir, "beacon_path": self.beacon_path}

    def signal(self, signum: int) -> None:
        """A signal to this rank's own process (SIGUSR1: its stacks into its output); the stop
        notice goes to the job directly (its rank runs in one of the actor's threads, where no
        signal handler can be installed)."""
        if signum == STOP_NOTICE_SIGNAL:
            notify_stop("the launcher's stop notice")
            return
        os.kill(os.getpid(), signum)

    def keeper(self, operation: str, kwargs: dict[str, Any]) -> Any:
        """One of the keeper's moves on the stage's store, made from this (surviving) rank's
        process for the driver, which replaces a lost actor (``launcher.runtime.store_keeper``)."""
        from launcher.runtime.store_keeper import OPERATIONS

        return OPERATIONS[operation](**kwargs)

    def run(self, config_json: str, env: dict[str, str], same_node: bool) -> dict[str, Any]:
        """Run the rank; its report as plain data (what crosses Ray's object store)."""
        from launcher.runtime.worker import run_rank

        config = WorkerConfig.from_json(config_json)
        if not same_node:  # the launcher's stage dir is not here: keep files local, return the report
            # (its checkpoints stay at the plan's path, made on this node: a restart here finds them)
            config = dataclasses.replace(config, stage_dir=tempfile.mkdtemp(prefix="gpulaunch-"))
        self.beacon_path = str(config.paths.progress(self.rank))
        self.stage_dir = config.stage_dir
        os.environ.update(env)
        mismatch = _device_mismatch(config.device_type, env)
        if mismatch:
            return _mismatch_report(config, env, mismatch).to_dict()
        metrics = _StepMetrics(self.job, config.run_id, int(env["WORLD_SIZE"]), self.rank, env.get(ENV_HOST, socket.gethostname()))
        try:
            return run_rank(config, os.environ, spawned_at=self.started, step_hooks=[metrics.hook]).to_dict()
        finally:
            metrics.close()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()


class NodeRelay:
    """The live channel of one node's ranks, so that the launcher makes one call per node per
    interval rather than one per rank (as a torchrun node's agent forwards its ranks' beacons in
    one line every 0.25 s). A small actor (no CPU reserved) pinned to the node: it keeps one
    ``RankActor.drain`` in flight per co-located rank for their output lines (calls inside the
    node, not the launcher's), reads their beacon files itself (they are on this node), and
    answers with everything new of all of them, at most every ``batch_s`` and at least every
    ``wait_s``. The answers go over a TCP connection to the launcher's sink (``serve``: the
    launcher's one call for the whole stage; frames of ``launcher.runtime.relay_wire``, opened with
    the stage's token), off Ray's object path, whose cost per answer was most of the driver's
    CPU at 1,024 actors. Where the sink cannot be reached, ``serve`` returns at once and the
    launcher takes ``stream`` instead (a streaming generator, an answer per interval over Ray).
    ``drain(final=True)``: the last words at the stage's end. A rank whose actor is gone is left
    out (the launcher learns of its death from the rank's own ``run`` call, as before)."""

    INNER_WAIT_S = 1.0  # a rank's drain returns at once with lines, else after this: re-asked
    CHECK_S = 0.05  # once an answer is due, how often the beacon files are looked at for news
    FINAL_WAIT_S = 5.0  # the last words of every rank, at the stage's end (a bound: it returns once all have answered)
    CONNECT_S = 5.0  # the sink not reached by then: the launcher takes the stream

    def __init__(self, ranks: dict[int, Any], sink: SinkAddress | None = None) -> None:
        self.actors = dict(ranks)  # rank -> its RankActor's handle
        self.sink = sink
        self.frames_sent = 0  # answers sent over the sink's connection (each frame carries its number)
        self.finished = False  # the final answer is given: nothing more to send
        self.send_lock = threading.Lock()  # an answer taken is sent before the next (or the final) is taken
        self.inflight: dict[Any, int] = {}
        self.lines: dict[int, list[str]] = {}
        self.paths: dict[int, str] = {}  # rank -> its beacon file, once it runs
        self.dirs: dict[int, str] = {}  # rank -> its files' folder on this node, not sent yet
        self.stamps: dict[int, tuple[int, int]] = {}  # rank -> (inode, mtime) of the beacon last sent
        self.gone: set[int] = set()
        self.answered = 0.0
        self.lock = threading.Lock()

    def serve(self, wait_s: float, batch_s: float) -> dict[str, Any]:
        """``drain``'s answers one after the other over the sink's connection, until the final
        answer (or the relay is killed with its stage). Returns at once, ``connected: False``,
        where the sink cannot be reached (the launcher takes ``stream``); ``connected: True``
        once the connection breaks (the launcher sees it close: the relay is lost to it)."""
        if self.sink is None:
            return {"connected": False, "detail": "no sink"}
        try:
            sock = relay_wire.connect(self.sink, self.CONNECT_S)
        except OSError as exc:
            return {"connected": False, "detail": f"cannot reach {self.sink.host}:{self.sink.port}: {exc}"}
        with contextlib.closing(sock):
            try:
                while not self.finished:
                    with self.send_lock:
                        if self.finished:
                            break
                        answer = self.drain(wait_s, batch_s)
                        self.frames_sent += 1
                        sock.sendall(relay_wire.frame({"seq": self.frames_sent, **answer}))
            except OSError as exc:
                return {"connected": True, "detail": f"the connection broke: {exc}"}
        return {"connected": True, "detail": "finished"}

    def stream(self, wait_s: float, batch_s: float) -> Iterator[dict[str, Any]]:
        """``drain``'s answers one after the other, until the relay is killed with its stage."""
        while True:
            yield self.drain(wait_s, batch_s)

    def drain(self, wait_s: float, batch_s: float = 0.0, final: bool = False) -> dict[str, Any]:
        """``{"lines": {rank: [...]}, "beacons": {rank: {...}}, "dirs": {rank: path}}``: what is
        new since the last answer. ``final``: every rank asked at once for its last lines, after
        the answer being sent over the sink (``seq``: how many were sent before this one)."""
        if final:
            with self.send_lock, self.lock:
                self.finished = True
                self._final()
                return {"seq": self.frames_sent, **self._answer(self._beacons())}
        with self.lock:
            deadline = time.monotonic() + wait_s
            due = self.answered + batch_s
            while True:
                self._ask()
                now = time.monotonic()
                if now >= due or now >= deadline:
                    beacons = self._beacons()
                    if beacons or self.lines or self.dirs or now >= deadline:
                        break
                    pause = min(self.CHECK_S, deadline - now)
                else:
                    pause = min(due, deadline) - now
                self._collect(max(0.0, pause))
            self.answered = time.monotonic()
            return self._answer(beacons)

    def _ask(self) -> None:
        asked = set(self.inflight.values())
        for rank, actor in self.actors.items():
            if rank not in asked and rank not in self.gone:
                try:
                    self.inflight[actor.drain.remote(self.INNER_WAIT_S, False)] = rank
                except Exception:  # noqa: BLE001 - a handle of an actor already gone
                    self.gone.add(rank)

    def _collect(self, timeout_s: float, refs: list[Any] | None = None) -> None:
        """The rank drains that are done within ``timeout_s`` (all of ``refs``, or of those in flight)."""
        waiting = refs if refs is not None else list(self.inflight)
        if not waiting:
            time.sleep(timeout_s)
            return
        ray.wait(waiting, num_returns=len(waiting), timeout=timeout_s)
        ready, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=0)
        for ref in ready:
            rank = self.inflight.pop(ref)
            try:
                got = ray.get(ref)
            except ray.exceptions.RayError:
                self.gone.add(rank)
                continue
            if got["lines"]:
                self.lines.setdefault(rank, []).extend(got["lines"])
            if got.get("beacon_path") and rank not in self.paths:
                self.paths[rank] = got["beacon_path"]
                self.dirs[rank] = got.get("stage_dir") or ""

    def _final(self) -> None:
        refs = []
        for rank, actor in self.actors.items():
            if rank not in self.gone:
                with contextlib.suppress(Exception):
                    ref = actor.drain.remote(0.0, False)
                    self.inflight[ref] = rank
                    refs.append(ref)
        # every drain in flight too: one asked before may hold a rank's last lines (it answers
        # within INNER_WAIT_S), and a loaded node answers late, not never
        self._collect(self.FINAL_WAIT_S, list(self.inflight))

    def _beacons(self) -> dict[int, dict[str, Any]]:
        """The beacons rewritten since last sent (a beacon is replaced by a rename: a new inode)."""
        fresh = {}
        for rank, path in self.paths.items():
            try:
                st = os.stat(path)
            except OSError:
                continue
            stamp = (st.st_ino, st.st_mtime_ns)
            if stamp != self.stamps.get(rank):
                beacon = read_json(path)
                if isinstance(beacon, dict):
                    fresh[rank] = beacon
                    self.stamps[rank] = stamp
        return fresh

    def _answer(self, beacons: dict[int, dict[str, Any]]) -> dict[str, Any]:
        out = {"lines": self.lines, "beacons": beacons, "dirs": self.dirs}
        self.lines, self.dirs = {}, {}
        return out


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` (Linux), for GLOO_SOCKET_IFNAME: without it gloo
    binds to whatever the hostname resolves to, often 127.0.0.1, and peers on other nodes fail."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def _device_mismatch(device_type: str, env: dict[str, str]) -> str | None:
    """Ray rewrites CUDA_VISIBLE_DEVICES per actor (ray#40803); check ours took effect: the node's
    granted GPUs visible, and this rank's own at the index its plan names (``cuda:<index>``)."""
    if device_type != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    index, granted = _planned_index(env), env.get(ENV_GRANTED_GPU, "")
    if index >= len(visible) or visible[index] != granted:
        return f"rank {env['RANK']} was granted GPU {granted} but cuda:{index} is GPU {visible[index] if index < len(visible) else 'none'} (CUDA_VISIBLE_DEVICES={','.join(visible)})"
    import torch

    if torch.cuda.device_count() != len(visible):
        return f"rank {env['RANK']} sees {torch.cuda.device_count()} GPU(s), expected {len(visible)} (CUDA_VISIBLE_DEVICES={','.join(visible)}; was CUDA initialised before the launcher set it?)"
    return None


def _planned_index(env: dict[str, str]) -> int:
    """The CUDA index the plan gave this rank: its ENV_RANK_DEVICE (set by ``place_ranks``), else its local rank."""
    planned = env.get(ENV_RANK_DEVICE, "")
    return int(planned.split(":", 1)[1]) if planned.startswith("cuda:") else int(env["LOCAL_RANK"])


def _mismatch_report(config: WorkerConfig, env: dict[str, str], message: str) -> RankReport:
    report = RankReport.failed(
        rank=int(env["RANK"]),
        local_rank=int(env["LOCAL_RANK"]),
        node_rank=int(env.get("GROUP_RANK", "0")),
        world_size=int(env["WORLD_SIZE"]),
        host=env.get(ENV_HOST, socket.gethostname()),
        device=f"cuda:{_planned_index(env)}",
        error_type="DeviceMismatch",
        message=message,
        at=time.time(),
    )
    print(f"DeviceMismatch: {message}", file=sys.stderr, flush=True)
    write_json_atomic(config.paths.report(report.rank), report.to_dict())
    return report
