"""Goodput under a fault every ``--interval`` seconds: bare torchrun, the launcher's restart path,
and the launcher's recovery in place, side by side in one run (issue 36).

The job (``benchmarks/jobs/goodput_job.py``): a ~25M-parameter MLP with Adam, its own start as a
real job has (torch imported, the model built, a data set generated and normalised), DDP on 2 CPU
ranks over gloo, each step's batch drawn from the step's own seed, a checkpoint every ``--every``
steps. Each variant runs ``--duration`` seconds (the ranks agree on the deadline at each step);
every ``--interval`` seconds the soak SIGKILLs rank 1 (its pid as the rank published it):

* ``bare``: ``torchrun --max-restarts=1000`` (spawned ranks), ``torch.save`` by rank 0 (the anchor);
* ``restart``: ``launch`` with ``max_restarts``: the group restarted, resumed from ``ctx.checkpoint``;
* ``in_place``: ``launch``, the job opted in with ``ctx.checkpoint.in_place``: the survivor keeps
  its process, a replacement is forked from the agent's rank server, the state from the survivor;
* ``in_place_async``: the same with ``checkpoint.async_save: true`` (the disk checkpoint written on
  a thread while the job steps on: the step waits only for a copy of the state);
* ``in_place_async_spare``: the same with the job's start in its ``prepare`` (spec ``prepare``) and
  ``checkpoint.warm_spares: 1``: the replacement is a spare that built its model and data ahead.

Goodput = time on steps that count / wall: a step counts in its last execution (a step done
again after a restart counts once, its lost first run not at all); the wall runs from the
variant's start to its end. Per failure: detection (death -> the survivors' broken collective,
in place; death -> the attempt recorded as ended, restart path), recovery (death -> the end of
the first step started after it: every rank stepping again), steps lost (done before the death,
done again after it).

    python benchmarks/goodput.py [--duration 300] [--interval 60] [--every 20] [--variants bare,restart,in_place,in_place_async,in_place_async_spare] [--together]

``--await-spare`` makes each kill of a spare variant also wait for a ready warm spare, and
``--work-root`` puts the variants' work directories (kept: logs, runs, checkpoints) somewhere
else (for the short test, ``tests/benchmarks/test_goodput_smoke.py``).

``--hosts N`` runs each variant over N namespace hosts (``tests/cluster``'s rig: sshd and a
private run root each; root, ``ip`` and ``sshd`` needed), 2 CPU ranks per host: ``bare`` is a
torchrun per host (the c10d rendezvous, a failure restarting every node's ranks in a new round),
the launcher's variants run with ``--cluster``; each fault SIGKILLs another rank (``victim``:
every rank but 0 in turn, consecutive faults on different hosts), and a loss's figures come from
``result.json``. Every host shares this machine's cores. ``--spare-hosts S`` adds S more hosts to
the launcher's cluster file (beyond ``resources.nodes``: spares), and ``--host-every K`` makes
every K-th fault a lost host instead: the victim's host (never the one rank 0 runs on, which
serves the stage's store) powered off, every process of it and its run directory, and on again
at once (a node that reboots: the pool takes it back as its last spare). ``bare`` takes no host
faults (its fixed ``--nnodes`` waits for the lost host's torchrun, which nothing starts again).

``--together`` runs the variants at the same time (each its own 2 ranks, the faults at the same
moments): on a machine whose load other work changes, one after the other they do not see the
same machine (a step took 0.5 s in one variant's window and 3 s in another's here).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "benchmarks" / "jobs" / "goodput_job.py"
VARIANTS = ("bare", "restart", "in_place", "in_place_async", "in_place_async_spare")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}


def _start(variant: str, work: Path, end_at: float, args: Any, rig: Any = None) -> list[subprocess.Popen[bytes]]:
    """The variant's processes: one (torchrun, or ``launch``), or with ``rig`` (``--hosts``) a
    torchrun per namespace host for ``bare``. The job's step log, pids and ``bare``'s checkpoint
    are under ``work``, outside the hosts' private run roots: the soak's own instruments."""
    common = {
        "steplog": str(work / "steps.log"),
        "pids": str(work / "pids"),
        "end_at": end_at,
        "samples": args.samples,
        "batch": args.batch,
        "every": args.every,
    }
    log = open(work / "output.log", "wb")  # noqa: SIM115 - the children's, closed with them
    if variant == "bare":
        job = [str(JOB), *[f"--{k.replace('_', '-')}={v}" for k, v in common.items()], f"--ckpt={work / 'ckpt.pt'}"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1000", "--monitor-interval=0.1"]
        if rig is None:
            return [_popen([*torchrun, "--standalone", *job], log)]
        hosts = rig.hosts[: args.hosts]
        # the dynamic (c10d) rendezvous: a failure restarts every node's ranks in a new round
        rendezvous = [f"--nnodes={len(hosts)}", "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0].address}:29400", f"--rdzv-id=goodput-{work.name}"]
        # the namespace hosts share this machine's name: each says which one serves the rendezvous
        # (is_host) and which address its ranks are found at (--local-addr), not the name
        return [
            _popen(rig.ns_cmd(*torchrun, *rendezvous, f"--rdzv-conf=is_host={int(i == 0)}", f"--local-addr={host.address}", *job, ns=host.ns), log,
                   {"GLOO_SOCKET_IFNAME": "eth0"})  # fmt: skip
            for i, host in enumerate(hosts)
        ]
    spec = {
        "name": f"goodput_{variant}", "entrypoint": "benchmarks.jobs.goodput_job:run",
        "params": {**common, "mode": "in_place" if variant.startswith("in_place") else variant},
        "resources": {"cpu_workers": 2}, "scaling": {"workers": [2]}, "max_restarts": 100,
        "checkpoint": {"keep": 1, "async_save": "_async" in variant, "warm_spares": 1 if variant.endswith("_spare") else 0},
        "timeouts": {"rendezvous_s": 300, "run_s": args.duration + 900},
    }  # fmt: skip
    if variant.endswith("_spare"):  # the job's start in prepare(): a warm spare has built it when a rank is lost
        spec["prepare"] = "benchmarks.jobs.goodput_job:prepare"
    cmd = [sys.executable, "-m", "launcher", str(work / "spec.yaml"), "--out", str(work / "runs"), "--quiet"]
    if rig is not None:
        spec.pop("scaling")
        spec["resources"] = {"nodes": args.hosts, "cpu_workers": 2}
        spec["env"] = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        hosts = rig.hosts[: args.hosts + args.spare_hosts]  # those beyond resources.nodes are spares
        cmd = rig.ns_cmd(*cmd, "--no-metrics", "--cluster", str(rig.cluster_yaml(work / "cluster.yaml", hosts=hosts)))
    (work / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return [_popen(cmd, log)]


def _popen(cmd: list[str], log: Any, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=REPO, env={**_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """The variant's processes and everything under them, by pid (torchrun puts its ranks in sessions of their own)."""
    for proc in procs:
        _stop_one(proc)


