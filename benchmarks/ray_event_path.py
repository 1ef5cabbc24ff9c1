"""Ray's live channel at scale: the driver's CPU and beacon-to-endpoint latency at 64, 256 and 1,024 actors.

The same harness as the torchrun path (``benchmarks/event_path.py``: its plan, run loop, stage
state, straggler watch, ``/metrics`` endpoint and readings, 8 / 32 / 64 simulated nodes), with
Ray's channel in place of the agents' pipes: the launcher side is the product's own ``RayStage``
(``backends/ray.py``) driving a real Ray (embedded, on this machine) in this process, and only the
actors are simulated. A few ``SimHost`` actor processes stand for the cluster's nodes and ranks (a
real 1,024-rank stage is not runnable on one small machine): each answers

  a node's answers     with the product's own ``NodeRelay`` (``serve`` over the stage's sink, or
                       ``stream`` over Ray; ``drain``: its answer cadence, what is new since the
                       last answer), over simulated beacon files: each rank rewrites its beacon
                       twice a second on its own phase (steps, own work per step, the last rank
                       slower), read by the relay when it looks, as the real files are
  a rank's drain       as ``RankActor.drain`` does (``relay_per_node = False``, the channel before
                       relays): no output lines, so it waits its 0.5 s, then its rank's latest beacon
  a rank's run         its report when the stage's time is up (the driver waits on one ``run`` per
                       rank, as it does for real actors: how it learns of a dead one)

The driver's cost per call (submitting it, waiting on it, taking its result) does not depend on
which process answers it, so the figures are the driver's as a real cluster of that many nodes
and actors would make them; the relays' own work is on their nodes, here on the same 2 cores
(part of the machine's load). The channels, measured per size, interleaved (the order alternates
per repetition):

  per_actor            one drain per actor (``relay_per_node = False``), the run calls waited on every turn
  per_node             a relay per node answering over Ray's streaming generator, the run calls
                       waited on every turn of the run loop (the product before the sink)
  per_node_socket      a relay per node answering over the stage's sink (a TCP connection per
                       node, ``backends/ray_sink.py``), the run calls looked at every ``RUN_CHECK_S`` (the product)

Measured as in ``event_path.py`` (``cpu_core_fraction``: this process's CPU over the live part,
every thread, Ray's own included; ``latency_s``: from the beacon's timestamp, when its rank wrote
it, to the endpoint holding it), plus ``driver_calls_per_s`` (drain calls the driver made).

Goal (issue 35): at 1,024 actors at most 10% of one core, p99 under 1 s.

    python benchmarks/ray_event_path.py                  # 64, 256, 1024 actors, every channel, 20 s each
    python benchmarks/ray_event_path.py --smoke          # 64 actors, every channel, 6 s
    python benchmarks/ray_event_path.py --channel per_node --channel per_node_socket --reps 2   # before / after
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, machine_info, private_prom_sd_dir, summary, write_result  # noqa: E402
from benchmarks.event_path import SIZES, measure  # noqa: E402
from launcher.backends import ray as ray_backend  # noqa: E402
from launcher.backends.ray import RayStage, _kill_leftovers, ray_processes  # noqa: E402
from launcher.procutil import descendants  # noqa: E402
from launcher.runtime.ray_actor import NodeRelay  # noqa: E402
from launcher.stage.engine import LaunchRequest, StageEngine, StageHandle  # noqa: E402
from launcher.stage.logrouting import LogRouter  # noqa: E402
from launcher.stage.plan import StagePlan  # noqa: E402

PROCESSES = 8  # SimHost actor processes standing for the nodes (each serves nodes/8 of them)
CHANNELS = ("per_actor", "per_node", "per_node_socket")
BEACON_EVERY_S = 0.5


def _beacon(rank: int, start: float, slow: int, now: float) -> tuple[int, dict[str, Any]] | None:
    """The beacon file of ``rank`` as it is at ``now``: rewritten every 0.5 s on the rank's phase."""
    k = int((now - start - (rank % 4) * 0.125) // BEACON_EVERY_S)
    if k < 0:
        return None
    return k, {"pid": 1, "phase": "running", "steps": 10 * (k + 1), "t": start + (rank % 4) * 0.125 + k * BEACON_EVERY_S,
               "work_s": 0.004 if rank == slow else 0.002, "work_mad_s": 0.0001, "work_n": 20}  # fmt: skip


class SimRelay(NodeRelay):
    """The product's relay with simulated ranks: the same answer logic, beacons from ``_beacon``."""

    def __init__(self, ranks: list[int], start: float, slow: int) -> None:
        super().__init__({})
        self.ranks, self.start, self.slow = ranks, start, slow
        self.sent: dict[int, int] = {}

    def _ask(self) -> None:
        pass  # no rank actors: no output lines

    def _collect(self, timeout_s: float, refs: list[Any] | None = None) -> None:
        time.sleep(timeout_s)

    def _final(self) -> None:
        pass

    def _beacons(self) -> dict[int, dict[str, Any]]:
        now, fresh = time.time(), {}
        for rank in self.ranks:
            found = _beacon(rank, self.start, self.slow, now)
            if found is not None and found[0] != self.sent.get(rank):
                self.sent[rank] = found[0]
                fresh[rank] = found[1]
        return fresh


class SimHost:
    """Stands for some nodes of the cluster: their relays, their ranks' drains and runs."""

    def __init__(self) -> None:
        self.relays: dict[str, SimRelay] = {}
        self.generation = 0  # a stage's streams end with it (a real relay is killed with its stage)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)

    def setup(self, nodes: dict[str, list[int]], start: float, seconds: float, slow: int, world: int, per_node: int) -> None:
        self.relays = {node: SimRelay(ranks, start, slow) for node, ranks in nodes.items()}
        self.generation += 1
        self.start, self.seconds, self.slow, self.world, self.per_node = start, seconds, slow, world, per_node

    async def drain_node(self, node: str, wait_s: float, batch_s: float = 0.0, final: bool = False) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.relays[node].drain, wait_s, batch_s, final)

    async def serve_node(self, node: str, sink: Any, wait_s: float, batch_s: float) -> dict[str, Any]:
        relay = self.relays[node]
        relay.sink = sink  # what the product gives its relay at creation
        return await asyncio.get_running_loop().run_in_executor(self.pool, relay.serve, wait_s, batch_s)

    async def stream_node(self, node: str, wait_s: float, batch_s: float) -> Any:
        loop, relay, generation = asyncio.get_running_loop(), self.relays[node], self.generation
        while self.generation == generation:
            yield await loop.run_in_executor(self.pool, relay.drain, wait_s, batch_s)

    async def drain_rank(self, rank: int, wait_s: float, beacon: bool = True) -> dict[str, Any]:
        await asyncio.sleep(wait_s)  # RankActor.drain with no output lines: waits its time
        found = _beacon(rank, self.start, self.slow, time.time())
        return {"lines": [], "beacon": found[1] if found else None, "stage_dir": None, "beacon_path": None}

    async def run(self, rank: int) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, self.start + self.seconds - time.time()))
        found = _beacon(rank, self.start, self.slow, time.time())
        node = rank // self.per_node
        return {"rank": rank, "local_rank": rank % self.per_node, "node_rank": node, "world_size": self.world, "host": f"sim{node}",
                "device": "cpu", "status": "ok", "metrics": {"steps": found[1]["steps"] if found else 0}, "phases": {}}  # fmt: skip

    def signal(self, rank: int, signum: int) -> None:
        pass


