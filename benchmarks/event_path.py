"""The live event path at scale: launcher CPU and beacon-to-endpoint latency at 64, 256 and 1,024 ranks.

Simulated hosts feed the real launcher side. Each host is a process that does what a node's agent
does on its output (``launcher.runtime.forwarder``): every 0.25 s, one ``@gpulaunch-ranks`` line
(``protocol.rank_event_lines``) with the beacons its ranks rewrote since (each rank twice a second:
phase, steps, own work per step and its spread, pid), and at the end each rank's report. One rank
is slower than the rest (its own work per step), so straggler detection has work to do. On the
launching side everything is the product's own code: the run loop (``control.runloop.run_stage``)
drives a stage engine (``SimEngine`` below: one pipe per host into the real ``LogRouter``, exactly
as an SSH session's or an srun step's output arrives), ``StageState`` applies the events,
``StragglerWatch`` judges them, and ``MetricsEvents`` serves them on a real ``/metrics`` endpoint.
Over SSH the same bytes come through the ssh client's pipe; the ssh client only relays them.

Measured, per size:

  cpu_core_fraction   over the live part of the stage (from 3 s after the start to 1 s before the
                      hosts stop), the launcher process's CPU time (every thread: routing, parsing,
                      the run loop, the endpoint) over wall time: 0.10 is 10% of one core
  end_s               the stage's end, once: the last events, every rank's report and last beacon
                      written to the run directory, the outcome (wall seconds)
  latency_s           from a beacon's own timestamp (the rank wrote it) to the moment the endpoint
                      holds it (``MetricsEvents.progress`` updated the sample): p50, p99, max

Goal (issue 23): at 1,024 ranks at most 10% of one core, p99 under 1 s.

    python benchmarks/event_path.py                    # 64, 256, 1024 ranks (8, 32, 64 hosts), 20 s each
    python benchmarks/event_path.py --smoke            # 64 ranks on 8 hosts, 6 s
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import base_parser, bench_env, machine_info, private_prom_sd_dir, summary, write_result  # noqa: E402
from launcher.monitoring.live import MetricsEvents  # noqa: E402
from launcher.control.planning import plan_stage  # noqa: E402
from launcher.control.runloop import StopRequest, run_stage  # noqa: E402
from launcher.hardware.devices import NodeInventory  # noqa: E402
from launcher.spec.model import load_job  # noqa: E402
from launcher.stage.engine import HandleStatus, LaunchRequest, StageEngine, StageHandle  # noqa: E402
from launcher.stage.logrouting import LogRouter  # noqa: E402
from launcher.stage.plan import NodeTarget, StagePlan  # noqa: E402
from launcher.stage.watch import StageProgress, TeeEvents  # noqa: E402

SIZES = ((64, 8), (256, 32), (1024, 64))  # (ranks, hosts)
WARMUP_S = 3.0

# One simulated host: its ranks' beacons at 2 Hz, batched every 0.25 s as the agent's forwarder
# batches them, then each rank's report. argv: first_rank ranks seconds slow_rank
HOST = r"""
import json, os, sys, time
from launcher.protocol import rank_event_lines
first, count, seconds, slow = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
ranks = range(first, first + count)
start = time.time()
due = {r: start + (r % 4) * 0.125 for r in ranks}  # each rank's beacon on its own phase of the 0.5 s
steps = dict.fromkeys(ranks, 0)
sent = 0
def out(**what):
    global sent
    sent += 1
    for line in rank_event_lines(key=f"{os.getpid()}-{sent}", **what):
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
while time.time() - start < seconds:
    now = time.time()
    batch = {}
    for r in ranks:
        if now >= due[r]:
            due[r] += 0.5
            steps[r] += 10
            work = 0.004 if r == slow else 0.002
            batch[r] = {"pid": os.getpid(), "phase": "running", "steps": steps[r], "t": time.time(), "work_s": work,
                        "work_mad_s": 0.0001, "work_n": 20}
    if batch:
        out(beacons=batch)
    time.sleep(0.25)
for r in ranks:
    out(report={"rank": r, "local_rank": r - first, "node_rank": first // count, "world_size": int(sys.argv[5]),
                "host": f"sim{first // count}", "device": "cpu", "status": "ok", "metrics": {"steps": steps[r]}, "phases": {}})
"""


class SimEngine(StageEngine):
    """Each node of the plan is a simulated host: one process whose output goes into the stage's
    LogRouter through a pipe, as an agent's does."""

    name = "sim"

    def __init__(self, seconds: float, slow_rank: int) -> None:
        self.seconds, self.slow_rank = seconds, slow_rank

    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        return LaunchRequest(self.name, tuple(f"simulated host {n.host}: {n.nproc} ranks" for n in plan.nodes))

    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        return SimStage(plan, logs, self.seconds, self.slow_rank)


