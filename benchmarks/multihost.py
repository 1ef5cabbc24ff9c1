"""Several servers over SSH: start-up against one host, SSH logins per host, and cost as hosts grow.

The hosts are network namespaces on this machine, each with its own sshd and a private run
directory (the rig of ``tests/cluster/conftest.py``; needs root, ``ip`` and ``sshd``). Every rank
is a CPU rank, so every "host" competes for this machine's cores.

Part 1, start-up (variants interleaved, rotating order, one untimed warm-up each):

  one_host        ``launch`` on this machine, no cluster file: a scaling run over world sizes
                  [2, 4] (``cpu_workers=4``), the reference
  hosts2_before   the same run on 2 hosts (``--cluster``, 1 then 2 ranks per host), the launcher
                  and the host side as before this change (this tree with the files of the
                  change as at ``--before-rev``: ``CHANGED``): a new SSH login for every remote step
  hosts2_after    the same with this working tree: one connection per host per run

  For each: from spawning ``launch`` to the first step of the first stage (world 2), the stage
  start to the first step of the second (world 4), and the SSH logins each host accepted
  (counted in its sshd log).

Part 2, cost as hosts grow (2, 4, 8 hosts, one CPU rank per host):

  preflight       ``preflight`` alone (this tree, and the code before): wall time against the
                  slowest host's own time, and the launcher's CPU time
  stage           ``launch`` of the start-up job (join + one all-reduce) at world N on N hosts:
                  spawn to first step, and the CPU time of the launcher and its ssh clients
                  (``RUSAGE_CHILDREN``: the remote processes are sshd's, not counted)

Part 3, a host lost mid-run (3 hosts, once each, this tree and the code before): every process
of one host killed, or its link taken down; how long until the launcher declared it lost and
exited, and what the failure says.

    python benchmarks/multihost.py                 # 5 repetitions of part 1, 3 of part 2
    python benchmarks/multihost.py --smoke         # 1 repetition, 2 hosts only
    python benchmarks/multihost.py --no-scale      # part 1 only
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, fmt, machine_info, median_range, ratio, rotate, run_timed, summary, write_result  # noqa: E402

JOB = REPO / "benchmarks" / "jobs" / "allreduce.yaml"
TIMEOUT_S = 240
CPU_GROUP: list[CpuGroup] = []  # the launcher's, for the whole benchmark

PREFLIGHT_SNIPPET = """\
import json, resource, sys, time
import launcher.backends.ssh as ssh
from launcher.spec.cluster import load_cluster
cluster = load_cluster(sys.argv[1])
t0 = time.monotonic()
if hasattr(ssh, "preflight_reports"):
    reports = ssh.preflight_reports(cluster)
else:  # the code before: one check (a login of its own) per host, in parallel
    version = ssh.local_torch_version()
    reports = ssh._parallel(lambda i: ssh.check_host(cluster.hosts[i], torch_version=version, first=i == 0), range(len(cluster.hosts)))
wall = time.monotonic() - t0
usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print("BENCH " + json.dumps({"wall_s": wall, "hosts_s": [r.seconds for r in reports], "problems": [p for r in reports for p in r.problems],
                             "cpu_self_s": usage[0].ru_utime + usage[0].ru_stime, "cpu_children_s": usage[1].ru_utime + usage[1].ru_stime}))