class _Call:
    """``handle.method.remote(*args)`` for a simulated actor: the SimHost's method, its rank or node first."""

    def __init__(self, method: Any, *lead: Any) -> None:
        self.method, self.lead = method, lead

    def remote(self, *args: Any) -> Any:
        return self.method.remote(*self.lead, *args)


class _Drain(_Call):
    drains = 0  # drain calls the driver made

    def remote(self, *args: Any) -> Any:
        _Drain.drains += 1
        return self.method.remote(*self.lead, *args)


class _SimActor:
    def __init__(self, host: Any, rank: int) -> None:
        self.drain, self.run, self.signal = _Drain(host.drain_rank, rank), _Call(host.run, rank), _Call(host.signal, rank)


class _SimRelayHandle:
    def __init__(self, host: Any, node: str, sink: Any) -> None:
        self.drain = _Drain(host.drain_node, node)
        self.stream = _Stream(host.stream_node, node)
        self.serve = _Drain(host.serve_node, node, sink)  # one call for the stage, as the stream


class _Stream(_Call):
    """``relay.stream.options(num_returns="streaming").remote(...)``: one call for the stage."""

    def options(self, **options: Any) -> Any:
        _Drain.drains += 1
        return _Call(self.method.options(**options), *self.lead)


class SimRayStage(RayStage):
    """The product's RayStage, its actors simulated (see the module's description)."""

    def __init__(self, plan: StagePlan, logs: LogRouter, hosts: list[Any], seconds: float, slow: int, channel: str) -> None:
        super().__init__(plan, logs)
        self.relay_per_node = channel != "per_actor"
        self.relay_socket = channel == "per_node_socket"
        self.run_check_s = ray_backend.RUN_CHECK_S if channel == "per_node_socket" else 0.0
        self.hosts, self.seconds, self.slow = hosts, seconds, slow

    def start(self) -> None:
        import ray

        start = time.time()
        nodes = {n.host: [n.node_rank * n.nproc + i for i in range(n.nproc)] for n in self.plan.nodes}
        self.host_of = {node: self.hosts[k % len(self.hosts)] for k, node in enumerate(nodes)}
        per_host: dict[int, dict[str, list[int]]] = {}
        for k, (node, ranks) in enumerate(nodes.items()):
            per_host.setdefault(k % len(self.hosts), {})[node] = ranks
        per_node = self.plan.nodes[0].nproc
        ray.get([h.setup.remote(per_host.get(i, {}), start, self.seconds, self.slow, self.plan.world_size, per_node) for i, h in enumerate(self.hosts)])
        for node, ranks in nodes.items():
            for rank in ranks:
                self._actors.append(_SimActor(self.host_of[node], rank))
                self._probes[rank] = {"node_id": node, "pid": 0}
            self._node_ranks[node] = ranks
        for rank, actor in enumerate(self._actors):
            self._runs[actor.run.remote()] = rank
        self._start_channel()
        self._state = "running"

    def _make_relay(self, node_id: str, ranks: list[int]) -> Any:
        return _SimRelayHandle(self.host_of[node_id], node_id, self._sink.address_for(node_id) if self._sink is not None else None)

    def _wait_names_free(self, timeout_s: float) -> None:
        pass  # no named actors

    answers = 0  # the nodes' answers the driver took

    def _relayed(self, drained: dict[str, Any]) -> None:
        SimRayStage.answers += 1
        super()._relayed(drained)


