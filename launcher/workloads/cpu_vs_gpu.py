"""d2l "GPUs", exercise 1: the same matmuls on the CPU and on each rank's GPU, small to large.

For every size ``n`` the job times ``iters(n)`` multiplications of two ``n x n`` matrices:

* on the CPU, once per node, by local rank 0 with every core this process may use, while the
  node's other ranks wait (they would otherwise fight for the same cores and memory bus);
* on each rank's own GPU, all ranks at once (each has a device of its own), with CUDA events
  after a warm-up and nothing read back inside the loop.

``iters(n)`` aims at ``work_gflop`` of arithmetic per size, clamped to ``[min_iters, max_iters]``,
so small sizes repeat often enough to be timed. Without a GPU the GPU side is reported as not
measured, never estimated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import ValidationInfo, field_validator

from launcher.devices import usable_cpu_count

from launcher.workloads._common import (
    Count,
    DtypeName,
    NonNegative,
    Positive,
    Sizes,
    WorkloadParams,
    devices_label,
    host_barrier_group,
    med,
    ok_ranks,
    rnd,
    save_figure,
    torch_dtype,
)

class Params(WorkloadParams):
    sizes: Sizes = (16, 64, 256, 1024, 2048)
    work_gflop: Positive = 10.0  # arithmetic per size, which sets iters(n)
    min_iters: Count = 2
    max_iters: Count = 1000
    warmup: NonNegative = 2
    dtype: DtypeName = "float32"
    cpu_threads: Literal["all"] | Count = "all"  # for the CPU side; "all": every core this process may use

    @field_validator("max_iters")
    @classmethod
    def _at_least_min_iters(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_iters")
        if low is not None and value < low:
            raise ValueError(f"expected at least min_iters ({low})")
        return value


def iters_for(n: int, p: Params) -> int:
    want = int(p.work_gflop * 1e9 / (2.0 * n**3))
    return max(p.min_iters, min(p.max_iters, want))


def _cpu_threads(p: Params) -> int:
    return usable_cpu_count() if p.cpu_threads == "all" else p.cpu_threads


def _time_cpu(torch: Any, n: int, iters: int, warmup: int, dtype: Any) -> float:
    import time

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    return (time.perf_counter() - t0) * 1e3


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    p = Params.model_validate(ctx.params)
    dtype, sizes, warmup = torch_dtype(p.dtype), p.sizes, p.warmup
    rec = ctx.metrics
    out: dict[str, Any] = {"iters": {}, "cpu_measured": False, "gpu_measured": ctx.device.type == "cuda"}
    quiet = host_barrier_group(dist, ctx)  # waiting ranks must not spin on the cores being timed
    # CPU: one rank per node at a time, with all of the node's cores.
    if ctx.local_rank == 0:
        threads = _cpu_threads(p)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for n in sizes:
                iters = iters_for(n, p)
                rec.add_time_ms(f"cpu/{n}", _time_cpu(torch, n, iters, warmup, dtype))
                rec.step()
        finally:
            torch.set_num_threads(before)
        out.update(cpu_measured=True, cpu_threads=threads)
    dist.barrier(group=quiet)  # the GPUs start when the CPU is quiet again
    if ctx.device.type == "cuda":
        out["gpu_name"] = torch.cuda.get_device_name(ctx.device)
        for n in sizes:
            iters = iters_for(n, p)
            a = torch.randn(n, n, device=ctx.device, dtype=dtype)
            b = torch.randn(n, n, device=ctx.device, dtype=dtype)
            for _ in range(warmup):
                torch.matmul(a, b)
            torch.cuda.synchronize(ctx.device)
            with rec.timer(f"gpu/{n}"):  # CUDA events: read once, at the end of the run
                for _ in range(iters):
                    torch.matmul(a, b)
            rec.step()
    out["iters"] = {str(n): iters_for(n, p) for n in sizes}
    return out


def _gflops(n: int, iters: int, ms: float | None) -> float | None:
    return None if not ms else 2.0 * n**3 * iters / (ms / 1e3) / 1e9


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """Per size: time per matmul on the CPU and on the GPUs (median over ranks), and the speedup."""
    ranks = ok_ranks(stages)
    p = Params.model_validate(params)
    sizes = p.sizes
    cpu_ranks = [r for r in ranks if (r.get("result") or {}).get("cpu_measured")]
    gpu_ranks = [r for r in ranks if (r.get("result") or {}).get("gpu_measured")]
    rows = []
    for n in sizes:
        iters = iters_for(n, p)
        cpu_ms = med([t for r in cpu_ranks for t in r["metrics"]["times_ms"].get(f"cpu/{n}", [])])
        gpu_each = [med(r["metrics"]["times_ms"].get(f"gpu/{n}")) for r in gpu_ranks]
        gpu_ms = med(gpu_each)
        cpu_us = None if cpu_ms is None else cpu_ms * 1e3 / iters
        gpu_us = None if gpu_ms is None else gpu_ms * 1e3 / iters
        rows.append(
            {
                "size": n,
                "iters": iters,
                "cpu_us": rnd(cpu_us, 3),
                "cpu_gflops": rnd(_gflops(n, iters, cpu_ms), 3),
                "gpu_us": rnd(gpu_us, 3),
                "gpu_gflops": rnd(_gflops(n, iters, gpu_ms), 3),
                "gpu_us_by_rank": [rnd(None if g is None else g * 1e3 / iters, 3) for g in gpu_each] if gpu_ranks else None,
                "speedup": rnd(cpu_us / gpu_us if cpu_us and gpu_us else None, 3),
            }
        )
    gpu_measured = bool(gpu_ranks)
    cpu_threads = sorted({(r.get("result") or {}).get("cpu_threads") for r in cpu_ranks} - {None})
    return {
        "title": "n x n matmul: time per multiplication on the CPU and on the GPU",
        "columns": ["size", "iters", "cpu_us", "cpu_gflops", "gpu_us", "gpu_gflops", "speedup"],
        "rows": rows,
        "gpu_measured": gpu_measured,
        "gpus": sorted({f"{r['device']} ({(r.get('result') or {}).get('gpu_name')})" for r in gpu_ranks}),
        "cpu_threads": cpu_threads,
        "break_even_size": _break_even(rows) if gpu_measured else None,
        "conclusions": _conclusions(rows, gpu_measured, cpu_threads, ranks),
    }


def _break_even(rows: list[dict[str, Any]]) -> int | None:
    """The smallest size from which on the GPU is faster at every larger size too."""
    found = None
    for row in reversed(rows):
        if row["speedup"] is None or row["speedup"] <= 1.0:
            break
        found = row["size"]
    return found


def _conclusions(rows: list[dict[str, Any]], gpu: bool, threads: list[int], ranks: list[dict[str, Any]]) -> list[str]:
    measured = [r for r in rows if r["cpu_us"] is not None]
    if not measured:
        return ["no rank finished: nothing to compare"]
    small, large = measured[0], measured[-1]
    out = [
        f"CPU ({'/'.join(map(str, threads))} threads): {_dur(small['cpu_us'])} per {small['size']}x{small['size']} matmul "
        f"({small['cpu_gflops']:.3g} GFLOP/s), {_dur(large['cpu_us'])} at n={large['size']} ({large['cpu_gflops']:.4g} GFLOP/s)"
    ]
    if not gpu:
        devices = sorted({r["device"] for r in ranks})
        out.append(
            f"GPU side not measured: no GPU on this machine (ranks ran on {', '.join(devices)}); "
            "no speedup is reported rather than an estimate"
        )
        best = max(measured, key=lambda r: r["cpu_gflops"] or 0)
        if best is not small and best["cpu_gflops"]:
            out.append(
                f"small tasks waste even the CPU: n={small['size']} runs at {small['cpu_gflops'] / best['cpu_gflops']:.0%} "
                f"of the best GFLOP/s (n={best['size']}), the per-call overhead dominates"
            )
        return out
    big = max((r for r in rows if r["speedup"] is not None), key=lambda r: r["size"], default=None)
    if big is not None:
        out.append(f"at n={big['size']} the GPU is {big['speedup']:.1f}x faster than the CPU ({big['gpu_gflops']:.4g} GFLOP/s)")
    slow = [r for r in rows if r["speedup"] is not None and r["speedup"] <= 1.0]
    even = _break_even(rows)
    if slow:
        where = ", ".join(str(r["size"]) for r in slow)
        speedups = ", ".join(f"{r['speedup']:.2f}" for r in slow)
        out.append(
            f"the GPU stops paying off for small tasks: at n={where} it is no faster (speedup {speedups}): "
            "launching a kernel costs a few us, more than the arithmetic"
        )
    if even is not None:
        out.append(f"the GPU wins from n={even} upwards")
    return out


def _dur(us: float) -> str:
    return f"{us:.3g} us" if us < 1000 else f"{us / 1e3:.4g} ms"


def plot(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    summary = result.get("summary") or {}
    rows = [r for r in summary.get("rows") or [] if r.get("cpu_us") is not None or r.get("gpu_us") is not None]
    if not rows:
        return []
    gpu = summary.get("gpu_measured")
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = [r["size"] for r in rows]
    ax_t.plot(sizes, [r["cpu_us"] for r in rows], marker="o", label="CPU")
    if gpu:
        ax_t.plot(sizes, [r["gpu_us"] for r in rows], marker="s", label="GPU (median over ranks)")
    ax_t.set(xscale="log", yscale="log", xlabel="n (n x n matmul)", ylabel="us per matmul", title="time per multiplication")
    ax_t.legend()
    if gpu:
        ax_s.plot(sizes, [r["speedup"] for r in rows], marker="o", color="C2")
        ax_s.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax_s.set(xscale="log", yscale="log", xlabel="n", ylabel="CPU time / GPU time", title="GPU speedup (>1: GPU faster)")
    else:
        ax_s.plot(sizes, [r["cpu_gflops"] for r in rows], marker="o", label="CPU GFLOP/s")
        ax_s.set(xscale="log", xlabel="n", ylabel="GFLOP/s", title="CPU throughput (no GPU: speedup not measured)")
        ax_s.text(0.5, 0.5, "GPU side not measured\n(no GPU on this machine)", transform=ax_s.transAxes,
                  ha="center", va="center", fontsize=11, color="grey")
    for ax in (ax_t, ax_s):
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"{result['job']} on {devices_label(result)}")
    return [save_figure(fig, run_dir, "cpu_vs_gpu.png")]
