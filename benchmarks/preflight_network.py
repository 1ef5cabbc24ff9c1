"""The preflight's network check between hosts: its time as hosts grow, and its figures against torch's own.

The hosts are network namespaces on this machine, each with its own sshd (the rig of
``tests/cluster/conftest.py``; needs root, ``ip`` and ``sshd``), joined by veth pairs on a bridge:
every "link" is this machine's CPU copying bytes, so every figure competes for its cores.

Part 1, time as hosts grow (2, 4, 8 hosts; one process in the launching namespace per repetition,
one untimed warm-up per host count):

  preflight     ``preflight_reports``: every host's login, GPUs, torch version, interface
  check         then ``network_check`` on the same connections (budget 3 s): the ring, each way
  both          the two together: what a multi-host job waits before it starts
  check_again   ``network_check`` once more on the same connections (the check alone, warm)

  and the spread of the links' figures in each check (slowest link / median): how far from the
  ``min_fraction`` (0.5) line a healthy rig stays.

Part 2, bandwidth h1 -> h2 (2 hosts), median of a few:

  check         the figure of h1 -> h2 in part 1's 2-host checks (h2 -> h1 sends at the same time)
  one_link      one ``net-ring`` from h1 to h2 alone, nothing else sending, the check's send time
  gloo          ``torch.distributed`` gloo: rank 0 (h1) sends 64 MiB to rank 1 (h2), which answers
                one element; bytes over the time from the send to the answer (``GLOO_SOCKET_IFNAME=eth0``,
                each rank started with ``ip netns exec`` in its host's namespace)

    python benchmarks/preflight_network.py              # 5 repetitions
    python benchmarks/preflight_network.py --smoke      # 1 repetition, 2 hosts only
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, bench_env, fmt, machine_info, median_range, ratio, run_timed, summary, write_result  # noqa: E402

BUDGET_S = 3.0
GLOO_BYTES = 64 << 20
GLOO_PORT = 29611

CHECK_SNIPPET = """\
import json, sys, time
from launcher.backends.ssh import connection_scope, preflight_reports
from launcher.backends.ssh.netcheck import network_check
from launcher.spec.cluster import load_cluster
cluster, budget = load_cluster(sys.argv[1]), float(sys.argv[2])
with connection_scope() as links:
    t0 = time.monotonic()
    reports = preflight_reports(cluster)
    t1 = time.monotonic()
    check = network_check(cluster.hosts, links, budget_s=budget)
    t2 = time.monotonic()
    again = network_check(cluster.hosts, links, budget_s=budget)
    t3 = time.monotonic()
print("BENCH " + json.dumps({"preflight_s": t1 - t0, "check_s": t2 - t1, "check_again_s": t3 - t2,
                             "problems": [p for r in reports for p in r.problems], "check": check.to_dict(), "again": again.to_dict()}))
