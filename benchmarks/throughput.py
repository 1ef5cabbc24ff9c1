"""Throughput of jobs run by ``launch`` against hand-written references on the same device.

1. matmul: the matmul job (``jobs/matmul_scaling.yaml``, one worker) against
   ``benchmarks/hand_matmul.py`` (a plain ``torch.matmul`` timing loop) with the same sizes,
   dtype and threads, and as many timed matmuls as the job's trials hold together (equal work, so
   equal duration on the device); GFLOP/s, the ratio job/hand, and on a GPU the fraction of its
   datasheet peak. Target: the job within 2% of the hand loop.
2. DDP: the ddp_train job (``jobs/ddp_train.yaml``) against ``benchmarks/ddp_baseline.py`` under
   bare ``torchrun`` (same model, data, batch and optimiser): samples/s at 1 and 2 workers (on a
   GPU: 1; ``--ranks-per-gpu 2 --ddp-workers 2``: two ranks sharing one GPU, gloo on both sides).

Runs are interleaved (the order rotates every repetition); medians, spread and ratios.

    python benchmarks/throughput.py              # CPU here, 5 repetitions
    python benchmarks/throughput.py --full       # on a GPU machine: cuda, bf16 n=4096 and 8192, 3 reps
    python benchmarks/throughput.py --smoke      # tiny, 1 repetition
    python benchmarks/throughput.py --device cuda --reps 2 --budget-s 120   # the GPU session's call (~1-2 min)

Each run is a child ``python -m launcher`` / ``python -m torch.distributed.run`` of this Python
(no console script needed: on a GPU machine the tree may only be on PYTHONPATH). ``--budget-s``
starts no repetition once that many seconds have passed, so the script always ends with its JSON.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO, base_parser, bench_env, fmt, gpu_names, has_gpu, machine_info, ratio, rotate, run_timed, summary, write_result,
)

LAUNCH = [sys.executable, "-m", "launcher"]  # `launch`, from this Python (the tree on PYTHONPATH is enough)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # `torchrun`, from this Python

def gpu_peak(name: str, dtype: str) -> float | None:
    """The datasheet's dense peak for ``dtype`` (the selftest's table: ``launcher.hardware.limits``)."""
    from launcher.hardware.limits import gpu_peaks

    peaks = gpu_peaks(name)
    if peaks is None:
        return None
    return {"float32": peaks.fp32_tflops, "tf32": peaks.tf32_tflops, "bfloat16": peaks.bf16_tflops, "float16": peaks.bf16_tflops}.get(dtype)


def config(args: Any, cuda: bool) -> dict[str, Any]:
    if args.smoke:
        cfg = {"sizes": [256], "iters": 5, "trials": 2, "dtype": "float32", "ddp_epochs": 1, "ddp_n_train": 2048, "ddp_workers": [1]}
    elif cuda:
        # sized for a short GPU lease: bf16 (where the card's peak is), a trial of 100 products at
        # n=8192 is ~0.15 s on an H100; each run is dominated by its own start (~5-10 s), so a
        # repetition of all four runs takes ~30-40 s (it took >170 s for 3 reps at fp32, 7 trials x 50)
        cfg = {"sizes": [4096, 8192], "iters": 100, "trials": 5, "dtype": "bfloat16", "ddp_epochs": 3, "ddp_n_train": 16384,
               "ddp_workers": [1]}
    else:
        cfg = {"sizes": [512, 1024], "iters": 30, "trials": 5, "dtype": "float32", "ddp_epochs": 3, "ddp_n_train": 8192,
               "ddp_workers": [1, 2]}
    for key in ("sizes", "iters", "trials", "dtype", "ddp_epochs", "ddp_n_train", "ddp_workers"):
        if getattr(args, key, None) is not None:
            cfg[key] = getattr(args, key)
    cfg["ranks_per_gpu"] = args.ranks_per_gpu if cuda else 1
    return cfg


def _result_json(out_dir: Path) -> dict[str, Any]:
    found = sorted(out_dir.glob("*/*/result.json"))
    if not found:
        raise RuntimeError(f"no result.json under {out_dir}")
    return json.loads(found[-1].read_text())


def matmul_job(cfg: dict[str, Any], cuda: bool, work: Path) -> dict[str, float]:
    dev = ["--set", "resources.device=cuda", "--set", "resources.gpus_per_node=1"] if cuda else []
    argv = [*LAUNCH, str(REPO / "jobs" / "matmul_scaling.yaml"), "--quiet", "--no-metrics", "--out", str(work / "runs"),
            "--set", "scaling.workers=[1]", "--set", f"params.sizes={cfg['sizes']}", "--set", f"params.iters={cfg['iters']}",
            "--set", f"params.trials={cfg['trials']}", "--set", f"params.dtype={cfg['dtype']}",
            "--set", f"params.threads_per_rank={cfg['threads']}", *dev]
    done = run_timed(argv, env=bench_env(), cwd=work, timeout_s=900)
    if done.rc != 0:
        raise RuntimeError(f"launch matmul exit {done.rc}: {done.output[-1500:]}")
    rows = _result_json(work / "runs")["summary"]["rows"]
    return {str(r["size"]): r["gflops"] for r in rows if r["workers"] == 1}


def matmul_hand(cfg: dict[str, Any], cuda: bool, threads: int, work: Path) -> dict[str, float]:
    # the job times `trials` blocks of `iters` products: the hand loop times as many in one block
    argv = [sys.executable, str(REPO / "benchmarks" / "hand_matmul.py"), "--sizes", *map(str, cfg["sizes"]),
            "--iters", str(cfg["iters"] * cfg["trials"]), "--dtype", cfg["dtype"], "--device", "cuda" if cuda else "cpu", "--threads", str(threads)]
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
    share = cfg["ranks_per_gpu"]
    dev = ["--set", "resources.device=cuda", "--set", f"resources.gpus_per_node={-(-workers // share)}"] if cuda else []
    if cuda and share > 1:
        dev += ["--set", f"resources.ranks_per_gpu={share}"]
    argv = [*LAUNCH, str(REPO / "jobs" / "ddp_train.yaml"), "--quiet", "--no-metrics", "--out", str(work / "runs"),
            "--set", f"scaling.workers=[{workers}]", "--set", f"params.epochs={cfg['ddp_epochs']}",
            "--set", f"params.n_train={cfg['ddp_n_train']}", "--set", f"params.threads_per_rank={cfg['threads']}", *dev]
    done = run_timed(argv, env=bench_env(), cwd=work, timeout_s=900)
    if done.rc != 0:
        raise RuntimeError(f"launch ddp_train exit {done.rc}: {done.output[-1500:]}")
    rows = _result_json(work / "runs")["summary"]["rows"]
    return next(r["total_sps"] for r in rows if r["workers"] == workers)


def ddp_hand(cfg: dict[str, Any], workers: int, cuda: bool, work: Path) -> float:
    argv = [*TORCHRUN, "--standalone", f"--nproc-per-node={workers}", str(REPO / "benchmarks" / "ddp_baseline.py"),
            "--epochs", str(cfg["ddp_epochs"]), "--n-train", str(cfg["ddp_n_train"])]
    env = bench_env({"BENCH_DEVICE": "cuda" if cuda else "cpu", "OMP_NUM_THREADS": str(cfg["threads"]),
                     "BENCH_RANKS_PER_GPU": str(cfg["ranks_per_gpu"])})
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
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="matmul n (default: by device)")
    p.add_argument("--iters", type=int, default=None, help="matmuls per timed trial of the job")
    p.add_argument("--trials", type=int, default=None, help="the job's timed trials per size (the hand loop times iters x trials at once)")
    p.add_argument("--ddp-epochs", type=int, default=None)
    p.add_argument("--ddp-n-train", type=int, default=None)
    p.add_argument("--ddp-workers", type=int, nargs="+", default=None, help="DDP world sizes (default: 1 on a GPU, 1 2 on the CPU)")
    p.add_argument("--ranks-per-gpu", type=int, default=1,
                   help="on a GPU: DDP ranks sharing each GPU (the job's resources.ranks_per_gpu; gloo on both sides above 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank, the job's and the hand-written code's alike (default 1)")
    p.add_argument("--budget-s", type=float, default=None, help="start no repetition after this many seconds (the JSON is always written)")
    args = p.parse_args(argv)
    cuda = (args.device or ("cuda" if args.full and has_gpu() else "cpu")) == "cuda"
    cfg = config(args, cuda)
    reps = args.reps or (1 if args.smoke else 3 if cuda else 7 if args.full else 5)
    t0 = time.monotonic()
    # the same torch threads on both sides: the job's params.threads_per_rank is set to it (the hand
    # loop used every core against the job's 1 and read 20-30x slower on a loaded 2-core machine)
    threads = cfg["threads"] = args.threads
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
    done_reps = 0
    for k in range(reps):
        if args.budget_s is not None and k > 0 and time.monotonic() - t0 > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent after {k} repetition(s): stopping", flush=True)
            break
        done_reps = k + 1
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

    print(f"\nthroughput on {gpu or 'cpu'} ({done_reps} repetitions; median [min..max]; {time.monotonic() - t0:.0f} s)")
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
        "device": "cuda" if cuda else "cpu", "gpu": gpu, "config": cfg, "reps": done_reps, "reps_asked": reps, "threads": threads,
        "wall_s": round(time.monotonic() - t0, 1),
        "machine": machine_info(), "matmul": matmul, "ddp": ddp, "ddp_skipped": ddp_skip, "errors": errors, "raw": raw,
    }, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
