"""d2l "GPUs", exercise 4: n x n matmuls on every rank's device, scaling over ranks, concurrency.

Each rank multiplies two random n x n matrices ``iters`` times per size on its own device, timed
as one block (CUDA events on the GPU after warm-up, a host clock on the CPU where the work is
synchronous). Nothing is read back inside the loop. The launcher turns the times into GFLOP/s
per rank, in total and as scaling efficiency: throughput(N) / (N x throughput(1)).

With two or more ranks the job also runs d2l's exercise 4 proper: the same two matmul tasks
(``concurrent_iters`` multiplications of ``concurrent_size`` matrices each) one after the other on
rank 0's device, then at the same time on rank 0's and rank 1's devices. The ratio of the wall
times is the speedup from the second device ("almost linear": close to 2 on two GPUs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from launcher.workloads._common import Count, DtypeName, NonNegative, Sizes, WorkloadParams, save_figure, torch_dtype, wall_clock


class Params(WorkloadParams):
    sizes: Sizes = (256, 1024)  # matrix sizes n, each timed as n x n @ n x n
    iters: Count = 20  # timed multiplications per size
    warmup: NonNegative = 3
    dtype: DtypeName = "float32"
    concurrent_size: Count | None = None  # the concurrency tasks' n; default: the largest size
    concurrent_iters: Count | None = None  # their multiplications; default: iters


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    p = Params.model_validate(ctx.params)
    dtype = torch_dtype(p.dtype)
    rec = ctx.metrics
    for n in p.sizes:
        a = torch.randn(n, n, device=ctx.device, dtype=dtype)  # made on the device: no host copy
        b = torch.randn(n, n, device=ctx.device, dtype=dtype)
        for _ in range(p.warmup):
            torch.matmul(a, b)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)  # outside the timed block: warm-up must not leak in
        dist.barrier()  # every rank times the same moment, so scaling measures contention honestly
        with rec.timer(f"matmul/{n}"):
            for _ in range(p.iters):
                c = torch.matmul(a, b)
                rec.step()
        rec.log(f"checksum/{n}", c.norm())  # stays on the device until the end
    if ctx.world_size >= 2:
        _concurrent_vs_sequential(ctx, p, torch, dist, dtype)
    return {"threads": ctx.threads}


def concurrency_params(p: Params) -> tuple[int, int]:
    """The tasks' matrix size and iterations: by default the largest size and ``iters``."""
    return p.concurrent_size or max(p.sizes), p.concurrent_iters or p.iters


def _concurrent_vs_sequential(ctx: Any, p: Params, torch: Any, dist: Any, dtype: Any) -> None:
    """Two tasks on one device one after the other (rank 0), then on two devices at once (ranks 0, 1)."""
    n, iters = concurrency_params(p)
    tasks = []
    for seed in (1, 2):  # the same two tasks wherever they run
        gen = torch.Generator().manual_seed(seed)
        tasks.append(tuple(torch.randn(n, n, generator=gen, dtype=dtype).to(ctx.device) for _ in range(2)))

    def work(a: Any, b: Any) -> None:
        for _ in range(iters):
            torch.matmul(a, b)

    for a, b in tasks:  # warm-up, outside the clocks
        torch.matmul(a, b)
    dist.barrier()
    if ctx.rank == 0:
        with wall_clock(ctx.device) as ms:
            for a, b in tasks:
                work(a, b)
        ctx.metrics.add_time_ms("concurrent/sequential", ms())
    dist.barrier()  # both ranks start their task together
    if ctx.rank in (0, 1):
        with wall_clock(ctx.device) as ms:
            work(*tasks[ctx.rank])
        ctx.metrics.add_time_ms("concurrent/parallel", ms())
    dist.barrier()