"""

ONE_LINK_SNIPPET = """\
import json, sys
from launcher.backends.ssh import connection_scope
from launcher.backends.ssh.netcheck import plan_timing
from launcher.spec.cluster import load_cluster
cluster, budget, reps = load_cluster(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
h1, h2 = cluster.hosts[:2]
timing = plan_timing(budget)  # the check's own send time
with connection_scope() as links:
    port = links.get(h2).call("net-listen", bind=h2.address, for_s=budget * reps + 30)["port"]
    figures = [links.get(h1).call("net-ring", peers=[[h2.name, h2.address, port]], send_s=timing.send_s, max_mb=timing.max_bytes / 1e6,
                                  connect_s=timing.connect_s, ping_s=timing.ping_s, drain_s=timing.drain_s, timeout_s=60)["links"][0] for _ in range(reps + 1)]
print("BENCH " + json.dumps(figures[1:]))
"""

GLOO_SNIPPET = """\
import json, sys, time
import torch
import torch.distributed as dist
rank, master, port, nbytes, reps = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
payload, answer, seconds = torch.zeros(nbytes // 4, dtype=torch.float32), torch.zeros(1), []
for _ in range(reps + 1):  # the first: a warm-up
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(payload, 1)
        dist.recv(answer, 1)
    else:
        dist.recv(payload, 0)
        dist.send(answer, 0)
    seconds.append(time.perf_counter() - t0)
dist.destroy_process_group()
if rank == 0:
    print("BENCH " + json.dumps({"gbit_s": [nbytes * 8 / s / 1e9 for s in seconds[1:]]}))
"""


def _bench_line(output: str, what: str) -> Any:
    line = next((ln for ln in output.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(f"{what}: no result: {output[-2000:]}")
    return json.loads(line[6:])


def _spread(check: dict[str, Any]) -> float | None:
    """The slowest link over the median: 1.0 is a perfectly even rig; under 0.5 is "slow"."""
    figures = [x["gbit_s"] for x in check["links"] if x["gbit_s"] is not None]
    return None if not figures or not check["median_gbit_s"] else min(figures) / check["median_gbit_s"]


def check_record(cluster: Any, cfg: Path) -> dict[str, Any]:
    done = run_timed(cluster.ns_cmd(sys.executable, "-c", CHECK_SNIPPET, str(cfg), str(BUDGET_S)), env=bench_env(), timeout_s=120)
    if done.rc != 0:
        raise RuntimeError(f"check: exit {done.rc}: {done.output[-2000:]}")
    data = _bench_line(done.output, "check")
    if data["problems"] or any(check["slow"] or check["unreachable"] for check in (data["check"], data["again"])):
        raise RuntimeError(f"check: {data['problems']} {data['check']['slow']} {data['check']['unreachable']} {data['again']['slow']}")
    forward = next(x for x in data["check"]["links"] if (x["src"], x["dst"]) == ("h1", "h2"))
    return {
        "preflight_s": data["preflight_s"],
        "check_s": data["check_s"],
        "both_s": data["preflight_s"] + data["check_s"],
        "check_again_s": data["check_again_s"],
        "check_own_s": data["check"]["seconds"],
        "median_gbit_s": data["check"]["median_gbit_s"],
        "spread": [_spread(data["check"]), _spread(data["again"])],
        "h1_h2_gbit_s": forward["gbit_s"],
        "links": [[x["src"], x["dst"], x["gbit_s"], x["latency_ms"]] for x in data["check"]["links"]],
    }


def part_scale(cluster: Any, counts: list[int], reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in counts:
        cfg = cluster.cluster_yaml(cluster.workdir / f"cluster{n}.yaml", hosts=cluster.hosts[:n])
        check_record(cluster, cfg)  # warm-up: page cache, sshd's first fork
        runs = []
        for k in range(reps):
            record = check_record(cluster, cfg)
            runs.append(record)
            print(f"  {n} hosts rep {k + 1}/{reps}: preflight {record['preflight_s']:.2f}s + check {record['check_s']:.2f}s "
                  f"= {record['both_s']:.2f}s; again {record['check_again_s']:.2f}s; median {record['median_gbit_s']:.3g} Gbit/s, "
                  f"slowest/median {fmt(record['spread'][0], 2)}", flush=True)  # fmt: skip
        out[str(n)] = {
            "runs": runs,
            "table": {key: summary([r[key] for r in runs]) for key in ("preflight_s", "check_s", "both_s", "check_again_s", "median_gbit_s")}
            | {"slowest_over_median": summary([s for r in runs for s in r["spread"]])},
        }
    return out


def one_link(cluster: Any, reps: int) -> list[dict[str, Any]]:
    cfg = cluster.cluster_yaml(cluster.workdir / "cluster2.yaml", hosts=cluster.hosts[:2])
    done = run_timed(cluster.ns_cmd(sys.executable, "-c", ONE_LINK_SNIPPET, str(cfg), str(BUDGET_S), str(reps)), env=bench_env(), timeout_s=120)
    if done.rc != 0:
        raise RuntimeError(f"one link: exit {done.rc}: {done.output[-2000:]}")
    figures: list[dict[str, Any]] = _bench_line(done.output, "one link")
    return figures


def gloo(cluster: Any, reps: int) -> list[float]:
    """rank 0 on h1, rank 1 on h2, each in its host's namespace; both reaped (killed by pid if stuck)."""
    h1, h2 = cluster.hosts[:2]
    env = bench_env({"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"})
    argvs = [
        ["ip", "netns", "exec", host.ns, sys.executable, "-c", GLOO_SNIPPET, str(rank), h1.address, str(GLOO_PORT), str(GLOO_BYTES), str(reps)]
        for rank, host in enumerate((h1, h2))
    ]
    procs = [subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) for argv in argvs]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode != 0 for proc in procs):
        raise RuntimeError(f"gloo: exits {[p.returncode for p in procs]}: {outputs[0][-1500:]} {outputs[-1][-1500:]}")
    figures: list[float] = _bench_line(outputs[0], "gloo")["gbit_s"]
    return figures


