"""The live channel of two engines side by side: the torchrun agent's output against Ray's actor drain.

The same DDP job (``tests/monitoring/straggler_job.py``: a world-4 DDP loop, rank 3 slower), run
in this process through ``launcher.run_job``, alternately with ``--backend torchrun`` (each node's
agent forwards its ranks' beacons on its output, batched every 0.25 s: ``runtime/forwarder.py``)
and ``--backend ray`` (embedded Ray; each actor keeps one ``drain`` call in flight, which returns
its new output lines and its latest beacon at least every 0.5 s, on whatever node it runs:
``backends/ray.py``). Measured per run, from the watcher the console uses (``RunEvents.progress``,
called by the run loop every 0.5 s):

  latency_s          from a beacon's own timestamp (the rank wrote it) to the run loop's progress
                     reading that first holds it: p50, p99 (the reading's 0.5 s cadence included)
  beacons_per_rank_s distinct beacons per rank per second that reached the run loop (ranks
                     rewrite theirs twice a second)
  cpu_core_fraction  this process's CPU time (the launcher: routing, the run loop, and for Ray the
                     driver's own threads; not the agents, the ranks or Ray's daemons) over wall
                     time, from 2 s after every rank runs to the last reading with all running

Why the drain for Ray: an actor's stdout reaches the driver only through Ray's log monitor (a file
tail on each node, published through the GCS, unstructured, with no beacon); a queue actor adds a
hop and a process; the drain is one call per actor, answered by the actor's own thread, and its
result crosses Ray's object store whichever node the actor is on.

Since issue 35 a Ray stage's channel is batched per node (one ``NodeRelay`` per node gathers its
ranks' lines and beacons and sends them over one token-authenticated socket to the driver's sink,
``backends/ray_sink.py``, or over Ray's stream where it cannot connect); ``ray-per-actor`` runs the channel
before it (``RayStage.relay_per_node = False``) beside it. ``--ray-nodes 2`` runs the Ray rows on
a real 2-node Ray cluster on this machine (a head and a worker on 127.0.0.1, started and stopped
by pid as ``tests/ray/conftest.py`` does), the ranks spread over both nodes.

    python benchmarks/live_channel.py              # 3 pairs, 12 s of DDP each
    python benchmarks/live_channel.py --smoke      # 1 pair, 6 s
    python benchmarks/live_channel.py --ray-nodes 2 --backend ray --backend ray-per-actor
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, machine_info, private_prom_sd_dir, summary, write_result  # noqa: E402
from launcher.stage.watch import RunEvents, StageProgress  # noqa: E402

SPEC = """\
name: live-channel
entrypoint: tests.monitoring.straggler_job:run
params: {{slow_rank: 3, extra_s: 0.02, duration_s: {duration_s}, sections: false}}
resources: {{cpu_workers: 4}}
monitoring: {{straggler_hold_s: 1.0}}
env: {{PYTHONPATH: {repo}}}
"""
BACKENDS = ("torchrun", "ray", "ray-per-actor")
SETTLE_S = 2.0


class Readings(RunEvents):
    """Notes, at each progress reading, when each rank's beacon first reached the run loop and
    this process's CPU time."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.seen: dict[int, float] = {}
        self.marks: list[tuple[float, float]] = []  # (wall, CPU) at readings with every rank running
        self.all_running_at: float | None = None

    def progress(self, progress: StageProgress) -> None:
        now = time.time()
        running = bool(progress.ranks) and all(r.phase == "running" for r in progress.ranks)
        if running and self.all_running_at is None:
            self.all_running_at = now
        if not running or now < (self.all_running_at or now) + SETTLE_S:
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.marks.append((now, usage.ru_utime + usage.ru_stime))
        for r in progress.ranks:
            if r.beacon_t is not None and r.beacon_t != self.seen.get(r.rank):
                if r.rank in self.seen:  # the first one seen may be older than the window
                    self.latencies.append(now - r.beacon_t)
                self.seen[r.rank] = r.beacon_t


