"""What hang detection costs, and how long gathering a hung stage's evidence takes as hosts grow.

Part 1, a rank's cost per step: two gloo ranks on this machine, the DDP model of
``straggler_overhead.py`` (8 x 256x256 linear layers, 0.25 MB buckets: 9 all-reduces a step, each
one an entry in the flight recorder), the same steps timed in two variants, a fresh pair of ranks
per variant and repetition, interleaved with a rotating order:

- ``off``: the flight recorder off (``TORCH_FR_BUFFER_SIZE=0``), no request watch;
- ``on``: what every rank gets: the recorder on (``enable_flight_recorder``: 2,000 entries) and
  the beacon thread's look for a hang request twice a second (``RankAccount.maybe_answer``).

(The stall watch itself runs in the launcher on the beacons it already receives: nothing in a rank.)

Part 2, evidence at 2, 4 and 8 hosts (network namespaces with sshd, private run directories;
needs root): ``launch --cluster`` of ``tests/integration/hang_job.py``, one rank per host, the last
rank sleeping forever at step 10, ``timeouts.hang_s: 3``; from ``result.json``: the time to gather
every host's evidence (``gather_s``: all hosts in parallel, each over its one SSH connection) and
when the hang was named (``detected_after_s``). Goal: flat in the host count, under 5 s.

    python benchmarks/hang_cost.py [--smoke] [--reps N] [--hosts 2,4,8] [--no-hosts]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, fmt, machine_info, rotate, summary, write_result  # noqa: E402
from benchmarks.straggler_overhead import ddp_steps_us, mlp  # noqa: E402

VARIANTS = ("off", "on")


def _rank(rank: int, store_path: str, variant: str, steps: int, out_path: str) -> None:
    import torch

    from launcher.protocol import StagePaths
    from launcher.runtime.hangdump import RankAccount, enable_flight_recorder

    if variant == "on":
        enable_flight_recorder(str(torch.__version__))
        account, stop = RankAccount(StagePaths(Path(store_path).parent), rank), threading.Event()
        threading.Thread(target=lambda: [account.maybe_answer() for _ in iter(lambda: stop.wait(0.5), True)], daemon=True).start()
    else:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    model = DDP(mlp(torch), bucket_cap_mb=0.25)
    ddp_steps_us(torch, dist, model, 10)  # warm-up
    step_us = ddp_steps_us(torch, dist, model, steps)
    if rank == 0:
        Path(out_path).write_text(json.dumps(step_us))
    dist.destroy_process_group()
    os._exit(0)  # as the rank runtime leaves (fast_exit): gloo's threads can abort an interpreter's teardown


def part_rank_cost(reps: int, steps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for variant in rotate(VARIANTS, rep):
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "step.json")
                mp.spawn(_rank, args=(str(Path(tmp) / "store"), variant, steps, out), nprocs=2)
                times[variant].append(json.loads(Path(out).read_text()))
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    return {"steps_per_rep": steps, "step_us": {v: summary(times[v]) for v in VARIANTS}, "on_x_off": summary(ratios)}


SPEC = """\
name: hangscale
entrypoint: tests.integration.hang_job:run
params: {{hang: sleep, rank: {last}, at: 10}}
resources: {{nodes: {hosts}, cpu_workers: 1}}
timeouts: {{hang_s: 3, run_s: 300}}
env: {{PYTHONPATH: {repo}}}
"""


def part_hosts(counts: list[int], reps: int) -> dict[str, Any]:
    from tests.cluster.conftest import missing_tools, netns_rig, remove_stale_sets

    reason = missing_tools()
    if reason:
        return {"skipped": reason}
    remove_stale_sets()
    scratch = Path(tempfile.mkdtemp(prefix="glb-hang-", dir="/tmp"))
    rows: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    try:
        with netns_rig(scratch / "rig", count=max(counts), prefix=f"glh-{os.getpid()}") as cluster:
            for rep in range(reps):
                for n in rotate(counts, rep):
                    spec = scratch / f"hang{n}.yaml"
                    spec.write_text(SPEC.format(last=n - 1, hosts=n, repo=REPO))
                    cfg = cluster.cluster_yaml(scratch / f"cluster{n}.yaml", hosts=cluster.hosts[:n])
                    out = cluster.out_dir(f"hang{n}-{rep}")
                    done = cluster.launch(str(spec), "--cluster", str(cfg), "--out", str(out), "--no-metrics", timeout=240)
                    (result,) = [json.loads(p.read_text()) for p in out.glob("hangscale/*/result.json")]
                    hang = (result.get("failure") or {}).get("hang") or {}
                    culprit = (hang.get("culprits") or [{}])[0]
                    rows[n].append({"rc": done.returncode, "status": result["status"], "gather_s": hang.get("gather_s"),
                                    "detected_after_s": hang.get("detected_after_s"), "culprit": [culprit.get("rank"), culprit.get("host")]})  # fmt: skip
                    print(f"{n} hosts: {rows[n][-1]}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {str(n): {"runs": r, "gather_s": summary([x["gather_s"] for x in r if x["gather_s"] is not None])} for n, r in rows.items()}


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2,4,8")
    p.add_argument("--no-hosts", action="store_true", help="part 1 only")
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 9)
    data: dict[str, Any] = {"mode": "smoke" if args.smoke else "full", "machine": machine_info()}
    data["rank_cost"] = part_rank_cost(reps, 20 if args.smoke else 300)
    cost = data["rank_cost"]
    for v in VARIANTS:
        s = cost["step_us"][v]
        print(f"{v:4s} step {fmt(s['median'], 0)} us [{fmt(s['min'], 0)}..{fmt(s['max'], 0)}]")
    r = cost["on_x_off"]
    print(f"on / off, paired: {fmt(r['median'])} [{fmt(r['min'])}..{fmt(r['max'])}]")
    if not args.no_hosts:
        data["hosts"] = part_hosts([2] if args.smoke else [int(x) for x in args.hosts.split(",")], 1 if args.smoke else max(1, min(reps, 3)))
    write_result("hang_cost", data, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
