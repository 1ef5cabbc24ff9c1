"""Scaling efficiency of the matmul job with 1 and 2 workers (each with its share of the cores).

Method: ``launch jobs/matmul_scaling.yaml --set scaling.workers=[1,2]``: one stage per world size;
the launcher gives each worker ``cores // workers`` threads (here: 1 worker x 2 threads, then
2 workers x 1 thread). Every rank times ``iters`` n x n matmuls after a barrier, so the ranks of
a stage compete for the machine at the same moment. Efficiency = total GFLOP/s with N workers /
(N x GFLOP/s of the 1-worker stage), as the job's summary computes it; since on one CPU the
1-worker stage already uses every core, the script also reports total(N) / total(1) from the same
run (the machine's cores are fixed: 1.0 means no loss from splitting the work over processes).
Repeated; medians.

On a GPU machine (``--full``) each worker has a GPU of its own and the sizes are larger.

    python benchmarks/scaling.py [--smoke | --full] [--reps N]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO, base_parser, bench_env, fmt, has_gpu, machine_info, ratio, run_timed, summary, launch_cli, write_result,
)


def one_run(sizes: list[int], iters: int, workers: list[int], cuda: bool, work: Path) -> list[dict[str, Any]]:
    dev = ["--set", "resources.device=cuda"] if cuda else ["--set", "resources.device=cpu"]
    argv = [*launch_cli(), str(REPO / "jobs" / "matmul_scaling.yaml"), "--quiet", "--out", str(work / "runs"),
            "--set", f"scaling.workers={workers}", "--set", f"params.sizes={sizes}", "--set", f"params.iters={iters}", *dev]
    done = run_timed(argv, env=bench_env(), cwd=work, timeout_s=900)
    if done.rc != 0:
        raise RuntimeError(f"launch exit {done.rc}: {done.output[-1500:]}")
    result = json.loads(next((work / "runs").glob("*/*/result.json")).read_text())
    return result["summary"]["rows"]


def main(argv: list[str] | None = None) -> int:
    args = base_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    cuda = bool(args.full and has_gpu())
    if args.smoke:
        sizes, iters, reps = [128], 5, 1
    elif cuda:
        sizes, iters, reps = [4096, 8192], 50, args.reps or 5
    else:
        sizes, iters, reps = [256, 1024], 30, args.reps or 5
    workers = [1, 2]
    runs = []
    for k in range(reps):
        with tempfile.TemporaryDirectory(prefix="glb-sc-") as work:
            rows = one_run(sizes, iters, workers, cuda, Path(work))
        runs.append(rows)
        print(f"rep {k + 1}/{reps}: " + ", ".join(f"w{r['workers']} n={r['size']} {r['gflops']:.1f} GFLOP/s eff {fmt(r['efficiency'], 3)}" for r in rows), flush=True)
    table = []
    for w in workers:
        for n in sizes:
            mine = [r for rows in runs for r in rows if r["workers"] == w and r["size"] == n]
            table.append({
                "workers": w, "size": n, "threads_per_worker": mine[0]["threads_per_worker"] if mine else None,
                "gflops_total": summary([r["gflops"] for r in mine]),
                "gflops_per_rank": summary([r["gflops_per_rank"] for r in mine]),
                "efficiency": summary([r["efficiency"] for r in mine]),
            })
    for row in table:  # on one machine the cores are fixed: compare the totals directly as well
        one = next((r for r in table if r["workers"] == 1 and r["size"] == row["size"]), None)
        row["total_vs_1_worker"] = summary([
            ratio(a["gflops"], b["gflops"]) for rows in runs for a in rows for b in rows
            if a["workers"] == row["workers"] and b["workers"] == 1 and a["size"] == b["size"] == row["size"]
        ]) if one else None
    print(f"\nscaling of the matmul job on {'cuda' if cuda else 'cpu'}, {reps} repetitions; median [min..max]")
    for row in table:
        g, e = row["gflops_total"], row["efficiency"]
        print(f"  {row['workers']} worker(s) x {row['threads_per_worker']} thread(s), n={row['size']:5d}: "
              f"{fmt(g['median'], 1)} [{fmt(g['min'], 1)}..{fmt(g['max'], 1)}] GFLOP/s, efficiency {fmt(e['median'], 3)} "
              f"[{fmt(e['min'], 3)}..{fmt(e['max'], 3)}], total vs 1 worker {fmt(row['total_vs_1_worker']['median'], 3)}")
    write_result("scaling", {
        "benchmark": "scaling", "mode": "smoke" if args.smoke else "full" if args.full else "default",
        "device": "cuda" if cuda else "cpu", "sizes": sizes, "iters": iters, "reps": reps, "method": __doc__.split("\n\n")[1],
        "machine": machine_info(), "rows": table, "raw": runs,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
