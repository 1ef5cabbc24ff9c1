"""Several servers at 2 to 32 hosts: preflight, network check, start-up, host loss and teardown.

The hosts are network namespaces on this machine, each with its own sshd and a private run
directory (the rig of ``tests/cluster/conftest.py``; needs root, ``ip`` and ``sshd``), one CPU
rank each, so every "host" shares this machine's cores. One rig of the largest count is built
once; each host count uses its first N hosts. Host counts are interleaved (rotating order) within
each repetition, after one untimed warm-up per count.

  preflight    one process in the launching namespace: ``preflight_reports`` (every host's login,
               GPUs, torch, interface), then ``network_check`` over the same connections (3 s
               budget) as ``launch`` runs them; "network check alone" is the second. The
               launcher's CPU for it: its own process (user+system, every thread) and its ssh
               clients (reaped when the connections close), from before the first login to after
               the last master exited.
  job          ``launch`` of the start-up job (join + one all-reduce) at world N on N hosts:
               "start-up to first step" is from spawning ``launch`` to the last rank's first step;
               "teardown" from the last rank's report (its end) to ``launch``'s exit. Launcher
               CPU: the ``launch`` process itself (RUSAGE_SELF) and its ssh clients
               (RUSAGE_CHILDREN: ``launch`` reaps them), read as it exits; the hosts' own
               processes are sshd's, not counted.
  loss         a job that steps until stopped on N hosts; then the last host is powered off
               (every process in its namespace SIGKILLed, sshd included: ``kill``) or its link
               taken down (``link``). "Detected" is the time stamped on its ranks' HostLost
               reports, from the event; "exit" is ``launch``'s exit, from the event.

    python benchmarks/multihost_scale.py                     # 2,4,8,16,32 hosts, 3 repetitions
    python benchmarks/multihost_scale.py --smoke             # 2 hosts, once
    python benchmarks/multihost_scale.py --hosts 8,32 --reps 2 --no-loss
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, bench_env, fmt, machine_info, median_range, rotate, run_timed, summary, write_result  # noqa: E402
from benchmarks.multihost import lose_a_host  # noqa: E402

JOB = REPO / "benchmarks" / "jobs" / "allreduce.yaml"
BUDGET_S = 3.0
LAUNCH_TIMEOUT_S = 600

PREFLIGHT_SNIPPET = """\
import json, resource, sys, time
from launcher.backends.ssh import connection_scope, preflight_reports
from launcher.backends.ssh.netcheck import network_check
from launcher.spec.cluster import load_cluster
cluster, budget = load_cluster(sys.argv[1]), float(sys.argv[2])
cpu0 = time.process_time()
with connection_scope() as links:
    t0 = time.monotonic()
    reports = preflight_reports(cluster)
    t1 = time.monotonic()
    check = network_check(cluster.hosts, links, budget_s=budget)
    t2 = time.monotonic()
t3 = time.monotonic()
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print("BENCH " + json.dumps({"preflight_s": t1 - t0, "check_s": t2 - t1, "close_s": t3 - t2, "slowest_host_s": max(r.seconds for r in reports),
                             "cpu_self_s": time.process_time() - cpu0, "cpu_ssh_s": children.ru_utime + children.ru_stime,
                             "problems": [p for r in reports for p in r.problems], "slow": list(check.slow), "unreachable": list(check.unreachable),
                             "links": len(check.links), "median_gbit_s": check.median_gbit_s}))
"""

# ``launch`` in this process, its CPU (itself, and the children it reaped: its ssh clients) written as it exits.
LAUNCH_WRAPPER = """\
import atexit, json, os, resource, runpy, sys
def _dump():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.environ["GLB_RUSAGE"], "w") as f:
        json.dump({"self_s": s.ru_utime + s.ru_stime, "children_s": c.ru_utime + c.ru_stime}, f)
