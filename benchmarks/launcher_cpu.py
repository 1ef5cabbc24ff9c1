"""The launcher's own CPU seconds around a no-op run, held to a budget (CI runs this).

A few no-op 2-rank CPU runs (the start-up benchmark's jobs: ``benchmarks/jobs/allreduce.yaml``,
ranks forked from the forkserver, and ``allreduce_script.yaml``, an unchanged torchrun script),
each read back from its ``result.json``: ``phases.launcher_cpu_s``, the launcher process's own
user + system seconds (not its agent's or ranks'; ``launcher.control.cpuclock``) before the first
agent is spawned and after the last stage's processes have exited, and by phase. The median of
the runs is held to ``BUDGET_S``; over it, the exit status is 1 and the message names the phase
that grew (its figure, its budget and what it was when the budget was set).

CPU seconds rather than wall time: another process on the machine delays the launcher but changes
the CPU it uses far less (here, from load 4 to load 45: start-up CPU 0.30-0.47 s where the wall
time went from 3 s to 30 s). The budgets are the medians measured on the 2-core development
machine (``REFERENCE_S``) with room for a busy CI machine: about 2x for the interpreter and imports
(``start``: an import of torch, or of the whole results/UI stack, in front of the spawn is caught;
a single 20 ms module is not), and 20-40 ms for the phases of a few milliseconds, where the work
the preflight, the metrics endpoint or the stage's end used to do (NVML, prometheus_client and its
HTTP server, psutil) would show at once (see BENCHMARKS.md, "Start-up").

    python benchmarks/launcher_cpu.py                 # 3 + 2 runs, ~20 s
    python benchmarks/launcher_cpu.py --reps 1        # one of each
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, bench_env, machine_info, run_timed, launch_cli, write_result  # noqa: E402

JOBS = {"entrypoint": REPO / "benchmarks" / "jobs" / "allreduce.yaml", "script": REPO / "benchmarks" / "jobs" / "allreduce_script.yaml"}
TIMEOUT_S = 120

# What each figure was when the budget was set (2026-11-27, the 2-core machine; medians)
REFERENCE_S = {
    "before_spawn": 0.36, "after_exit": 0.005,
    "start": 0.34, "preflight": 0.002, "run_dir": 0.004, "metrics": 0.008, "session": 0.0, "plan": 0.001, "spawn": 0.006,
    "stage_end": 0.003, "results": 0.002,
}  # fmt: skip
# The budget: the totals first (what the issue guards), then each phase (which one grew)
BUDGET_S = {
    "before_spawn": 0.70, "after_exit": 0.05,
    "start": 0.65, "preflight": 0.03, "run_dir": 0.03, "metrics": 0.04, "session": 0.02, "plan": 0.02, "spawn": 0.04,
    "stage_end": 0.04, "results": 0.04,
}  # fmt: skip
TOTALS = ("before_spawn", "after_exit")


def one_run(job: Path, work: Path) -> dict[str, Any]:
    """One no-op run: its launcher_cpu_s, and the wall time of the whole command."""
    out = work / "runs"
    env = bench_env({"BENCH_STAMP_DIR": str(work)})
    # a module compiled afresh in every run (no .pyc written) would be charged to the launcher's start
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = run_timed([*launch_cli(), str(job), "--quiet", "--out", str(out)], env=env, timeout_s=TIMEOUT_S, cwd=work)
    if done.rc != 0:
        raise RuntimeError(f"{job.name}: exit {done.rc}{' (timeout)' if done.timed_out else ''}: {done.output[-1500:]}")
    (found,) = sorted(out.glob("*/*/result.json"))
    cpu = json.loads(found.read_text())["phases"].get("launcher_cpu_s")
    if not cpu:
        raise RuntimeError(f"{found}: no phases.launcher_cpu_s")
    return {"job": job.stem, "wall_s": round(done.wall_s, 3), "launcher_cpu_s": cpu}


def figures(cpu: dict[str, Any]) -> dict[str, float]:
    """The budgeted figures of one run: the two totals and every phase."""
    flat = {name: cpu.get(name) for name in TOTALS}
    flat.update(cpu.get("by_phase") or {})
    return {k: float(v) for k, v in flat.items() if k in BUDGET_S and v is not None}


def judge(medians: dict[str, float]) -> list[str]:
    """One line per figure over its budget, the totals first; empty when within budget."""
    over = []
    for name, budget in BUDGET_S.items():
        got = medians.get(name)
        if got is not None and got > budget:
            kind = "total" if name in TOTALS else "phase"
            over.append(f"{kind} {name}: {got:.3f} s > budget {budget:.3f} s (was {REFERENCE_S.get(name, 0.0):.3f} s when the budget was set)")
    phases_over = [line for line in over if line.startswith("phase")]
    if any(line.startswith("total") for line in over) and not phases_over:
        # a total over with no phase over its own budget: name the phase that grew the most
        grew = max((n for n in medians if n not in TOTALS), key=lambda n: medians[n] - REFERENCE_S.get(n, 0.0), default=None)
        if grew is not None:
            over.append(f"phase {grew} grew the most: {medians[grew]:.3f} s (was {REFERENCE_S.get(grew, 0.0):.3f} s)")
    return over


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 3)
    order = [name for k in range(reps) for name in (("entrypoint", "script") if k < max(1, reps - 1) else ("entrypoint",))]
    with tempfile.TemporaryDirectory(prefix="glb-cpu-") as work:  # untimed: page cache, .pyc files
        one_run(JOBS["entrypoint"], Path(work))
    runs = []
    for name in order:
        with tempfile.TemporaryDirectory(prefix="glb-cpu-") as work:
            run = one_run(JOBS[name], Path(work))
        runs.append(run)
        cpu = run["launcher_cpu_s"]
        print(f"{name:10s} before spawn {cpu['before_spawn']:.3f} s, after exit {cpu['after_exit']:.3f} s, total {cpu['total']:.3f} s CPU"
              f" (wall {run['wall_s']:.2f} s)", flush=True)
    per_run = [figures(r["launcher_cpu_s"]) for r in runs]
    medians = {name: round(statistics.median(f[name] for f in per_run if name in f), 4) for name in BUDGET_S if any(name in f for f in per_run)}
    over = judge(medians)
    print(f"\nlauncher CPU seconds, median of {len(runs)} no-op runs (budget):")
    for name, budget in BUDGET_S.items():
        if name in medians:
            print(f"  {name:13s} {medians[name]:.3f}  ({budget:.3f}){'  OVER' if medians[name] > budget else ''}")
    write_result("launcher_cpu", {
        "benchmark": "launcher_cpu", "machine": machine_info(), "runs": runs, "median_s": medians, "budget_s": BUDGET_S,
        "reference_s": REFERENCE_S, "over": over,
    }, args.out)  # fmt: skip
    if over:
        print("\nlauncher CPU over budget:\n  " + "\n  ".join(over), file=sys.stderr)
        return 1
    print("within budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