class SimStage(StageHandle):
    def __init__(self, plan: StagePlan, logs: LogRouter, seconds: float, slow_rank: int) -> None:
        super().__init__(plan, logs)
        env = bench_env()  # the repository prepended to the caller's PYTHONPATH
        self.procs = []
        for node in plan.nodes:
            first = node.node_rank * node.nproc
            argv = [sys.executable, "-c", HOST, str(first), str(node.nproc), str(seconds), str(slow_rank), str(plan.world_size)]
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
            assert proc.stdout is not None
            logs.follow(proc.stdout, node.host)
            self.procs.append((node.host, proc))

    def poll(self) -> HandleStatus:
        if any(p.poll() is None for _, p in self.procs):
            return HandleStatus(done=False)
        for host, _ in self.procs:
            self.logs.drain(host, idle_s=2.0)
        return HandleStatus(done=True, ok=all(p.returncode == 0 for _, p in self.procs))

    def stop(self, grace_s: float = 5.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


class Latency(MetricsEvents):
    """The real endpoint's watcher, noting when each beacon reached the endpoint."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.samples: list[float] = []
        self.seen: dict[int, float] = {}
        self.after = time.time() + WARMUP_S

    def progress(self, progress: StageProgress) -> None:
        super().progress(progress)
        now = time.time()
        for r in progress.ranks:
            if r.beacon_t is not None and r.beacon_t != self.seen.get(r.rank):
                self.seen[r.rank] = r.beacon_t
                if r.beacon_t >= self.after:
                    self.samples.append(now - r.beacon_t)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(ranks: int, hosts: int, seconds: float, scratch: Path,
            engine: Callable[[float, int], StageEngine] = SimEngine) -> dict[str, Any]:
    """One size through the run loop; ``engine(seconds, slow_rank)`` is the simulated engine (the
    torchrun agents' pipes here; ``benchmarks/ray_event_path.py`` passes Ray's channel)."""
    scratch.mkdir(parents=True, exist_ok=True)
    spec = scratch / "sim.yaml"
    spec.write_text("name: sim\nentrypoint: launcher.workloads.matmul:run\nmonitoring: {straggler_hold_s: 2}\n")
    job = load_job(spec)
    per_host = ranks // hosts
    nodes = [NodeTarget(f"sim{i}", f"10.0.{i // 250}.{i % 250 + 1}", NodeInventory(f"sim{i}", per_host), sys.executable) for i in range(hosts)]
    run_dir = scratch / f"run{ranks}"

    def make_plan(attempt: int) -> StagePlan:
        return plan_stage(job, nodes, ranks, "cpu", run_dir=run_dir, master_port=29500, backend="sim")

    metrics = Latency("sim", f"bench-{ranks}", "sim", None)  # no samples_per_step: steps are the unit
    metrics.start(0)
    watcher = TeeEvents(metrics)
    slow = ranks - 1
    t0 = time.time()
    marks: list[tuple[float, float]] = []  # (wall, CPU) at the end of the warm-up and near the live part's end
    try:
        def mark() -> None:
            for at in (WARMUP_S, seconds - 1.0):
                time.sleep(max(0.0, t0 + at - time.time()))
                marks.append((time.time(), _cpu()))

        threading.Thread(target=mark, daemon=True).start()
        outcome = run_stage(make_plan, engine(seconds, slow), stop=StopRequest(), events=watcher)
        t1 = time.time()
    finally:
        metrics.close()
    (w0, cpu0), (w1, cpu1) = marks
    flagged = [(s.rank, s.host) for s in outcome.stragglers]
    lat = sorted(metrics.samples)
    p = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 4)) if lat else (lambda q: None)
    return {
        "ranks": ranks, "hosts": hosts, "seconds": round(t1 - t0, 2),
        "status": outcome.status.value, "reports_ok": sum(r.ok for r in outcome.reports),
        "cpu_core_fraction": round((cpu1 - cpu0) / (w1 - w0), 4),
        "end_s": round(t1 - (t0 + seconds), 3),
        "latency_s": {"p50": p(0.5), "p99": p(0.99), "max": round(lat[-1], 4) if lat else None, "n": len(lat)},
        "stragglers_flagged": flagged, "slow_rank": slow,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=None, help="how long each size runs (default 20; 6 with --smoke)")
    p.add_argument("--ranks", type=int, action="append", help="only these sizes (64, 256, 1024)")
    args = p.parse_args(argv)
    sizes = SIZES[:1] if args.smoke else tuple(s for s in SIZES if not args.ranks or s[0] in args.ranks)
    seconds = args.seconds or (6.0 if args.smoke else 20.0)
    reps = args.reps or 1
    private_prom_sd_dir()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gl-events-") as tmp:
        for ranks, hosts in sizes:
            for rep in range(reps):
                row = measure(ranks, hosts, seconds, Path(tmp) / f"{ranks}-{rep}")
                rows.append(row)
                lat = row["latency_s"]
                print(f"{ranks:5d} ranks on {hosts:2d} hosts: launcher {row['cpu_core_fraction'] * 100:5.1f}% of a core (end {row['end_s']} s), "
                      f"latency p50 {lat['p50']} s p99 {lat['p99']} s (n={lat['n']}), {row['reports_ok']} reports ok, "
                      f"stragglers {row['stragglers_flagged']}")  # fmt: skip
    by_size = {r["ranks"]: r for r in rows}
    write_result("event_path", {"mode": "smoke" if args.smoke else "full" if args.full else "default", "machine": machine_info(),
                                "seconds": seconds, "rows": rows,
                                "cpu_core_fraction": {k: summary([r["cpu_core_fraction"] for r in rows if r["ranks"] == k]) for k in by_size},
                                "latency_p99_s": {k: summary([r["latency_s"]["p99"] for r in rows if r["ranks"] == k]) for k in by_size}},
                 args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
