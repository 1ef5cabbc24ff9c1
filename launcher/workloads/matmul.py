"""d2l "GPUs", exercises 1 and 4: n x n matmuls on every rank's device, and scaling over ranks.

Each rank multiplies two random n x n matrices ``iters`` times per size on its own device, timed
as one block (CUDA events on the GPU after warm-up, a host clock on the CPU where the work is
synchronous). Nothing is read back inside the loop. The launcher turns the times into GFLOP/s
per rank, in total and as scaling efficiency: throughput(N) / (N x throughput(1)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

DEFAULTS = {"sizes": [256, 1024], "iters": 20, "warmup": 3, "dtype": "float32"}


def _param(params: Mapping[str, Any], name: str) -> Any:
    return params.get(name, DEFAULTS[name])


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, str(_param(ctx.params, "dtype")))
    iters, warmup = int(_param(ctx.params, "iters")), int(_param(ctx.params, "warmup"))
    rec = ctx.metrics
    for n in (int(s) for s in _param(ctx.params, "sizes")):
        a = torch.randn(n, n, device=ctx.device, dtype=dtype)  # made on the device: no host copy
        b = torch.randn(n, n, device=ctx.device, dtype=dtype)
        for _ in range(warmup):
            torch.matmul(a, b)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)  # outside the timed block: warm-up must not leak in
        dist.barrier()  # every rank times the same moment, so scaling measures contention honestly
        with rec.timer(f"matmul/{n}"):
            for _ in range(iters):
                c = torch.matmul(a, b)
                rec.step()
        rec.log(f"checksum/{n}", c.norm())  # stays on the device until the end
    return {"threads": ctx.threads}


def _gflops(n: int, iters: int, ms: float) -> float:
    return 2.0 * n**3 * iters / (ms / 1e3) / 1e9 if ms > 0 else 0.0


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """Per-rank and total GFLOP/s per world size and matrix size, and scaling efficiency."""
    iters = int(_param(params, "iters"))
    sizes = [int(s) for s in _param(params, "sizes")]
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
    return {
        "title": "matmul throughput and scaling",
        "columns": ["workers", "size", "gflops", "gflops_per_rank", "efficiency", "threads_per_worker"],
        "rows": rows,
        "scaling": rows,
        "conclusions": conclusions,
    }


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
    fig.tight_layout()
    path = run_dir / "scaling.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
