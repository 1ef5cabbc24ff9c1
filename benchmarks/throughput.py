"""Throughput of jobs run by ``launch`` against hand-written references on the same device.

1. matmul: the matmul job (``jobs/matmul_scaling.yaml``, one worker) against
   ``benchmarks/hand_matmul.py`` (a plain ``torch.matmul`` timing loop) with the same sizes,
   iterations, dtype and threads; GFLOP/s, the ratio job/hand, and on a GPU the fraction of its
   datasheet peak. Target: the job within 2% of the hand loop.
2. DDP: the ddp_train job (``jobs/ddp_train.yaml``) against ``benchmarks/ddp_baseline.py`` under
   bare ``torchrun`` (same model, data, batch and optimiser): samples/s at 1 and 2 workers.

Runs are interleaved (the order rotates every repetition); medians, spread and ratios.

    python benchmarks/throughput.py              # CPU here, 5 repetitions
    python benchmarks/throughput.py --full       # on a GPU machine: cuda, large matrices, 7 reps
    python benchmarks/throughput.py --smoke      # tiny, 1 repetition
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO, base_parser, bench_env, fmt, gpu_names, has_gpu, machine_info, ratio, rotate, run_timed, summary, tool,
    write_result,
)

def gpu_peak(name: str, dtype: str) -> float | None:
    """The datasheet's dense peak for ``dtype`` (the selftest's table: ``launcher.hardware``)."""
    from launcher.hardware import gpu_peaks

    peaks = gpu_peaks(name)
    if peaks is None:
        return None
    return {"float32": peaks.fp32_tflops, "tf32": peaks.tf32_tflops, "bfloat16": peaks.bf16_tflops, "float16": peaks.bf16_tflops}.get(dtype)


def config(args: Any, cuda: bool) -> dict[str, Any]:
    if args.smoke:
        return {"sizes": [256], "iters": 5, "dtype": "float32", "ddp_epochs": 1, "ddp_n_train": 2048, "ddp_workers": [1]}
    if cuda:
        return {"sizes": [4096, 8192], "iters": 50, "dtype": args.dtype or "float32", "ddp_epochs": 4, "ddp_n_train": 32768,
                "ddp_workers": [1]}
    return {"sizes": [512, 1024], "iters": 30, "dtype": args.dtype or "float32", "ddp_epochs": 3, "ddp_n_train": 8192,
            "ddp_workers": [1, 2]}


def _result_json(out_dir: Path) -> dict[str, Any]:
    found = sorted(out_dir.glob("*/*/result.json"))
    if not found:
        raise RuntimeError(f"no result.json under {out_dir}")
    return json.loads(found[-1].read_text())


def matmul_job(cfg: dict[str, Any], cuda: bool, work: Path) -> dict[str, float]:
    dev = ["--set", "resources.device=cuda", "--set", "resources.gpus_per_node=1"] if cuda else []
    argv = [tool("launch"), str(REPO / "jobs" / "matmul_scaling.yaml"), "--quiet", "--out", str(work / "runs"),
            "--set", "scaling.workers=[1]", "--set", f"params.sizes={cfg['sizes']}", "--set", f"params.iters={cfg['iters']}",
            "--set", f"params.dtype={cfg['dtype']}", *dev]
    done = run_timed(argv, env=bench_env(), cwd=work, timeout_s=900)
    if done.rc != 0:
        raise RuntimeError(f"launch matmul exit {done.rc}: {done.output[-1500:]}")
    rows = _result_json(work / "runs")["summary"]["rows"]
    return {str(r["size"]): r["gflops"] for r in rows if r["workers"] == 1}


def matmul_hand(cfg: dict[str, Any], cuda: bool, threads: int, work: Path) -> dict[str, float]:
    argv = [sys.executable, str(REPO / "benchmarks" / "hand_matmul.py"), "--sizes", *map(str, cfg["sizes"]),
            "--iters", str(cfg["iters"]), "--dtype", cfg["dtype"], "--device", "cuda" if cuda else "cpu", "--threads", str(threads)]
    done = run_timed(argv, env=bench_env({"OMP_NUM_THREADS": str(threads)}), cwd=work, timeout_s=900)
    if done.rc != 0:
        raise RuntimeError(f"hand_matmul exit {done.rc}: {done.output[-1500:]}")
    return json.loads(done.output.strip().splitlines()[-1])["gflops"]


def ddp_available() -> str | None:
    if not (REPO / "jobs" / "ddp_train.yaml").is_file():
        return "jobs/ddp_train.yaml does not exist yet"
    if importlib.util.find_spec("launcher.workloads.train") is None:
        return "launcher/workloads/train.py does not exist yet"
    return None


def ddp_job(cfg: dict[str, Any], workers: int, cuda: bool, work: Path) -> float:
    dev = ["--set", "resources.device=cuda", "--set", f"resources.gpus_per_node={workers}"] if cuda else []
    argv = [tool("launch"), str(REPO / "jobs" / "ddp_train.yaml"), "--quiet", "--out", str(work / "runs"),
            "--set", f"scaling.workers=[{workers}]", "--set", f"params.epochs={cfg['ddp_epochs']}",
            "--set", f"params.n_train={cfg['ddp_n_train']}", *dev]
    done = run_timed(argv, env=bench_env(), cwd=work, timeout_s=900)
    if done.rc != 0:
        raise RuntimeError(f"launch ddp_train exit {done.rc}: {done.output[-1500:]}")
    rows = _result_json(work / "runs")["summary"]["rows"]
    return next(r["total_sps"] for r in rows if r["workers"] == workers)


def ddp_hand(cfg: dict[str, Any], workers: int, cuda: bool, work: Path) -> float:
    argv = [tool("torchrun"), "--standalone", f"--nproc-per-node={workers}", str(REPO / "benchmarks" / "ddp_baseline.py"),
            "--epochs", str(cfg["ddp_epochs"]), "--n-train", str(cfg["ddp_n_train"])]
    threads = max(1, (os.cpu_count() or 1) // workers)  # what the launcher gives each worker
    env = bench_env({"BENCH_DEVICE": "cuda" if cuda else "cpu", "OMP_NUM_THREADS": str(threads)})
    done = run_timed(argv, env=env, cwd=work, timeout_s=900)
    line = next((ln for ln in done.output.splitlines() if "DDP_BASELINE " in ln), None)
    if done.rc != 0 or line is None:
        raise RuntimeError(f"ddp_baseline exit {done.rc}: {done.output[-1500:]}")
    return json.loads(line.split("DDP_BASELINE ", 1)[1])["total_sps"]


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda with --full on a GPU machine, else cpu")
    p.add_argument("--dtype", default=None, help="matmul dtype (default float32)")
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--no-matmul", action="store_true")
    args = p.parse_args(argv)
    cuda = (args.device or ("cuda" if args.full and has_gpu() else "cpu")) == "cuda"
    cfg = config(args, cuda)
    reps = args.reps or (1 if args.smoke else 7 if args.full else 5)
    threads = 1 if cuda else (os.cpu_count() or 1)  # a 1-worker stage gets every core
    runs: dict[str, Callable[[Path], Any]] = {} if args.no_matmul else {
        "matmul_job": lambda w: matmul_job(cfg, cuda, w),
        "matmul_hand": lambda w: matmul_hand(cfg, cuda, threads, w),
    }
    ddp_skip = "--no-ddp" if args.no_ddp else ddp_available()
    if not ddp_skip:
        for n in cfg["ddp_workers"]:
            runs[f"ddp_job_w{n}"] = lambda w, n=n: ddp_job(cfg, n, cuda, w)
            runs[f"ddp_hand_w{n}"] = lambda w, n=n: ddp_hand(cfg, n, cuda, w)
    raw: dict[str, list[Any]] = {k: [] for k in runs}
    errors: dict[str, str] = {}
    for k in range(reps):
        for name in rotate(list(runs), k):
            if name in errors:
                continue
            with tempfile.TemporaryDirectory(prefix="glb-tp-") as work:
                try:
                    raw[name].append(runs[name](Path(work)))
                except Exception as exc:  # noqa: BLE001
                    errors[name] = str(exc)[:2000]
                    print(f"error {name}: {errors[name]}", file=sys.stderr)
                    continue
            print(f"rep {k + 1}/{reps} {name:14s} {raw[name][-1]}", flush=True)

    gpu = gpu_names()[0] if cuda and gpu_names() else None
    matmul = {}
    for n in [] if args.no_matmul else map(str, cfg["sizes"]):
        job = summary([r.get(n) for r in raw["matmul_job"]])
        hand = summary([r.get(n) for r in raw["matmul_hand"]])
        peak = gpu_peak(gpu, cfg["dtype"]) if gpu else None
        matmul[n] = {
            "job_gflops": job, "hand_gflops": hand, "job_over_hand": ratio(job["median"], hand["median"]),
            "per_rep_ratios": summary([ratio(a.get(n), b.get(n)) for a, b in zip(raw["matmul_job"], raw["matmul_hand"])]),
            "gpu_peak_tflops": peak,
            "job_fraction_of_peak": ratio(job["median"], peak * 1e3) if peak and job["median"] else None,
            "hand_fraction_of_peak": ratio(hand["median"], peak * 1e3) if peak and hand["median"] else None,
        }
    ddp = {}
    if not ddp_skip:
        for n in cfg["ddp_workers"]:
            job, hand = summary(raw[f"ddp_job_w{n}"]), summary(raw[f"ddp_hand_w{n}"])
            ddp[str(n)] = {"job_samples_per_s": job, "hand_samples_per_s": hand, "job_over_hand": ratio(job["median"], hand["median"]),
                           "per_rep_ratios": summary([ratio(a, b) for a, b in zip(raw[f"ddp_job_w{n}"], raw[f"ddp_hand_w{n}"])])}

    print(f"\nthroughput on {gpu or 'cpu'} ({reps} repetitions; median [min..max])")
    for n, row in matmul.items():
        j, h = row["job_gflops"], row["hand_gflops"]
        peak = f", {row['job_fraction_of_peak']:.1%} of peak" if row["job_fraction_of_peak"] else ""
        print(f"  matmul n={n:5s} job {fmt(j['median'], 1)} [{fmt(j['min'], 1)}..{fmt(j['max'], 1)}] GFLOP/s, hand "
              f"{fmt(h['median'], 1)} [{fmt(h['min'], 1)}..{fmt(h['max'], 1)}]: job/hand {fmt(row['job_over_hand'], 3)}{peak}")
    for n, row in ddp.items():
        j, h = row["job_samples_per_s"], row["hand_samples_per_s"]
        print(f"  ddp {n} worker(s) job {fmt(j['median'], 0)} [{fmt(j['min'], 0)}..{fmt(j['max'], 0)}] samples/s, hand "
              f"{fmt(h['median'], 0)} [{fmt(h['min'], 0)}..{fmt(h['max'], 0)}]: job/hand {fmt(row['job_over_hand'], 3)}")
    if ddp_skip:
        print(f"  ddp skipped: {ddp_skip}")
    write_result("throughput", {
        "benchmark": "throughput", "mode": "smoke" if args.smoke else "full" if args.full else "default",
        "device": "cuda" if cuda else "cpu", "gpu": gpu, "config": cfg, "reps": reps, "threads": threads,
        "machine": machine_info(), "matmul": matmul, "ddp": ddp, "ddp_skipped": ddp_skip, "errors": errors, "raw": raw,
    }, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
