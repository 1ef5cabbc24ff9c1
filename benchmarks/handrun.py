"""Several servers: ``launch`` against what a user does by hand, ``ssh HOST torchrun ...`` on each host.

Two hosts (network namespaces with their own sshd and private run directories: the rig of
``tests/cluster/conftest.py``; needs root, ``ip`` and ``sshd``), two CPU ranks on each, the same
DDP job (``benchmarks/ddp_first_step.py``) both ways:

  launch    ``launch benchmarks/jobs/ddp_first_step.yaml --cluster FILE`` from the launching host:
            preflight over one SSH connection per host, ranks forked from each host's warm rank
            server (the job runs as an entrypoint)
  by_hand   on each host at once, ``ssh HOST python -m torch.distributed.run --nnodes=2
            --node-rank=I --nproc-per-node=2 --rdzv-backend=static --master-addr=H1 ...
            benchmarks/ddp_first_step.py``: the same code as a plain script, fresh interpreters,
            the same ssh options the launcher uses (keys, known hosts), a login per host

Measured: from spawning the command(s) to the last rank's first step (each rank prints the wall
time of its first optimizer step; for ``launch`` the same stamp is its ``first_step`` phase), in
pairs (the two variants back to back, the order alternating), after one untimed run of each.
Reported: medians and the median of the paired ratios launch / by_hand (goal: at most 0.8).

    python benchmarks/handrun.py            # 5 pairs
    python benchmarks/handrun.py --smoke    # 1 pair
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, kill_group, machine_info, ratio, rotate, run_timed, summary, write_result  # noqa: E402

JOB = REPO / "benchmarks" / "jobs" / "ddp_first_step.yaml"
SCRIPT = REPO / "benchmarks" / "ddp_first_step.py"
TIMEOUT_S = 240
FIRST_STEP = re.compile(r"gl-first-step (\d+) ([\d.]+)")


def _last_first_step(text: str, world: int) -> float:
    stamps = {int(r): float(t) for r, t in FIRST_STEP.findall(text)}
    if len(stamps) != world:
        raise RuntimeError(f"{len(stamps)} of {world} ranks said when they made their first step:\n{text[-3000:]}")
    return max(stamps.values())


def launch_record(cluster: Any, cfg: Path) -> dict[str, Any]:
    out = cluster.out_dir(f"handrun-{time.monotonic_ns()}")
    argv = cluster.ns_cmd(sys.executable, "-m", "launcher", str(JOB), "--cluster", str(cfg), "--out", str(out), "--no-metrics",
                          "--set", f"env.PYTHONPATH={REPO}")  # fmt: skip
    done = run_timed(argv, timeout_s=TIMEOUT_S, env={**os.environ, "COLUMNS": "200"})
    if done.rc != 0:
        raise RuntimeError(f"launch: exit {done.rc}: {done.output[-3000:]}")
    (result_path,) = out.glob("*/*/result.json")
    result = json.loads(result_path.read_text())
    firsts = [r["phases"]["first_step"] for r in result["ranks"]]
    (stage,) = result["stages"]
    shutil.rmtree(out, ignore_errors=True)
    first = max(firsts) - done.t_start
    return {"to_first_step_s": first, "wall_s": done.wall_s, "before_stage_s": first - stage["phases"]["to_first_step"],
            "stage_phases": stage["phases"]}  # fmt: skip


def by_hand_record(cluster: Any, hosts: list[Any], port: int) -> dict[str, Any]:
    from launcher.backends.ssh import ssh_argv

    first = hosts[0]
    procs = []
    t_start = time.time()
    for node_rank, host in enumerate(hosts):
        remote = ["env", f"PYTHONPATH={REPO}", "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1",
                  sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}", "--nproc-per-node=2",
                  "--rdzv-backend=static", f"--master-addr={first.address}", f"--master-port={port}", str(SCRIPT)]  # fmt: skip
        procs.append(subprocess.Popen(cluster.ns_cmd(*ssh_argv(host, remote)), cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            kill_group(proc.pid)
            proc.wait()
    wall = time.time() - t_start
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"by hand: exits {[p.returncode for p in procs]}: {outputs[0][-2000:]}\n{outputs[-1][-2000:]}")
    return {"to_first_step_s": _last_first_step("\n".join(outputs), 4) - t_start, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 5)

    from launcher.spec.cluster import load_cluster
    from tests.cluster.conftest import missing_tools, netns_rig, remove_stale_sets

    reason = missing_tools()
    if reason:
        print(f"skipped: {reason}")
        return 0
    remove_stale_sets()
    scratch = Path(tempfile.mkdtemp(prefix="glb-handrun-", dir="/tmp"))
    data: dict[str, Any] = {"machine": machine_info(), "config": {"reps": reps, "hosts": 2, "ranks_per_host": 2}}
    runs: dict[str, list[dict[str, Any]]] = {"launch": [], "by_hand": []}
    try:
        with netns_rig(scratch / "rig", count=2, prefix=f"glt-{os.getpid()}") as cluster:
            cfg = cluster.cluster_yaml(scratch / "cluster.yaml", hosts=cluster.hosts[:2])
            hosts = list(load_cluster(cfg).hosts)
            # a fresh port for every hand run, as a user picking one would (a port in TIME_WAIT, or one
            # another run still holds, hangs a static rendezvous); the launcher picks its own
            ports = iter(random.sample(range(30000, 60000), reps + 1))
            variants = {"launch": lambda k: launch_record(cluster, cfg), "by_hand": lambda k: by_hand_record(cluster, hosts, next(ports))}
            for fn in variants.values():  # untimed: page cache, sshd's first fork
                fn(0)
            for k in range(reps):
                for name in rotate(list(variants), k):
                    record = variants[name](k + 1)
                    runs[name].append(record)
                    said = f"; before the stage {record['before_stage_s']:.2f}s, then {record['stage_phases']}" if "stage_phases" in record else ""
                    print(f"  pair {k + 1}/{reps} {name}: first step {record['to_first_step_s']:.2f}s from the spawn{said}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    data["runs"] = runs
    data["table"] = {
        name: {"to_first_step_s": summary([r["to_first_step_s"] for r in records]), "wall_s": summary([r["wall_s"] for r in records])}
        for name, records in runs.items()
    }
    data["paired_launch_over_by_hand"] = summary([ratio(a["to_first_step_s"], b["to_first_step_s"]) for a, b in zip(runs["launch"], runs["by_hand"])])
    data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result("handrun-smoke" if args.smoke else "handrun", data, args.out)
    t, r = data["table"], data["paired_launch_over_by_hand"]
    print(f"launch {t['launch']['to_first_step_s']['median']:.2f}s, by hand {t['by_hand']['to_first_step_s']['median']:.2f}s "
          f"to the first step; launch / by hand {r['median']} [{r['min']}..{r['max']}] (paired)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