def part_bandwidth(cluster: Any, scale: dict[str, Any], reps: int) -> dict[str, Any]:
    check = [r["h1_h2_gbit_s"] for r in scale["2"]["runs"]]
    alone = one_link(cluster, reps)
    torch_gloo = gloo(cluster, reps)
    medians = {
        "check": statistics.median(check),
        "one_link": statistics.median(x["gbit_s"] for x in alone),
        "gloo": statistics.median(torch_gloo),
    }
    print(f"  h1 -> h2: check {medians['check']:.3g}, one link {medians['one_link']:.3g}, gloo {medians['gloo']:.3g} Gbit/s", flush=True)
    return {
        "check_gbit_s": summary(check),
        "one_link_gbit_s": summary([x["gbit_s"] for x in alone]),
        "one_link_bytes": [x["bytes"] for x in alone],
        "gloo_gbit_s": summary(torch_gloo),
        "gloo_bytes": GLOO_BYTES,
        "check_over_gloo": ratio(medians["check"], medians["gloo"]),
        "one_link_over_gloo": ratio(medians["one_link"], medians["gloo"]),
    }


def render(data: dict[str, Any]) -> str:
    lines = [
        "| hosts | preflight (s) | network check (s) | both (s) | check again (s) | median link (Gbit/s) | slowest / median |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, block in data.get("scale", {}).items():
        t = block["table"]
        lines.append(
            f"| {n} | {median_range(t['preflight_s'])} | {median_range(t['check_s'])} | {median_range(t['both_s'])} | {median_range(t['check_again_s'])} | "
            f"{median_range(t['median_gbit_s'])} | {median_range(t['slowest_over_median'])} |"
        )
    bw = data.get("bandwidth")
    if bw:
        lines += [
            "",
            "| h1 -> h2 | Gbit/s | / gloo |",
            "|---|---|---|",
            f"| network check (ring, both ways at once) | {median_range(bw['check_gbit_s'])} | {fmt(bw['check_over_gloo'], 2)} |",
            f"| one link alone (net-ring) | {median_range(bw['one_link_gbit_s'])} | {fmt(bw['one_link_over_gloo'], 2)} |",
            f"| torch.distributed gloo send/recv, 64 MiB | {median_range(bw['gloo_gbit_s'])} | 1.00 |",
        ]
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="2,4,8", help="host counts (default 2,4,8)")
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 5)
    counts = [2] if args.smoke else sorted({2, *(int(x) for x in args.hosts.split(","))})

    from tests.cluster.conftest import missing_tools, netns_rig, remove_stale_sets

    reason = missing_tools()
    if reason:
        print(f"skipped: {reason}")
        return 0
    remove_stale_sets()
    scratch = Path(tempfile.mkdtemp(prefix="glb-netcheck-", dir="/tmp"))
    data: dict[str, Any] = {"machine": machine_info(), "config": {"reps": reps, "hosts": counts, "budget_s": BUDGET_S, "gloo_bytes": GLOO_BYTES}}
    try:
        with netns_rig(scratch / "rig", count=max(counts), prefix=f"glt-{os.getpid()}") as cluster:
            t0 = time.monotonic()
            data["scale"] = part_scale(cluster, counts, reps)
            data["bandwidth"] = part_bandwidth(cluster, data["scale"], reps)
            data["config"]["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result("preflight_network-smoke" if args.smoke else "preflight_network", data, args.out)
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