atexit.register(_dump)
sys.argv = ["launch", *sys.argv[1:]]
runpy.run_module("launcher", run_name="__main__", alter_sys=True)
"""


def _bench_line(output: str, what: str) -> Any:
    line = next((ln for ln in output.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(f"{what}: no result: {output[-3000:]}")
    return json.loads(line[6:])


def _load() -> float:
    return round(os.getloadavg()[0], 2)


# The launcher's side of the SSH backend: ``--before-rev REV`` runs the preflight also with these
# files as at REV (a copy of the tree, first on the launcher's PYTHONPATH; the hosts' side is the same).
SSH_FILES = ("launcher/backends/ssh/link.py", "launcher/backends/ssh/preflight.py", "launcher/backends/ssh/netcheck.py")


def export_before(scratch: Path, rev: str) -> Path:
    root = scratch / "before"
    shutil.copytree(REPO / "launcher", root / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    for rel in SSH_FILES:
        text = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        (root / rel).write_text(text)
    return root


def preflight_record(cluster: Any, cfg: Path, tree: Path | None = None) -> dict[str, Any]:
    load0 = _load()
    env = bench_env(pythonpath=str(tree) if tree else None)
    done = run_timed(cluster.ns_cmd(sys.executable, "-c", PREFLIGHT_SNIPPET, str(cfg), str(BUDGET_S)), env=env, timeout_s=180, cwd=tree or REPO)
    if done.rc != 0:
        raise RuntimeError(f"preflight: exit {done.rc}: {done.output[-3000:]}")
    data: dict[str, Any] = _bench_line(done.output, "preflight")
    data["both_s"] = data["preflight_s"] + data["check_s"]
    data["cpu_s"] = data["cpu_self_s"] + data["cpu_ssh_s"]
    data["load_1min"] = [load0, _load()]
    if data["problems"] or data["unreachable"]:
        raise RuntimeError(f"preflight: {data['problems']} {data['unreachable']}")
    return data


def _launch_argv(cluster: Any, args: list[str]) -> list[str]:
    return cluster.ns_cmd(sys.executable, "-c", LAUNCH_WRAPPER, *args)


def job_record(cluster: Any, cfg: Path, n: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="glb-mhs-", dir=cluster.workdir))
    out = cluster.out_dir(work.name)
    usage = work / "rusage.json"
    args = [str(JOB), "--cluster", str(cfg), "--set", f"resources.nodes={n}", "--set", "resources.cpu_workers=1",
            "--set", f"scaling.workers=[{n}]", "--set", f"env.PYTHONPATH={REPO}", "--quiet", "--no-metrics", "--out", str(out)]  # fmt: skip
    load0 = _load()
    done = run_timed(_launch_argv(cluster, args), env=bench_env({"GLB_RUSAGE": str(usage)}), timeout_s=LAUNCH_TIMEOUT_S, cwd=work)
    if done.rc != 0:
        raise RuntimeError(f"job on {n} hosts: exit {done.rc}{' (timeout)' if done.timed_out else ''}: {done.output[-3000:]}")
    (result_path,) = out.glob("*/*/result.json")
    result = json.loads(result_path.read_text())
    cpu = json.loads(usage.read_text())
    firsts = [r["phases"].get("first_step") for r in result["ranks"]]
    ends = [r["phases"].get("finished") for r in result["ranks"]]
    first = max(f for f in firsts if f is not None) if all(f is not None for f in firsts) else None
    end = max(e for e in ends if e is not None) if all(e is not None for e in ends) else None
    shutil.rmtree(work, ignore_errors=True)
    return {
        "wall_s": done.wall_s,
        "first_step_s": None if first is None else first - done.t_start,
        "teardown_s": None if end is None else done.t_end - end,
        "preflight_s": (result.get("preflight") or {}).get("seconds"),
        "cpu_self_s": cpu["self_s"],
        "cpu_ssh_s": cpu["children_s"],
        "cpu_s": cpu["self_s"] + cpu["children_s"],
        "load_1min": [load0, _load()],
    }


def loss_record(cluster: Any, cfg: Path, n: int, event: str) -> dict[str, Any]:
    """A job on N hosts that steps until stopped; then its last host powered off or cut off."""
    load0 = _load()
    loss = lose_a_host(
        cluster, cfg, nodes=n, victim=cluster.hosts[n - 1], event=event, env=bench_env(), pythonpath=str(REPO), launch_args=("--quiet",),
        start_timeout_s=LAUNCH_TIMEOUT_S, exit_timeout_s=180, rendezvous_s=300, run_s=600,
    )  # fmt: skip
    lost, detected = loss.lost_ranks, loss.declared_lost_after_s
    return {
        "event": event,
        "host": loss.victim,
        "detected_s": detected,
        "exit_s": loss.exit_after_s,
        "teardown_after_loss_s": None if detected is None else loss.exit_after_s - detected,
        "summary": (loss.result.get("failure") or {}).get("summary"),
        "lost_ranks": [r["rank"] for r in lost],
        "output_tail": loss.output[-400:] if not lost else "",
        "load_1min": [load0, _load()],
    }


def run(cluster: Any, counts: list[int], reps: int, parts: set[str], before: Path | None = None, kex: str | None = None) -> dict[str, Any]:
    cfgs = {n: cluster.cluster_yaml(cluster.workdir / f"cluster{n}.yaml", hosts=cluster.hosts[:n]) for n in counts}
    kex_cfgs = {n: cluster.cluster_yaml(cluster.workdir / f"cluster{n}-kex.yaml", hosts=cluster.hosts[:n], ssh_options={"KexAlgorithms": kex}) for n in counts}
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {
        n: {"preflight": [], "preflight_before": [], "preflight_kex": [], "job": [], "kill": [], "link": []} for n in counts
    }
    for n in counts:  # untimed warm-up: page cache, each sshd's first fork
        if "preflight" in parts:
            preflight_record(cluster, cfgs[n])
    for k in range(reps):
        for n in rotate(counts, k):
            if "preflight" in parts and before is not None and k % 2 == 0:  # the code before, first in every other repetition
                r = preflight_record(cluster, cfgs[n], before)
                runs[n]["preflight_before"].append(r)
                print(f"  rep {k + 1} {n} hosts BEFORE preflight {r['preflight_s']:.2f}s + check {r['check_s']:.2f}s = {r['both_s']:.2f}s, "
                      f"cpu {r['cpu_self_s']:.2f}+{r['cpu_ssh_s']:.2f}s, load {r['load_1min']}", flush=True)  # fmt: skip
            if "preflight" in parts:
                r = preflight_record(cluster, cfgs[n])
                runs[n]["preflight"].append(r)
                print(f"  rep {k + 1} {n} hosts preflight {r['preflight_s']:.2f}s + check {r['check_s']:.2f}s = {r['both_s']:.2f}s, "
                      f"cpu {r['cpu_self_s']:.2f}+{r['cpu_ssh_s']:.2f}s ({r['cpu_s'] / n:.3f}/host), load {r['load_1min']}", flush=True)  # fmt: skip
            if "preflight" in parts and before is not None and k % 2 == 1:  # ... and second in the others
                r = preflight_record(cluster, cfgs[n], before)
                runs[n]["preflight_before"].append(r)
                print(f"  rep {k + 1} {n} hosts BEFORE preflight {r['preflight_s']:.2f}s + check {r['check_s']:.2f}s = {r['both_s']:.2f}s, "
                      f"cpu {r['cpu_self_s']:.2f}+{r['cpu_ssh_s']:.2f}s, load {r['load_1min']}", flush=True)  # fmt: skip
            if "preflight" in parts and kex is not None:
                r = preflight_record(cluster, kex_cfgs[n])
                runs[n]["preflight_kex"].append(r)
                print(f"  rep {k + 1} {n} hosts KEX {kex} preflight {r['preflight_s']:.2f}s + check {r['check_s']:.2f}s = {r['both_s']:.2f}s, "
                      f"cpu {r['cpu_self_s']:.2f}+{r['cpu_ssh_s']:.2f}s, load {r['load_1min']}", flush=True)  # fmt: skip
            if "job" in parts:
                r = job_record(cluster, cfgs[n], n)
                runs[n]["job"].append(r)
                print(f"  rep {k + 1} {n} hosts job: first step {fmt(r['first_step_s'], 3)}s, teardown {fmt(r['teardown_s'], 3)}s, "
                      f"cpu {r['cpu_self_s']:.2f}+{r['cpu_ssh_s']:.2f}s ({r['cpu_s'] / n:.3f}/host), load {r['load_1min']}", flush=True)  # fmt: skip
            for event in ("kill", "link"):
                if event in parts and k < max(1, reps // 2 + (reps % 2)):  # the loss runs: half the repetitions (rounded up)
                    r = loss_record(cluster, cfgs[n], n, event)
                    runs[n][event].append(r)
                    print(f"  rep {k + 1} {n} hosts {event} {r['host']}: detected {fmt(r['detected_s'], 3)}s, exit {r['exit_s']:.2f}s: {r['summary']}", flush=True)
    table: dict[str, Any] = {}
    for n in counts:
        pf, jb = runs[n]["preflight"], runs[n]["job"]
        table[str(n)] = {
            "preflight_s": summary([r["preflight_s"] for r in pf]),
            "check_s": summary([r["check_s"] for r in pf]),
            "both_s": summary([r["both_s"] for r in pf]),
            "before_preflight_s": summary([r["preflight_s"] for r in runs[n]["preflight_before"]]),
            "before_both_s": summary([r["both_s"] for r in runs[n]["preflight_before"]]),
            "kex_preflight_s": summary([r["preflight_s"] for r in runs[n]["preflight_kex"]]),
            "kex_both_s": summary([r["both_s"] for r in runs[n]["preflight_kex"]]),
            "kex_cpu_s": summary([r["cpu_s"] for r in runs[n]["preflight_kex"]]),
            "preflight_alone_s": summary([r["preflight_s"] for r in pf]),
            "preflight_cpu_s": summary([r["cpu_s"] for r in pf]),
            "preflight_cpu_per_host_s": summary([r["cpu_s"] / n for r in pf]),
            "first_step_s": summary([r["first_step_s"] for r in jb]),
            "teardown_s": summary([r["teardown_s"] for r in jb]),
            "job_cpu_self_s": summary([r["cpu_self_s"] for r in jb]),
            "job_cpu_ssh_s": summary([r["cpu_ssh_s"] for r in jb]),
            "job_cpu_s": summary([r["cpu_s"] for r in jb]),
            "job_cpu_per_host_s": summary([r["cpu_s"] / n for r in jb]),
            "kill_detected_s": summary([r["detected_s"] for r in runs[n]["kill"]]),
            "link_detected_s": summary([r["detected_s"] for r in runs[n]["link"]]),
            "teardown_after_loss_s": summary([r["teardown_after_loss_s"] for e in ("kill", "link") for r in runs[n][e]]),
        }
    return {"runs": {str(n): v for n, v in runs.items()}, "table": table}


def render(data: dict[str, Any]) -> str:
    lines = [
        "| hosts | preflight + network check (s) | network check alone (s) | start-up to first step (s) | host loss detected: kill / link (s) "
        "| teardown: job end / after a loss (s) | launcher CPU: preflight (s) | launcher CPU: job, self + ssh (s) | per host (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, t in data["table"].items():
        lines.append(
            f"| {n} | {median_range(t['both_s'])} | {median_range(t['check_s'])} | {median_range(t['first_step_s'])} | "
            f"{median_range(t['kill_detected_s'])} / {median_range(t['link_detected_s'])} | "
            f"{median_range(t['teardown_s'])} / {median_range(t['teardown_after_loss_s'])} | {median_range(t['preflight_cpu_s'])} | "
            f"{median_range(t['job_cpu_self_s'])} + {median_range(t['job_cpu_ssh_s'])} | {median_range(t['job_cpu_per_host_s'], 3)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="2,4,8,16,32", help="host counts (default 2,4,8,16,32)")
    p.add_argument("--no-loss", action="store_true", help="skip the host-loss runs")
    p.add_argument("--no-job", action="store_true", help="skip the start-up job")
    p.add_argument("--no-link", action="store_true", help="host loss by kill only (no link-down runs)")
    p.add_argument("--kex", default=None, help="also run the preflight with ssh_options KexAlgorithms=KEX (e.g. curve25519-sha256)")
    p.add_argument("--before-rev", default=None, help="also run the preflight with the SSH backend's launcher files as at this commit")
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 3)
    counts = [2] if args.smoke else sorted({int(x) for x in args.hosts.split(",")})
    parts = {"preflight", "job", "kill", "link"}
    parts -= {"kill", "link"} if args.no_loss else set()
    parts -= {"job"} if args.no_job else set()
    parts -= {"link"} if args.no_link else set()

    from tests.cluster.conftest import missing_tools, netns_rig, remove_stale_sets

    reason = missing_tools()
    if reason:
        print(f"skipped: {reason}")
        return 0
    remove_stale_sets()
    scratch = Path(tempfile.mkdtemp(prefix="glb-mhscale-", dir="/tmp"))
    data: dict[str, Any] = {"machine": machine_info(), "config": {"reps": reps, "hosts": counts, "budget_s": BUDGET_S, "parts": sorted(parts)}}
    data["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    try:
        with netns_rig(scratch / "rig", count=max(counts), prefix=f"glt-{os.getpid()}") as cluster:
            data["config"]["rig_build_s"] = round(time.monotonic() - t0, 1)
            before = export_before(scratch, args.before_rev) if args.before_rev else None
            data["config"]["before_rev"] = args.before_rev
            data["config"]["kex"] = args.kex
            data.update(run(cluster, counts, reps, parts, before, args.kex))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    data["config"]["seconds"] = round(time.monotonic() - t0, 1)
    data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result("multihost_scale-smoke" if args.smoke else "multihost_scale", data, args.out)
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