def one_run(backend: str, duration_s: float, scratch: Path, spread: bool = False) -> dict[str, Any]:
    import launcher
    from launcher.backends.ray import RayStage

    scratch.mkdir(parents=True)
    spec = scratch / f"{backend}.yaml"
    spec.write_text(SPEC.format(duration_s=duration_s, repo=REPO) + ("ray: {placement: spread}\n" if spread else ""))
    readings = Readings()
    RayStage.relay_per_node = backend != "ray-per-actor"
    try:
        result = launcher.run_job(spec, backend=backend.split("-")[0], out=scratch / "runs", events=readings, metrics=False)
    finally:
        RayStage.relay_per_node = True
    (w0, c0), (w1, c1) = (readings.marks[0], readings.marks[-1]) if len(readings.marks) >= 2 else ((0.0, 0.0), (1.0, 0.0))
    lat = sorted(readings.latencies)
    pick = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)) if lat else (lambda q: None)
    return {
        "backend": backend, "status": result.status, "window_s": round(w1 - w0, 2),
        "cpu_core_fraction": round((c1 - c0) / (w1 - w0), 4) if w1 > w0 else None,
        "latency_s": {"p50": pick(0.5), "p99": pick(0.99), "n": len(lat)},
        "beacons_per_rank_s": round(len(lat) / 4 / (w1 - w0), 2) if w1 > w0 else None,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=None, help="seconds of DDP per run (default 12; 6 with --smoke)")
    p.add_argument("--backend", choices=BACKENDS, action="append", help="only these (default: torchrun and ray)")
    p.add_argument("--ray-nodes", type=int, default=0, help="2: the Ray rows on a real 2-node cluster on this machine (default: embedded Ray)")
    args = p.parse_args(argv)
    if args.ray_nodes:
        return on_cluster(args)
    return measure(args, tuple(args.backend or BACKENDS[:2]))


def on_cluster(args: Any) -> int:
    """The Ray rows on a head and ``--ray-nodes - 1`` workers on 127.0.0.1, this process their driver."""
    from launcher.protocol import ENV_RAY_CONNECT
    from tests.ray.conftest import DRIVER, ray_cluster

    with ray_cluster(head_cpus=2, worker_cpus=(2,) * (args.ray_nodes - 1)) as head:
        DRIVER.connect(head)
        os.environ[ENV_RAY_CONNECT] = "1"  # plan on the cluster, as a submitted job does
        try:
            return measure(args, tuple(args.backend or BACKENDS[1:]), spread=True, nodes=args.ray_nodes)
        finally:
            os.environ.pop(ENV_RAY_CONNECT, None)
            DRIVER.disconnect()


def measure(args: Any, backends: tuple[str, ...], spread: bool = False, nodes: int = 1) -> int:
    reps = args.reps or (1 if args.smoke else 3)
    seconds = args.seconds or (6.0 if args.smoke else 12.0)
    private_prom_sd_dir()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gl-live-channel-") as tmp:
        for rep in range(reps):
            for backend in backends if rep % 2 == 0 else backends[::-1]:
                load = os.getloadavg()[0]
                row = one_run(backend, seconds, Path(tmp) / f"{rep}-{backend}", spread=spread and backend != "torchrun")
                row.update(ray_nodes=nodes if backend != "torchrun" else None, load_avg_1m=[round(load, 2), round(os.getloadavg()[0], 2)])
                rows.append(row)
                lat = row["latency_s"]
                print(f"{backend:8s} {row['status']}: launcher {100 * (row['cpu_core_fraction'] or 0):5.1f}% of a core, "
                      f"latency p50 {lat['p50']} s p99 {lat['p99']} s (n={lat['n']}), "
                      f"{row['beacons_per_rank_s']} beacons/rank/s, load {row['load_avg_1m']}")  # fmt: skip
    write_result("live_channel", {
        "mode": "smoke" if args.smoke else "full" if args.full else "default", "machine": machine_info(), "seconds": seconds,
        "rows": rows,
        "by_backend": {b: {"cpu_core_fraction": summary([r["cpu_core_fraction"] for r in rows if r["backend"] == b and r["cpu_core_fraction"] is not None]),
                           "latency_p50_s": summary([r["latency_s"]["p50"] for r in rows if r["backend"] == b and r["latency_s"]["p50"] is not None]),
                           "latency_p99_s": summary([r["latency_s"]["p99"] for r in rows if r["backend"] == b and r["latency_s"]["p99"] is not None])}
                       for b in backends},
    }, args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