"""


class Tree:
    """A copy of the code to run: its root goes first on PYTHONPATH, for the launcher (run from a
    fresh directory, so the working directory shadows nothing) and, through a python wrapper
    named in the cluster file, for everything started on the hosts."""

    def __init__(self, name: str, root: Path, scratch: Path) -> None:
        self.name, self.root = name, root
        self.python = scratch / f"python-{name}"
        self.python.write_text(f'#!/bin/sh\nPYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
        self.python.chmod(0o755)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)  # this copy first, the caller's own entries (packages) kept
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.root), env.get("PYTHONPATH")) if p)
        return env


# The files of the one-connection-per-host change: "before" is this working tree with these
# files as they were at ``--before-rev`` (``git show REV:...``; the repository itself is not
# touched), and api.py without the run-wide connection scope (``@_one_connection_per_host``).
CHANGED = (
    "launcher/backends/ssh.py", "launcher/runtime/hostagent.py", "launcher/backends/torchrun.py",
    "launcher/backends/transports.py", "launcher/control/diagnosis.py",
)
SCOPED = "launcher/control/api.py"


def export_before(scratch: Path, rev: str) -> Path:
    """This working tree's code with ``CHANGED`` as at ``rev``: the code before the change."""
    root = scratch / "before"
    for folder in ("launcher", "benchmarks", "jobs"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    for rel in CHANGED:
        text = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        if "connection_scope" in text:
            raise SystemExit(f"{rel} at {rev} already has the change: pass --before-rev with a commit before it")
        (root / rel).write_text(text)
    scoped = root / SCOPED
    scoped.write_text(scoped.read_text().replace("@_one_connection_per_host\n", ""))
    return root


class CpuGroup:
    """A cgroup (v1 cpuacct) for the launcher and everything it starts on this machine: with one
    host, its agents, forkservers and ranks too; with a cluster file, its ssh clients (what the
    hosts run is counted in each host's own group). Where the machine has none: RUSAGE_CHILDREN,
    which misses processes the launcher does not reap itself (a forkserver, the ranks)."""

    def __init__(self, root: Path, name: str) -> None:
        self.path = root / name
        try:
            self.path.mkdir(exist_ok=True)
            self.ok = True
        except OSError:
            self.ok = False

    def wrap(self, argv: list[str]) -> list[str]:
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv] if self.ok else argv

    def seconds(self) -> float:
        if self.ok:
            return int((self.path / "cpuacct.usage").read_text()) / 1e9
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until nothing the last launch started is still running (an exiting forkserver)."""
        deadline = time.monotonic() + timeout_s
        while self.ok and (self.path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        if self.ok:
            self.settle()
            with contextlib.suppress(OSError):
                self.path.rmdir()


def launch_record(cluster: Any, tree: Tree, args: list[str], cfg: Path | None, hosts: list[Any]) -> dict[str, Any]:
    """One ``launch`` in the launching namespace: first-step times per stage, logins per host, CPU."""
    work = Path(tempfile.mkdtemp(prefix="glb-mh-", dir=cluster.workdir))
    out = cluster.out_dir(work.name)
    logins0 = [cluster.logins(h) for h in hosts]
    hosts_cpu0 = [cluster.cpu_seconds(h) for h in hosts]
    group = CPU_GROUP[0]
    cpu0, load0 = group.seconds(), os.getloadavg()[0]
    argv = cluster.ns_cmd(sys.executable, "-m", "launcher", *args, "--quiet", "--no-metrics", "--out", str(out))
    if cfg is not None:
        argv += ["--cluster", str(cfg)]
    done = run_timed(group.wrap(argv), env=tree.env(), timeout_s=TIMEOUT_S, cwd=work)
    group.settle()
    cpu = group.seconds() - cpu0
    hosts_cpu = [None if a is None or b is None else b - a for a, b in zip(hosts_cpu0, [cluster.cpu_seconds(h) for h in hosts])]
    if done.rc != 0:
        raise RuntimeError(f"{tree.name}: exit {done.rc}{' (timeout)' if done.timed_out else ''}: {done.output[-2000:]}")
    (result_path,) = out.glob("*/*/result.json")
    result = json.loads(result_path.read_text())
    stages = []
    for stage in result["stages"]:
        firsts = [r["phases"]["first_step"] for r in result["ranks"] if r["world_size"] == stage["world_size"] and "first_step" in r["phases"]]
        first = max(firsts) if firsts else None
        start = None if first is None or stage["phases"].get("to_first_step") is None else first - stage["phases"]["to_first_step"]
        stages.append({
            "world_size": stage["world_size"],
            "from_launch_s": None if first is None else first - done.t_start,
            "from_stage_start_s": stage["phases"].get("to_first_step"),
            "before_stage_s": None if start is None else start - done.t_start,
            "phases": stage["phases"],
        })
    shutil.rmtree(work, ignore_errors=True)
    return {
        "wall_s": done.wall_s,
        "stages": stages,
        "logins": [cluster.logins(h) - n for h, n in zip(hosts, logins0)],
        "cpu_launcher_s": cpu,  # the launcher and what it waited for: its ssh clients, or (one host) the agents and ranks
        "cpu_hosts_s": hosts_cpu if cfg is not None else None,  # everything each host ran (its sshd's cgroup), where countable
        "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


def preflight_record(cluster: Any, tree: Tree, cfg: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="glb-pf-", dir=cluster.workdir))
    load0 = os.getloadavg()[0]
    done = run_timed(cluster.ns_cmd(sys.executable, "-c", PREFLIGHT_SNIPPET, str(cfg)), env=tree.env(), timeout_s=120, cwd=work)
    shutil.rmtree(work, ignore_errors=True)
    line = next((ln for ln in done.output.splitlines() if ln.startswith("BENCH ")), None)
    if done.rc != 0 or line is None:
        raise RuntimeError(f"{tree.name} preflight: exit {done.rc}: {done.output[-2000:]}")
    data = json.loads(line[6:])
    if data["problems"]:
        raise RuntimeError(f"{tree.name} preflight: {data['problems']}")
    data["slowest_host_s"] = max(data["hosts_s"])
    data["cpu_s"] = data.pop("cpu_self_s") + data.pop("cpu_children_s")
    data["load_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return data


def interleave(variants: dict[str, Callable[[], dict[str, Any]]], reps: int, label: str) -> dict[str, list[dict[str, Any]]]:
    names = list(variants)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for name in names:  # untimed warm-up (page cache, sshd's first fork)
        variants[name]()
    for k in range(reps):
        for name in rotate(names, k):
            record = variants[name]()
            runs[name].append(record)
            print(f"  {label} rep {k + 1}/{reps} {name}: " + _short(record), flush=True)
    return runs


def _short(record: dict[str, Any]) -> str:
    if "stages" in record:
        firsts = ", ".join(f"w{s['world_size']} {fmt(s['from_launch_s'], 2)}s" for s in record["stages"])
        hosts = "" if not record.get("cpu_hosts_s") else ", hosts cpu " + " ".join(fmt(x, 2) for x in record["cpu_hosts_s"])
        return f"first steps from launch {firsts}; logins {record['logins']}; launcher cpu {record['cpu_launcher_s']:.2f}s{hosts}"
    return f"wall {record['wall_s']:.2f}s, slowest host {record['slowest_host_s']:.2f}s"


def part_startup(cluster: Any, trees: dict[str, Tree], reps: int) -> dict[str, Any]:
    hosts = cluster.hosts[:2]
    cfg = {name: cluster.cluster_yaml(cluster.workdir / f"cluster2-{name}.yaml", hosts=hosts, python=str(tree.python)) for name, tree in trees.items()}
    def sizes(tree: Tree) -> list[str]:
        return [str(JOB), "--set", "scaling.workers=[2,4]", "--set", f"env.PYTHONPATH={tree.root}"]

    variants = {
        "one_host": lambda: launch_record(cluster, trees["after"], [*sizes(trees["after"]), "--set", "resources.cpu_workers=4"], None, hosts),
        **{
            f"hosts2_{name}": (lambda name=name: launch_record(
                cluster, trees[name], [*sizes(trees[name]), "--set", "resources.nodes=2", "--set", "resources.cpu_workers=2"], cfg[name], hosts))
            for name in trees
        },
    }
    runs = interleave(variants, reps, "start-up")
    table = {}
    for name, records in runs.items():
        table[name] = {
            "stage1_from_launch_s": summary([r["stages"][0]["from_launch_s"] for r in records]),
            "stage1_before_stage_s": summary([r["stages"][0]["before_stage_s"] for r in records]),
            "stage2_from_stage_start_s": summary([r["stages"][1]["from_stage_start_s"] for r in records]),
            "wall_s": summary([r["wall_s"] for r in records]),
            "cpu_launcher_s": summary([r["cpu_launcher_s"] for r in records]),
            "cpu_hosts_total_s": summary([sum(r["cpu_hosts_s"]) if r["cpu_hosts_s"] and None not in r["cpu_hosts_s"] else None for r in records]),
            "logins_per_host": [r["logins"] for r in records],
            "paired_stage1_vs_one_host": summary([
                ratio(r["stages"][0]["from_launch_s"], ref["stages"][0]["from_launch_s"]) for r, ref in zip(records, runs["one_host"])
            ]),
            "paired_stage2_vs_one_host": summary([
                ratio(r["stages"][1]["from_stage_start_s"], ref["stages"][1]["from_stage_start_s"]) for r, ref in zip(records, runs["one_host"])
            ]),
        }
    return {"runs": runs, "table": table}


def part_scale(cluster: Any, trees: dict[str, Tree], counts: list[int], reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in counts:
        hosts = cluster.hosts[:n]
        cfg = {name: cluster.cluster_yaml(cluster.workdir / f"cluster{n}-{name}.yaml", hosts=hosts, python=str(tree.python)) for name, tree in trees.items()}
        variants: dict[str, Callable[[], dict[str, Any]]] = {
            f"preflight_{name}": (lambda name=name, cfg=cfg: preflight_record(cluster, trees[name], cfg[name])) for name in trees
        }
        def stage_args(tree: Tree, n: int = n) -> list[str]:
            return [str(JOB), "--set", f"resources.nodes={n}", "--set", "resources.cpu_workers=1", "--set", f"scaling.workers=[{n}]",
                    "--set", f"env.PYTHONPATH={tree.root}"]

        variants.update({
            f"stage_{name}": (lambda name=name, hosts=hosts, cfg=cfg: launch_record(cluster, trees[name], stage_args(trees[name]), cfg[name], hosts))
            for name in trees
        })
        runs = interleave(variants, reps, f"{n} hosts")
        row: dict[str, Any] = {}
        for name in trees:
            pf, st = runs[f"preflight_{name}"], runs[f"stage_{name}"]
            row[name] = {
                "preflight_wall_s": summary([r["wall_s"] for r in pf]),
                "preflight_slowest_host_s": summary([r["slowest_host_s"] for r in pf]),
                "preflight_wall_over_slowest": summary([ratio(r["wall_s"], r["slowest_host_s"]) for r in pf]),
                "preflight_cpu_s": summary([r["cpu_s"] for r in pf]),
                "stage_first_step_from_launch_s": summary([r["stages"][0]["from_launch_s"] for r in st]),
                "stage_before_stage_s": summary([r["stages"][0]["before_stage_s"] for r in st]),
                "stage_launcher_cpu_s": summary([r["cpu_launcher_s"] for r in st]),
                "stage_launcher_cpu_per_host_s": summary([r["cpu_launcher_s"] / n for r in st]),
                "stage_host_cpu_s": summary([x for r in st for x in (r["cpu_hosts_s"] or [])]),
                "logins_per_host": [r["logins"] for r in st],
                "load_1min": [r["load_1min"] for r in [*pf, *st]],
            }
        out[str(n)] = {"runs": runs, "table": row}
    return out


@dataclass
class HostLoss:
    """What a job saw when one of its hosts was lost mid-run (``lose_a_host``)."""

    victim: str
    t_event: float  # when the host was powered off or cut off (time.time())
    exit_after_s: float  # from then to the launcher's exit
    output: str  # the launcher's console
    result: dict[str, Any]  # its result.json

    @property
    def lost_ranks(self) -> list[dict[str, Any]]:
        return [r for r in self.result["ranks"] if (r.get("error") or {}).get("type") == "HostLost"]

    @property
    def declared_lost_after_s(self) -> float | None:
        lost = self.lost_ranks
        return lost[0]["error"]["time"] - self.t_event if lost else None


def lose_a_host(
    cluster: Any, cfg: Path, *, nodes: int, victim: Any, event: str, env: dict[str, str], pythonpath: str,
    launch_args: tuple[str, ...] = (), start_timeout_s: float = 120, exit_timeout_s: float = 120, rendezvous_s: float = 60,
    run_s: float = 300,
) -> HostLoss:  # fmt: skip
    """A job on ``nodes`` hosts that steps until stopped; once every rank runs, ``victim`` is
    powered off (every process of it killed: ``event`` "kill") or its link taken down ("link"),
    and the launcher is waited for; the host is brought back and every leftover ended."""
    work = Path(tempfile.mkdtemp(prefix="glb-loss-", dir=cluster.workdir))
    (work / "pids").mkdir()
    spec = {
        "name": "steady", "entrypoint": "tests.cluster.test_host_loss:steady_rank", "params": {"out": str(work / "pids")},
        "resources": {"nodes": nodes, "cpu_workers": 1}, "env": {"PYTHONPATH": pythonpath},
        "timeouts": {"rendezvous_s": rendezvous_s, "run_s": run_s},
    }  # fmt: skip
    (work / "steady.yaml").write_text(json.dumps(spec))
    out = cluster.out_dir(work.name)
    argv = cluster.ns_cmd(sys.executable, "-m", "launcher", str(work / "steady.yaml"), "--cluster", str(cfg), "--out", str(out), "--no-metrics",
                          *launch_args)  # fmt: skip
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while len(list((work / "pids").glob("rank*.json"))) < nodes:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"loss on {nodes} hosts: the ranks did not start: {(proc.communicate(timeout=60)[0] or '')[-3000:]}")
            time.sleep(0.1)
        time.sleep(1.0)
        t_event = time.time()
        if event == "kill":
            cluster.power_off(victim)
        else:
            cluster.link(victim, up=False)
        output = proc.communicate(timeout=exit_timeout_s)[0]
        exit_after = time.time() - t_event
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        if event == "kill":
            cluster.power_on(victim)
        else:
            cluster.link(victim, up=True)
        cluster.kill_leftovers()
    (result_path,) = out.glob("*/*/result.json")
    result = json.loads(result_path.read_text())
    shutil.rmtree(work, ignore_errors=True)
    return HostLoss(victim.name, t_event, exit_after, output, result)


def loss_record(cluster: Any, tree: Tree, cfg: Path, event: str) -> dict[str, Any]:
    """A 3-host job that steps until stopped; then one host is powered off (every process of it
    killed) or its link taken down. How long until the launcher says so, and what it says."""
    victim = cluster.hosts[1] if event == "kill" else cluster.hosts[2]
    loss = lose_a_host(cluster, cfg, nodes=3, victim=victim, event=event, env=tree.env(), pythonpath=f"{tree.root}{os.pathsep}{REPO}")
    failure = loss.result["failure"] or {}
    root = failure.get("root_cause") or {}
    return {
        "event": event,
        "host": loss.victim,
        "exit_after_s": loss.exit_after_s,
        "declared_lost_after_s": loss.declared_lost_after_s,
        "summary": failure.get("summary"),
        "root_cause": None if not root else f"{root.get('host')}: {root.get('type')}",
        "collateral_ranks": failure.get("collateral_ranks"),
        "could_not_fetch": "could not fetch" in loss.output,
    }


def part_loss(cluster: Any, trees: dict[str, Tree]) -> dict[str, Any]:
    hosts = cluster.hosts[:3]
    out = {}
    for name, tree in trees.items():
        cfg = cluster.cluster_yaml(cluster.workdir / f"cluster3-{name}.yaml", hosts=hosts, python=str(tree.python))
        for event in ("kill", "link"):
            record = loss_record(cluster, tree, cfg, event)
            out[f"{event}_{name}"] = record
            print(f"  host loss {event} {name}: exit after {record['exit_after_s']:.2f}s: {record['summary']}", flush=True)
    return out


def render(data: dict[str, Any]) -> str:
    lines = []
    t = data.get("startup", {}).get("table")
    if t:
        lines += [
            "| variant | launch to 1st step, world 2 (s) | x one host (paired) | stage start to 1st step, world 4 (s) | x one host (paired) "
            "| logins per host per run | CPU: launcher (+ssh) (s) | CPU: all hosts (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, row in t.items():
            logins = sorted({tuple(x) for x in row["logins_per_host"]})
            lines.append(
                f"| {name} | {median_range(row['stage1_from_launch_s'])} | {median_range(row['paired_stage1_vs_one_host'], 2)} | "
                f"{median_range(row['stage2_from_stage_start_s'])} | {median_range(row['paired_stage2_vs_one_host'], 2)} | "
                f"{', '.join(str(list(x)) for x in logins) if name != 'one_host' else '-'} | {median_range(row['cpu_launcher_s'])} | {median_range(row['cpu_hosts_total_s'])} |"
            )
    scale = data.get("scale")
    if scale:
        lines += [
            "",
            "| hosts | code | preflight wall (s) | slowest host (s) | wall / slowest | preflight CPU (s) | launch to 1st step (s) "
            "| launcher+ssh CPU (s) | per host (s) | each host's CPU (s) | logins per host |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n, block in scale.items():
            for name, row in block["table"].items():
                logins = sorted({x for r in row["logins_per_host"] for x in r})
                lines.append(
                    f"| {n} | {name} | {median_range(row['preflight_wall_s'])} | {median_range(row['preflight_slowest_host_s'])} | "
                    f"{median_range(row['preflight_wall_over_slowest'], 2)} | {median_range(row['preflight_cpu_s'])} | {median_range(row['stage_first_step_from_launch_s'])} | "
                    f"{median_range(row['stage_launcher_cpu_s'])} | {median_range(row['stage_launcher_cpu_per_host_s'])} | {median_range(row['stage_host_cpu_s'])} | {logins} |"
                )
    loss = data.get("loss")
    if loss:
        lines += ["", "| event | code | declared lost after (s) | launcher exit after (s) | summary | root cause | collateral | fetch tried |", "|---|---|---|---|---|---|---|---|"]
        for key, r in loss.items():
            lines.append(
                f"| {r['event']} {r['host']} | {key.split('_', 1)[1]} | {fmt(r['declared_lost_after_s'], 2)} | {r['exit_after_s']:.2f} | "
                f"{r['summary']} | {r['root_cause'] or '-'} | {r['collateral_ranks']} | {'yes' if r['could_not_fetch'] else 'no'} |"
            )
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--no-scale", action="store_true", help="part 1 only")
    p.add_argument("--no-startup", action="store_true", help="part 2 only")
    p.add_argument("--no-loss", action="store_true", help="skip part 3 (a host lost mid-run)")
    p.add_argument("--no-before", action="store_true", help="only this tree (no copy of the code before the change)")
    p.add_argument("--hosts", default="2,4,8", help="host counts for part 2 (default 2,4,8)")
    p.add_argument("--before-rev", default="HEAD", help="the commit whose transport files are 'before' (default HEAD)")
    p.add_argument("--scale-reps", type=int, default=None)
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 5)
    scale_reps = args.scale_reps or (1 if args.smoke else 3)
    counts = [2] if args.smoke else [int(x) for x in args.hosts.split(",")]

    from tests.cluster.conftest import CPUACCT, missing_tools, netns_rig, remove_stale_sets

    reason = missing_tools()
    if reason:
        print(f"skipped: {reason}")
        return 0
    remove_stale_sets()
    scratch = Path(tempfile.mkdtemp(prefix="glb-multihost-", dir="/tmp"))
    data: dict[str, Any] = {"machine": machine_info(), "config": {"reps": reps, "scale_reps": scale_reps, "hosts": counts}}
    try:
        trees = {"after": Tree("after", REPO, scratch)}
        if not args.no_before:
            trees = {"before": Tree("before", export_before(scratch, args.before_rev), scratch), **trees}
        with netns_rig(scratch / "rig", count=max([*counts, 3]), prefix=f"glt-{os.getpid()}") as cluster:
            CPU_GROUP.append(CpuGroup(CPUACCT, f"{cluster.cli_ns}-launcher"))
            data["config"]["cpu_accounting"] = "cgroup v1 cpuacct" if CPU_GROUP[0].ok else "RUSAGE_CHILDREN (undercounts one-host runs)"
            if not args.no_startup:
                data["startup"] = part_startup(cluster, trees, reps)
            if not args.no_scale:
                data["scale"] = part_scale(cluster, trees, counts, scale_reps)
            if not args.no_loss:
                data["loss"] = part_loss(cluster, trees)
    finally:
        for group in CPU_GROUP:
            group.close()
        shutil.rmtree(scratch, ignore_errors=True)
    data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    name = "multihost-smoke" if args.smoke else "multihost"
    write_result(name, data, args.out)
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