class SimRayEngine(StageEngine):
    name = "sim"

    def __init__(self, hosts: list[Any], seconds: float, slow: int, channel: str) -> None:
        self.hosts, self.seconds, self.slow, self.channel = hosts, seconds, slow, channel

    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        return LaunchRequest(self.name, (f"{len(plan.nodes)} simulated Ray nodes",))

    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        stage = SimRayStage(plan, logs, self.hosts, self.seconds, self.slow, self.channel)
        stage.start()
        return stage


def main(argv: list[str] | None = None) -> int:
    import ray

    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=None, help="how long each run lasts (default 20; 6 with --smoke)")
    p.add_argument("--ranks", type=int, action="append", help="only these sizes (64, 256, 1024)")
    p.add_argument("--channel", choices=CHANNELS, action="append", help="only this channel (default: both, interleaved)")
    p.add_argument("--relay-batch-s", type=float, action="append", help="the relays' answer interval(s) to compare (default: the product's)")
    args = p.parse_args(argv)
    sizes = SIZES[:1] if args.smoke else tuple(s for s in SIZES if not args.ranks or s[0] in args.ranks)
    seconds = args.seconds or (6.0 if args.smoke else 20.0)
    reps = args.reps or 1
    variants = [(c, b) for c in (args.channel or CHANNELS) for b in ((args.relay_batch_s or [ray_backend.RELAY_BATCH_S]) if c != "per_actor" else [None])]
    private_prom_sd_dir()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # the SimHosts import launcher
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # 127.0.0.1 only
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    before = set(descendants(os.getpid()))
    ctx: Any = None
    rows = []
    try:
        for attempt in range(3):  # Ray gives its node 30 s to come up: too short on a machine at load 30
            try:
                ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2,
                               _node_ip_address="127.0.0.1", log_to_driver=False, logging_level=logging.WARNING,
                               namespace="gl-ray-event-path")  # fmt: skip
                break
            except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for it
                print(f"ray.init failed ({exc}), attempt {attempt + 1} of 3", flush=True)
                ray.shutdown()
                _kill_leftovers(ray_processes("/tmp/ray/session_", before))
                if attempt == 2:
                    raise
        hosts = [ray.remote(SimHost).options(num_cpus=0, max_concurrency=4000).remote() for _ in range(PROCESSES)]
        ray.get([h.setup.remote({}, 0.0, 0.0, 0, 0, 1) for h in hosts])
        with tempfile.TemporaryDirectory(prefix="gl-ray-events-") as tmp:
            for ranks, nodes in sizes:
                for rep in range(reps):
                    for channel, batch_s in variants if rep % 2 == 0 else variants[::-1]:
                        per_node = channel != "per_actor"
                        if batch_s is not None:
                            ray_backend.RELAY_BATCH_S = batch_s
                        calls0, answers0 = _Drain.drains, SimRayStage.answers
                        load0 = os.getloadavg()[0]
                        row = measure(ranks, nodes, seconds, Path(tmp) / f"{ranks}-{rep}-{channel}",
                                      engine=lambda s, slow, ch=channel: SimRayEngine(hosts, s, slow, ch))  # fmt: skip
                        row.update(channel=channel, relay_batch_s=batch_s, rep=rep, load_avg_1m=[round(load0, 2), round(os.getloadavg()[0], 2)],
                                   driver_calls_per_s=round((_Drain.drains - calls0) / row["seconds"], 1),
                                   answers_per_s=round((SimRayStage.answers - answers0 if per_node else _Drain.drains - calls0) / row["seconds"], 1))  # fmt: skip
                        rows.append(row)
                        lat = row["latency_s"]
                        print(f"{ranks:5d} actors on {nodes:2d} nodes, {channel:15s} {batch_s or '':4}: driver {row['cpu_core_fraction'] * 100:5.1f}% of a core, "
                              f"{row['driver_calls_per_s']} calls/s {row['answers_per_s']} answers/s, latency p50 {lat['p50']} s p99 {lat['p99']} s (n={lat['n']}), "
                              f"{row['reports_ok']} reports ok, stragglers {row['stragglers_flagged']}, load {row['load_avg_1m']}", flush=True)  # fmt: skip
    finally:
        ours = ray_processes((getattr(ctx, "address_info", None) or {}).get("session_dir") or "/tmp/ray/session_", before)
        ray.shutdown()
        _kill_leftovers(ours)  # by pid, as the launcher's own embedded Ray
    keys = sorted({(r["ranks"], f"{r['channel']}{'/' + str(r['relay_batch_s']) if r['relay_batch_s'] else ''}") for r in rows})
    for r in rows:
        r["variant"] = f"{r['channel']}{'/' + str(r['relay_batch_s']) if r['relay_batch_s'] else ''}"
    write_result("ray_event_path", {"mode": "smoke" if args.smoke else "full" if args.full else "default", "machine": machine_info(),
                                    "seconds": seconds, "rows": rows,
                                    "cpu_core_fraction": {f"{k}/{c}": summary([r["cpu_core_fraction"] for r in rows if (r["ranks"], r["variant"]) == (k, c)]) for k, c in keys},
                                    "latency_p99_s": {f"{k}/{c}": summary([r["latency_s"]["p99"] for r in rows if (r["ranks"], r["variant"]) == (k, c)]) for k, c in keys}},
                 args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