def _gflops(n: int, iters: int, ms: float) -> float:
    return 2.0 * n**3 * iters / (ms / 1e3) / 1e9 if ms > 0 else 0.0


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """Per-rank and total GFLOP/s per world size and matrix size, and scaling efficiency."""
    p = Params.model_validate(params)
    iters, sizes = p.iters, p.sizes
    per_stage: dict[int, dict[int, list[float]]] = {}
    device, threads = "?", {}
    for stage in stages:
        if stage["status"] != "succeeded":
            continue
        for rank in stage["ranks"]:
            times = rank.get("metrics", {}).get("times_ms", {})
            device = rank.get("device", device)
            threads[stage["world_size"]] = (rank.get("result") or {}).get("threads")
            for n in sizes:
                for ms in times.get(f"matmul/{n}", []):
                    per_stage.setdefault(stage["world_size"], {}).setdefault(n, []).append(_gflops(n, iters, ms))
    rows = []
    base_ws = min(per_stage, default=None)
    for ws in sorted(per_stage):
        for n in sizes:
            ranks = per_stage[ws].get(n, [])
            if not ranks:
                continue
            total = sum(ranks)
            base = per_stage[base_ws].get(n, []) if base_ws is not None else []
            base_per_worker = sum(base) / base_ws if base else 0.0
            efficiency = total / (ws * base_per_worker) if base_per_worker else None
            rows.append(
                {
                    "workers": ws,
                    "size": n,
                    "gflops": round(total, 3),
                    "gflops_per_rank": round(total / len(ranks), 3),
                    "efficiency": None if efficiency is None else round(efficiency, 4),
                    "threads_per_worker": threads.get(ws),
                }
            )
    conclusions = []
    largest = max(sizes) if sizes else None
    top = [r for r in rows if r["size"] == largest and r["workers"] != base_ws and r["efficiency"] is not None]
    for row in top:
        conclusions.append(
            f"{row['workers']} workers reach {row['efficiency']:.0%} scaling efficiency at n={largest} "
            f"({row['gflops']:.1f} GFLOP/s in total vs {row['workers']} x one worker)"
        )
    if device == "cpu" and rows:
        conclusions.append(
            "CPU run: each worker gets its share of the cores (threads_per_worker), so N workers "
            "compete for the same cores as one; GPU runs give every rank a device of its own."
        )
    concurrency = _concurrency_rows(stages, p)
    for row in concurrency:
        conclusions.append(
            f"two tasks of {row['iters']} matmuls (n={row['size']}): {row['sequential_ms']:.1f} ms one after the other on "
            f"{row['devices'][0]}, {row['concurrent_ms']:.1f} ms at once on {' + '.join(row['devices'])}: "
            f"{row['speedup']:.2f}x speedup (2x would be linear)"
        )
        if "cpu" in row["devices"]:
            conclusions.append(
                f"CPU run: the two 'devices' are two worker processes with {row['threads_per_worker']} thread(s) each "
                "sharing this machine's cores, and the sequential run uses one worker's threads: the speedup measures "
                "cores, not GPUs"
            )
    return {
        "title": "matmul throughput and scaling",
        "concurrency": concurrency,
        "columns": ["workers", "size", "gflops", "gflops_per_rank", "efficiency", "threads_per_worker"],
        "rows": rows,
        "scaling": rows,
        "conclusions": conclusions,
    }


def _concurrency_rows(stages: list[dict[str, Any]], p: Params) -> list[dict[str, Any]]:
    n, iters = concurrency_params(p)
    rows = []
    for stage in stages:
        by_rank = {r["rank"]: r for r in stage["ranks"] if r.get("status") == "ok"}
        if stage["status"] != "succeeded" or 0 not in by_rank or 1 not in by_rank:
            continue
        times = {k: by_rank[k].get("metrics", {}).get("times_ms", {}) for k in (0, 1)}
        seq = times[0].get("concurrent/sequential")
        par = [t for k in (0, 1) for t in times[k].get("concurrent/parallel", [])]
        if not seq or len(par) < 2:
            continue
        concurrent = max(par)  # both started together: the pair is done when the slower one is
        rows.append(
            {
                "workers": stage["world_size"],
                "size": n,
                "iters": iters,
                "sequential_ms": round(seq[0], 3),
                "concurrent_ms": round(concurrent, 3),
                "speedup": round(seq[0] / concurrent, 4) if concurrent > 0 else None,
                "devices": [by_rank[0]["device"], by_rank[1]["device"]],
                "hosts": [by_rank[0]["host"], by_rank[1]["host"]],
                "threads_per_worker": (by_rank[0].get("result") or {}).get("threads"),
            }
        )
    return rows


def plot(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    rows = result.get("scaling") or []
    if not rows:
        return []
    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(10, 4))
    for n in sorted({r["size"] for r in rows}):
        mine = [r for r in rows if r["size"] == n]
        ax_tp.plot([r["workers"] for r in mine], [r["gflops"] for r in mine], marker="o", label=f"n={n}")
        ax_eff.plot([r["workers"] for r in mine], [r["efficiency"] or 0 for r in mine], marker="o", label=f"n={n}")
    ax_tp.set(xlabel="workers", ylabel="total GFLOP/s", title="throughput")
    ax_eff.set(xlabel="workers", ylabel="efficiency", title="scaling efficiency", ylim=(0, 1.2))
    ax_eff.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    for ax in (ax_tp, ax_eff):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['job']} on {result['ranks'][0]['device'] if result['ranks'] else '?'}")
    return [save_figure(fig, run_dir, "scaling.png"), *_plot_concurrency(result, run_dir)]


def _plot_concurrency(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    rows = (result.get("summary") or {}).get("concurrency") or []
    if not rows:
        return []
    row = rows[0]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    labels = [
        f"sequential\n(both on rank 0: {row['devices'][0]})",
        f"concurrent\n(rank 0: {row['devices'][0]} + rank 1: {row['devices'][1]})",
    ]
    bars = ax.bar(labels, [row["sequential_ms"], row["concurrent_ms"]], color=["C1", "C2"])
    for bar in bars:
        ax.annotate(f"{bar.get_height():.1f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.axhline(row["sequential_ms"] / 2, color="grey", linestyle="--", linewidth=1, label="linear (half the time)")
    ax.set(ylabel="wall time (ms)", title=f"two tasks of {row['iters']} matmuls, n={row['size']}: {row['speedup']:.2f}x")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    fig.suptitle(f"{result['job']}: concurrent vs sequential")
    return [save_figure(fig, run_dir, "concurrency.png")]
