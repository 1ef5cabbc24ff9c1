"""Render benchmarks/results/*.json as the Markdown tables of BENCHMARKS.md.

    python benchmarks/report.py [--dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, fmt  # noqa: E402


def _load(d: Path, name: str) -> dict[str, Any] | None:
    path = d / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _spread(s: dict[str, Any], digits: int = 3) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{fmt(s['median'], digits)} [{fmt(s['min'], digits)}..{fmt(s['max'], digits)}]"


def machine_line(m: dict[str, Any]) -> str:
    gpus = ", ".join(m.get("gpus") or []) or "no GPU"
    v = m.get("versions", {})
    return (f"{m.get('cpu')} ({m.get('cores')} cores), {m.get('memory_gib')} GiB, {gpus}; Python {v.get('python')}, "
            f"torch {v.get('torch')}, ray {v.get('ray')}; commit {m.get('git_commit')}; {m.get('date')}; "
            f"load average at start {m.get('loadavg_at_start')}")


def startup(d: dict[str, Any]) -> list[str]:
    out = [f"Start-up ({d['device']}, {d['reps']} interleaved repetitions; median [min..max], seconds). Machine: {machine_line(d['machine'])}", "",
           "| variant | wall s | wall / torchrun: of medians; paired per rep | to first step s | first step / torchrun: of medians; paired per rep | exit after last rank finished s |",
           "|---|---|---|---|---|---|"]
    for name, row in d["variants"].items():
        out.append(f"| {name} | {_spread(row['wall_s'])} | {fmt(row['wall_ratio_vs_torchrun'], 2)}; {_spread(row.get('wall_ratio_per_rep', {}), 2)} | "
                   f"{_spread(row['first_step_s'])} | {fmt(row['first_step_ratio_vs_torchrun'], 2)}; "
                   f"{_spread(row.get('first_step_ratio_per_rep', {}), 2)} | {_spread(row.get('after_last_rank_finished_s', {}))} |")
    for name, why in d.get("skipped", {}).items():
        out.append(f"| {name} | skipped: {why} | | | | |")
    phases = [(n, r) for n, r in d["variants"].items() if "phase_spawn_s" in r]
    if phases:
        # results from before 2026-11-23 have one stamp for both: their "rendezvous" includes pg init
        split = any("phase_pg_init_s" in r for _, r in phases)
        names = ("spawn", "import", "rendezvous", "pg_init", "run", "to_first_step") if split else ("spawn", "import", "rendezvous", "run", "to_first_step")
        middle = "rendezvous | pg init" if split else "rendezvous + pg init"
        out += ["", "Where `launch`'s start-up went (stage phases from result.json, medians, seconds):", "",
                f"| variant | launcher start (spawn to run start) | backend session (e.g. ray.init) | spawn | import | {middle} | run | stage start to first step |",
                "|---" * (len(names) + 3) + "|"]
        for name, r in phases:
            out.append(f"| {name} | {fmt(r['launcher_before_stage_s']['median'])} | {fmt((r.get('session_setup_s') or {}).get('median'))} | " + " | ".join(
                fmt((r.get(f'phase_{p}_s') or {}).get('median')) for p in names) + " |")
    return out


def cli(d: dict[str, Any]) -> list[str]:
    out = [f"CLI latency ({d['reps']} runs each; python -c pass: {fmt(d['python_startup_s']['median'])} s)", "",
           "| command | median [min..max] s | torch/ray/numpy/matplotlib imported | < 1 s |", "|---|---|---|---|"]
    for name, row in d["commands"].items():
        out.append(f"| `launch {name}` | {_spread(row['wall_s'])} | {', '.join(row['heavy_imported']) or 'none'} | "
                   f"{'yes' if row['meets_target'] else 'NO'} |")
    return out


def recorder(d: dict[str, Any]) -> list[str]:
    pc, sl = d["per_call_us"], d["step_loop"]
    out = [f"Recorder overhead on {d['device']} (us per call, net of an empty loop; target < {d['target_us_per_value']} us = 1% of 1 ms)", "",
           "| call | net us (median) | gross min..max us |", "|---|---|---|"]
    for k in ("log_tensor", "log_float", "step", "timer"):
        out.append(f"| `{k}` | {fmt(pc[k]['net_us'])} | {fmt(pc[k]['min'])}..{fmt(pc[k]['max'])} |")
    out.append(f"| `to_host` (once, per value) | {fmt(pc['to_host_per_value']['median'])} | |")
    out += ["", f"~1 ms steps (matmul n={sl['matmul_n']}): {_spread(sl['step_ms_plain'], 4)} ms plain vs "
            f"{_spread(sl['step_ms_recorded'], 4)} ms with log+step per step ({sl['overhead_pct_of_step']:+.2f}%, within noise).",
            f"Sync-debug check: {d['sync_debug']}"]
    return out


def throughput(d: dict[str, Any]) -> list[str]:
    out = [f"Throughput on {d.get('gpu') or 'cpu'} ({d['reps']} interleaved repetitions, {d['threads']} thread(s); median [min..max])", "",
           "| comparison | job | hand-written | job / hand (medians) | per-repetition ratio | fraction of peak |", "|---|---|---|---|---|---|"]
    for n, r in d["matmul"].items():
        peak = fmt(r["job_fraction_of_peak"], 3) if r.get("job_fraction_of_peak") else "n/a (CPU)"
        out.append(f"| matmul n={n} {d['config']['dtype']}, GFLOP/s | {_spread(r['job_gflops'], 1)} | {_spread(r['hand_gflops'], 1)} | "
                   f"{fmt(r['job_over_hand'], 3)} | {_spread(r['per_rep_ratios'], 3)} | {peak} |")
    for n, r in d.get("ddp", {}).items():
        out.append(f"| DDP {n} worker(s), samples/s | {_spread(r['job_samples_per_s'], 0)} | {_spread(r['hand_samples_per_s'], 0)} | "
                   f"{fmt(r['job_over_hand'], 3)} | {_spread(r['per_rep_ratios'], 3)} | |")
    if d.get("ddp_skipped"):
        out.append(f"| DDP | skipped: {d['ddp_skipped']} | | | | |")
    return out


def scaling(d: dict[str, Any]) -> list[str]:
    out = [f"Scaling of the matmul job on {d['device']} ({d['reps']} runs; median [min..max])", "",
           "| workers x threads | n | total GFLOP/s | GFLOP/s per rank | efficiency (job: total / (N x 1-worker)) | total / 1-worker total (same run) |",
           "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['workers']} x {r['threads_per_worker']} | {r['size']} | {_spread(r['gflops_total'], 1)} | "
                   f"{_spread(r['gflops_per_rank'], 1)} | {_spread(r['efficiency'], 3)} | {_spread(r.get('total_vs_1_worker') or {}, 3)} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=str(RESULTS))
    args = p.parse_args(argv)
    d = Path(args.dir)
    for name, render in (("startup", startup), ("startup-loaded", startup), ("cli_latency", cli), ("recorder_overhead", recorder),
                         ("throughput", throughput), ("throughput-ddp", throughput), ("scaling", scaling)):
        data = _load(d, name)
        if data is None:
            print(f"({name}: no results in {d})\n")
            continue
        print("\n".join(render(data)) + f"\n\n(mode: {data.get('mode')})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