def _stop_one(proc: subprocess.Popen[bytes]) -> None:
    import psutil

    if proc.poll() is not None:
        return
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.kill()
    proc.wait()


def _rank_pid(work: Path, rank: int) -> int | None:
    try:
        return int((work / "pids" / f"rank{rank}").read_text())
    except (OSError, ValueError):
        return None


def victim(kill: int, world_size: int) -> int:
    """The rank the ``kill``-th fault (0 on) takes: rank 1 on 2 ranks; over more (2 per host: an
    even world, so an odd count of candidates), every rank but 0 in turn, two apart, so that
    consecutive faults fall on different hosts (4 hosts: 1, 3, 5, 7, 2, 4, 6)."""
    if world_size <= 2:
        return 1
    return 1 + (kill * 2) % (world_size - 1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _spares_ready(work: Path) -> int:
    """How many warm spares have prepared so far in the variant's run (their ready files)."""
    return sum(1 for _ in work.glob("runs/*/*/world*/in_place/attempt*/spare.*.json"))


def _kill_loop(procs: list[subprocess.Popen[bytes]], work: Path, started: float, end_at: float, interval: float, world_size: int,
               await_spare: bool = False, host_every: int = 0, rig: Any = None) -> list[dict[str, Any]]:  # fmt: skip
    """SIGKILL a rank (``victim``) at every ``interval`` from the start while the run lasts; the
    kills done. ``await_spare``: each kill also waits for a warm spare that is ready (the short
    test's fault is the spare's, whatever the machine's load). ``host_every``: every such fault
    powers the victim's host off (and on again) instead (``rig``'s hosts)."""
    kills: list[dict[str, Any]] = []
    killed: set[int] = set()
    due = started + interval
    while procs[0].poll() is None and due < end_at - 5 and time.time() < end_at - 5:  # no kill in the run's last seconds
        time.sleep(0.05)  # never a busy wait: the soak's own CPU is the ranks' to use
        if time.time() < due or (await_spare and _spares_ready(work) <= len(kills)):
            continue
        rank = victim(len(kills), world_size)
        pid = _rank_pid(work, rank)
        if pid is None or pid in killed or not _alive(pid):
            continue  # its new process has not published itself yet: the kill waits for it
        host = _host_of(rig, pid) if host_every and (len(kills) + 1) % host_every == 0 else None
        if host is not None and host is _host_of(rig, _rank_pid(work, 0) or -1):
            host = None  # rank 0's host serves the stage's store: a rank fault there instead
        at = time.time()
        if host is None:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
            kills.append({"pid": pid, "rank": rank, "at": at, "late_s": round(at - due, 3)})
        else:
            killed.update(_pids_in(host))
            rig.power_off(host)
            kills.append({"pid": pid, "rank": rank, "host": host.name, "at": at, "late_s": round(at - due, 3)})
            rig.power_on(host)  # a node that reboots: sshd back, its run directory empty
        due += interval
    return kills


def _pids_in(host: Any) -> set[int]:
    from tests.netns import netns_pids

    return netns_pids(host.ns)


def _host_of(rig: Any, pid: int) -> Any:
    """The namespace host ``pid`` runs in (None: none of the rig's)."""
    return next((host for host in rig.hosts if pid in _pids_in(host)), None) if rig is not None else None


def _steps(work: Path) -> list[tuple[int, float, float, int]]:
    rows = []
    for line in (work / "steps.log").read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            rows.append((int(parts[0]), float(parts[1]), float(parts[2]), int(parts[3])))
    return rows


def _goodput(rows: list[tuple[int, float, float, int]], wall: float) -> dict[str, Any]:
    counted: dict[int, tuple[float, float]] = {}
    for step, t0, t1, _ in rows:
        counted[step] = (t0, t1)  # the last execution of each step is the one that counts
    useful = sum(t1 - t0 for t0, t1 in counted.values())
    durations = [t1 - t0 for t0, t1 in counted.values()]
    return {
        "goodput": round(useful / wall, 4), "useful_s": round(useful, 2), "wall_s": round(wall, 2), "steps": len(counted),
        "executions": len(rows), "step_s_median": round(statistics.median(durations), 4) if durations else None,
    }  # fmt: skip


def _failures(rows: list[tuple[int, float, float, int]], kills: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    recoveries = _recoveries(work)
    ended = _attempt_ends(work)
    out = []
    for kill in kills:
        at = kill["at"]
        before = [step for step, _, t1, _ in rows if t1 <= at]
        after = [(t1, step) for step, t0, t1, _ in rows if t0 > at]
        first_after = min(after) if after else None
        entry: dict[str, Any] = {"killed_pid": kill["pid"], "rank": kill["rank"], "at": round(at, 3), "fault": f"host {kill['host']}" if kill.get("host") else "rank"}
        entry["recovery_s"] = round(first_after[0] - at, 3) if first_after else None
        entry["steps_lost"] = max(0, (max(before) + 1 if before else 0) - first_after[1]) if first_after else None
        # the recovery of this kill: its rank, the first one whose death is not before the kill
        record = next((r for r in recoveries if entry["rank"] in r.get("dead_ranks", ()) and float(r.get("died_at") or 0) >= at - 1.0), None)
        if record is not None and record.get("path") == "in_place":
            died = float(record["died_at"])
            entry.update(
                path="in_place", detection_s=round(died + float(record.get("detection_s") or 0.0) - at, 3), state_s=record.get("state_s"),
                state_bytes=record.get("state_bytes"), replacements=record.get("replacements"),
            )  # fmt: skip
        else:
            end = next((e for e in ended if e > at), None)
            entry.update(path="restart", detection_s=round(end - at, 3) if end is not None and work.joinpath("runs").exists() else None)
        out.append(entry)
    return out


def _recoveries(work: Path) -> list[dict[str, Any]]:
    """Every loss the launcher told in its result (``stages[].recoveries``), oldest first."""
    found: list[dict[str, Any]] = []
    for path in work.glob("runs/*/*/result.json"):
        doc = json.loads(path.read_text())
        found += [r for stage in doc.get("stages", []) for r in stage.get("recoveries") or []]
    return sorted(found, key=lambda r: float(r.get("died_at") or 0))


def _attempt_ends(work: Path) -> list[float]:
    """When the launcher recorded each attempt as ended (the restart path's detection and teardown)."""
    for path in work.glob("runs/*/*/result.json"):
        doc = json.loads(path.read_text())
        return sorted(float(a["ended_at"]) for s in doc.get("stages", []) for a in s.get("attempts", [])[:-1])
    return []


def soak(variant: str, args: Any, started: float | None = None, rig: Any = None) -> dict[str, Any]:
    """One variant for ``--duration`` seconds from ``started`` (now by default), a rank killed every ``--interval``."""
    work = Path(tempfile.mkdtemp(prefix=f"goodput-{variant}-", dir=args.work_root))  # kept: its logs, runs and checkpoints
    started = started or time.time()
    end_at = started + args.duration
    procs = _start(variant, work, end_at, args, rig)
    world_size = 2 * (args.hosts if rig is not None else 1)
    stopped = False
    try:
        host_every = args.host_every if rig is not None and variant != "bare" else 0
        kills = _kill_loop(procs, work, started, end_at, args.interval, world_size, await_spare=args.await_spare and variant.endswith("_spare"),
                           host_every=host_every, rig=rig)  # fmt: skip
        try:
            deadline = end_at + args.grace
            codes = [proc.wait(timeout=max(1.0, deadline - time.time())) for proc in procs]
            code: int | None = max(codes, key=abs)
        except subprocess.TimeoutExpired:  # not back at a step since the deadline (a restart that does not come back)
            code, stopped = None, True
    finally:
        _stop(procs)
    wall = time.time() - started
    rows = _steps(work)
    failures = _failures(rows, kills, work)
    result = {
        "variant": variant,
        "hosts": args.hosts if rig is not None else 1,
        "world_size": world_size,
        "exit_code": code,
        "stopped_by_soak": stopped,
        "kills": len(kills),
        **_goodput(rows, wall),
        "failures": failures,
        "work_dir": str(work),
    }
    for key in ("recovery_s", "steps_lost", "detection_s"):
        values = [f[key] for f in failures if f.get(key) is not None]
        result[f"{key}_median"] = statistics.median(values) if values else None
        result[f"{key}_range"] = [min(values), max(values)] if values else None
    return result


def soak_together(variants: list[str], args: Any, rig: Any = None) -> list[dict[str, Any]]:
    """Every variant at once, from the same moment, its faults at the same moments: on a machine
    whose load others change, the only way their figures see the same machine (each has 2 ranks
    of its own; all share the cores)."""
    from concurrent.futures import ThreadPoolExecutor

    started = time.time()
    with ThreadPoolExecutor(len(variants)) as pool:
        return list(pool.map(lambda v: soak(v, args, started, rig), variants))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--interval", type=float, default=60.0)
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--samples", type=int, default=20000, help="the data set's rows (the job's start)")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank and step")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--grace", type=float, default=180.0, help="after the deadline, this long to finish, then it is stopped")
    parser.add_argument("--together", action="store_true", help="run the variants at the same time (the same machine for all)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--work-root", type=Path, default=None, help="where each variant's work directory goes (default: the system's temp dir)")
    parser.add_argument("--await-spare", action="store_true", help="each kill of a spare variant waits for a ready warm spare (the short test)")
    parser.add_argument("--hosts", type=int, default=0, help="run over this many namespace hosts, 2 CPU ranks each (root, ip, sshd); 0: this machine")
    parser.add_argument("--spare-hosts", type=int, default=0, help="with --hosts: this many more hosts in the cluster file, as spares")
    parser.add_argument("--host-every", type=int, default=0, help="with --hosts: every K-th fault powers the victim's host off (and on again)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    with contextlib.ExitStack() as stack:
        rig = stack.enter_context(_rig(args.hosts + args.spare_hosts)) if args.hosts else None
        where = f"{args.hosts} namespace hosts x 2 ranks, a rank" if rig is not None else "2 ranks, rank 1"
        if args.together:
            print(f"goodput: {', '.join(variants)} together for {args.duration:g}s on {where} of each SIGKILLed every {args.interval:g}s", flush=True)
            results = soak_together(variants, args, rig)
        else:
            results = []
            for variant in variants:
                print(f"goodput: {variant} for {args.duration:g}s on {where} SIGKILLed every {args.interval:g}s", flush=True)
                results.append(soak(variant, args, rig=rig))
    for r in results:
        print(f"  {r['variant']}: goodput {r['goodput']:.3f} ({r['useful_s']}s of {r['wall_s']}s), {r['steps']} steps, {r['kills']} kills, "
              f"recovery {r['recovery_s_median']} s {r['recovery_s_range']}, steps lost {r['steps_lost_median']} {r['steps_lost_range']}", flush=True)  # fmt: skip
    doc = {
        "benchmark": "goodput", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": socket.gethostname(),
        "cores": os.cpu_count(), "load_avg_end": list(os.getloadavg()),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "results": results,
    }  # fmt: skip
    text = json.dumps(doc, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


@contextlib.contextmanager
def _rig(hosts: int) -> Any:
    """``hosts`` namespace hosts with sshd and a private run root each (``tests/cluster``'s rig),
    every process and namespace removed at the end, by pid."""
    sys.path.insert(0, str(REPO))  # run as a script: the rig is the tests' own
    from tests.cluster.conftest import missing_tools, netns_rig, remove_stale_sets

    reason = missing_tools()
    if reason:
        raise SystemExit(f"--hosts needs the namespace rig: {reason}")
    remove_stale_sets()
    scratch = Path(tempfile.mkdtemp(prefix="glb-goodput-", dir="/tmp"))
    try:
        with netns_rig(scratch / "rig", count=hosts, prefix=f"glg-{os.getpid()}") as rig:
            yield rig
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
