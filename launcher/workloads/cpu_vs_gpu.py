"""d2l "GPUs", exercise 1: the same matmuls on the CPU and on each rank's GPU, small to large.

For every size ``n`` the job times ``iters(n)`` multiplications of two ``n x n`` matrices:

* on the CPU, once per node, by local rank 0 with every core this process may use, while the
  node's other ranks wait (they would otherwise fight for the same cores and memory bus);
* on each rank's own GPU, all ranks at once (each has a device of its own), with CUDA events
  after a warm-up and nothing read back inside the loop.

``iters(n)`` aims at ``work_gflop`` of arithmetic per trial, clamped to ``[min_iters, max_iters]``,
so small sizes repeat often enough to be timed. Each size is measured like a benchmark: ``warmup``
untimed matmuls, then ``trials`` trials of ``iters(n)`` matmuls, each timed on its own (a host
clock around the synchronous CPU work; CUDA events on the GPU, with the ranks lined up before each
trial); the summary reports the median time per matmul with the min-max of the trials and flags
noisy figures. Without a GPU the GPU side is reported as not measured, never estimated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import ValidationInfo, field_validator

from launcher.hardware.devices import usable_cpu_count
from launcher.workloads.measure import host_barrier_group, machine_state, torch_dtype, trial_loop
from launcher.workloads.params import Count, DtypeName, NonNegative, Positive, Sizes, WorkloadParams
from launcher.workloads.plotting import devices_label, integer_ticks, legend_below, save_figure, values, yerr
from launcher.workloads.stats import Stat, flags_for, ok_ranks, rnd, span, stat, times, times_range


class Params(WorkloadParams):
    sizes: Sizes = (16, 64, 256, 1024, 2048)
    work_gflop: Positive = 2.0  # arithmetic per trial, which sets iters(n)
    min_iters: Count = 2
    max_iters: Count = 1000
    trials: Count = 5  # timed trials per size and side (median and min-max reported)
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


def _time_cpu(ctx: Any, torch: Any, n: int, iters: int, p: Params, dtype: Any) -> None:
    """Warm-up, then ``p.trials`` trials of ``iters`` matmuls on the CPU, each timed (host clock:
    the CPU's work is synchronous) into ``cpu/<n>``. This rank alone: the others wait, asleep."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(p.warmup):
        torch.matmul(a, b)
    for _ in trial_loop(torch.device("cpu"), p.trials, together=False):
        with _host_timer(ctx.metrics, f"cpu/{n}"):
            for _ in range(iters):
                torch.matmul(a, b)


def _host_timer(rec: Any, name: str) -> Any:
    """A host clock around a block, recorded with ``add_time_ms`` (also on a GPU rank, whose
    recorder would time with CUDA events: the CPU side is host work)."""
    import time
    from contextlib import contextmanager

    @contextmanager
    def timed() -> Any:
        t0 = time.perf_counter()
        yield
        rec.add_time_ms(name, (time.perf_counter() - t0) * 1e3)

    return timed()


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    p = Params.model_validate(ctx.params)
    dtype, sizes, warmup = torch_dtype(p.dtype), p.sizes, p.warmup
    rec = ctx.metrics
    out: dict[str, Any] = {"iters": {}, "cpu_measured": False, "gpu_measured": ctx.device.type == "cuda",
                           "machine_start": machine_state()}
    quiet = host_barrier_group(dist, ctx)  # waiting ranks must not spin on the cores being timed
    # CPU: one rank per node at a time, with all of the node's cores.
    if ctx.local_rank == 0:
        threads = _cpu_threads(p)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for n in sizes:
                _time_cpu(ctx, torch, n, iters_for(n, p), p, dtype)
                rec.step()
        finally:
            torch.set_num_threads(before)
        out.update(cpu_measured=True, cpu_threads=threads)
    dist.barrier(group=quiet)  # the GPUs start when the CPU is quiet again
    if ctx.device.type == "cuda":
        out["gpu_name"] = torch.cuda.get_device_name(ctx.device)
        # ranks that share a GPU (resources.ranks_per_gpu) take turns on it: each figure is the GPU's
        share = max(1, int(getattr(ctx, "ranks_per_gpu", 1) or 1))
        out["ranks_per_gpu"] = share
        for turn in range(share):
            if ctx.local_rank % share == turn:
                for n in sizes:
                    iters = iters_for(n, p)
                    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
                    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
                    for _ in range(warmup):
                        torch.matmul(a, b)
                    # every rank's trial starts together (host barrier after draining the device); in turns: this turn's ranks
                    for _ in trial_loop(ctx.device, p.trials, group=quiet, together=share == 1):
                        with rec.timer(f"gpu/{n}"):  # CUDA events: read once, at the end of the run
                            for _ in range(iters):
                                torch.matmul(a, b)
                    rec.step()
            if share > 1:
                dist.barrier(group=quiet)
    out["iters"] = {str(n): iters_for(n, p) for n in sizes}
    out["machine_end"] = machine_state()
    return out


def _gflops(n: int, us_per_matmul: float | None) -> float | None:
    return None if not us_per_matmul else 2.0 * n**3 / (us_per_matmul / 1e6) / 1e9


def _us(trials_ms: Any, iters: int) -> list[float]:
    """Trials of ``iters`` matmuls (ms per trial) -> us per matmul, one value per trial."""
    return [ms * 1e3 / iters for ms in trials_ms or [] if ms and ms > 0]


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """Per size: time per matmul on the CPU and on the GPUs (median of the trials, min-max), the
    speedup with its range, and flags for noisy figures."""
    ranks = ok_ranks(stages)
    p = Params.model_validate(params)
    sizes = p.sizes
    cpu_ranks = [r for r in ranks if (r.get("result") or {}).get("cpu_measured")]
    gpu_ranks = [r for r in ranks if (r.get("result") or {}).get("gpu_measured")]
    rows = []
    for n in sizes:
        iters = iters_for(n, p)
        cpu = stat(t for r in cpu_ranks for t in _us(r["metrics"]["times_ms"].get(f"cpu/{n}"), iters))
        gpu_each = [stat(_us(r["metrics"]["times_ms"].get(f"gpu/{n}"), iters)) for r in gpu_ranks]
        gpu_all = stat(t for r in gpu_ranks for t in _us(r["metrics"]["times_ms"].get(f"gpu/{n}"), iters))
        # the GPUs' figure: the median rank's median; its range: every trial of every rank
        medians = sorted(g.median for g in gpu_each if g is not None)
        gpu = None if gpu_all is None else Stat(medians[len(medians) // 2], gpu_all.min, gpu_all.max, gpu_all.q1, gpu_all.q3, gpu_all.n)
        speedup = cpu.median / gpu.median if cpu and gpu else None
        spread = max((x.spread or 0 for x in (cpu, gpu) if x is not None), default=None)
        flags, note = flags_for(spread, trials=min((x.n for x in (cpu, gpu) if x is not None), default=None))
        rows.append(
            {
                "size": n,
                "iters": iters,
                "trials": cpu.n if cpu else (gpu.n if gpu else 0),
                "cpu_us": rnd(cpu and cpu.median, 3),
                "cpu_us_min": rnd(cpu and cpu.min, 3),
                "cpu_us_max": rnd(cpu and cpu.max, 3),
                "cpu_us_range": span(cpu.min, cpu.max) if cpu else None,
                "cpu_gflops": rnd(_gflops(n, cpu and cpu.median), 3),
                "gpu_us": rnd(gpu and gpu.median, 3),
                "gpu_us_min": rnd(gpu and gpu.min, 3),
                "gpu_us_max": rnd(gpu and gpu.max, 3),
                "gpu_us_range": span(gpu.min, gpu.max) if gpu else None,
                "gpu_gflops": rnd(_gflops(n, gpu and gpu.median), 3),
                "gpu_us_by_rank": [rnd(g and g.median, 3) for g in gpu_each] if gpu_ranks else None,
                "speedup": rnd(speedup, 3),
                "speedup_min": rnd(cpu.min / gpu.max, 3) if cpu and gpu else None,
                "speedup_max": rnd(cpu.max / gpu.min, 3) if cpu and gpu else None,
                "spread": rnd(spread, 3),
                "flags": flags,
                "note": note,
            }
        )
    gpu_measured = bool(gpu_ranks)
    cpu_threads = sorted({int(t) for r in cpu_ranks if (t := (r.get("result") or {}).get("cpu_threads")) is not None})
    return {
        "title": "n x n matmul, CPU vs GPU: \u00b5s per multiplication (median of trials)",
        "columns": ["size", "iters", "cpu_us", "cpu_us_range", "cpu_gflops", "gpu_us", "gpu_us_range", "speedup", "note"],
        "rows": rows,
        "gpu_measured": gpu_measured,
        "gpus": sorted({f"{r['device']} ({(r.get('result') or {}).get('gpu_name')})" for r in gpu_ranks}),
        "cpu_threads": cpu_threads,
        "break_even_size": _break_even(rows) if gpu_measured else None,
        "conclusions": _conclusions(rows, gpu_measured, cpu_threads, ranks),
    }


def _break_even(rows: list[dict[str, Any]]) -> int | None:
    """The smallest size from which on the GPU is faster at every larger size too (in every trial:
    the slowest GPU trial beats the fastest CPU trial)."""
    found = None
    for row in reversed(rows):
        if row["speedup_min"] is None or row["speedup_min"] <= 1.0:
            break
        found = row["size"]
    return found


def _conclusions(rows: list[dict[str, Any]], gpu: bool, threads: list[int], ranks: list[dict[str, Any]]) -> list[str]:
    measured = [r for r in rows if r["cpu_us"] is not None]
    if not measured:
        return ["no rank finished: nothing to compare"]
    small, large = measured[0], measured[-1]
    out = [
        f"CPU ({'/'.join(map(str, threads))} threads, median of {small['trials']} trials): {_dur(small['cpu_us'])} per "
        f"{small['size']}x{small['size']} matmul ({small['cpu_gflops']:.3g} GFLOP/s), {_dur(large['cpu_us'])} at "
        f"n={large['size']} ({large['cpu_gflops']:.4g} GFLOP/s)"
    ]
    flagged = [f"n={r['size']} ({r['note']})" for r in rows if r["flags"]]
    if flagged:
        out.append(f"flagged, not conclusive: {', '.join(flagged)}; rerun on a quieter machine or with more trials")
    if not gpu:
        devices = sorted({r["device"] for r in ranks})
        out.append(
            f"GPU side not measured: no GPU on this machine (ranks ran on {', '.join(devices)}); "
            "no speedup is reported rather than an estimate"
        )
        best = max(measured, key=lambda r: r["cpu_gflops"] or 0)
        if best is not small and best["cpu_gflops"] and not small["flags"] and not best["flags"]:
            out.append(
                f"small tasks waste even the CPU: n={small['size']} runs at {small['cpu_gflops'] / best['cpu_gflops']:.0%} "
                f"of the best GFLOP/s (n={best['size']}), the per-call overhead dominates"
            )
        return out
    big = max((r for r in rows if r["speedup"] is not None and not r["flags"]), key=lambda r: r["size"], default=None)
    if big is not None:
        out.append(f"at n={big['size']} the GPU is {times(big['speedup'])} than the CPU (range "
                   f"{times_range(big['speedup_min'], big['speedup_max'])}; {big['gpu_gflops']:.4g} GFLOP/s)")
    slow = [r for r in rows if r["speedup"] is not None and r["speedup"] <= 1.0 and not r["flags"]]
    even = _break_even(rows)
    if slow:
        where = ", ".join(str(r["size"]) for r in slow)
        speedups = ", ".join(times(r["speedup"]) for r in slow)
        out.append(
            f"the GPU stops paying off for small tasks: at n={where} it is no faster ({speedups} than the CPU): "
            "launching a kernel costs a few us, more than the arithmetic"
        )
    if even is not None:
        out.append(f"the GPU wins from n={even} upwards")
    return out


def _dur(us: float) -> str:
    return f"{us:.3g} \u00b5s" if us < 1000 else f"{us / 1e3:.4g} ms"


def plot(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    summary = result.get("summary") or {}
    rows = [r for r in summary.get("rows") or [] if r.get("cpu_us") is not None or r.get("gpu_us") is not None]
    if not rows:
        return []
    gpu = summary.get("gpu_measured")
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 5))
    sizes = [r["size"] for r in rows]
    ax_t.errorbar(sizes, values(rows, "cpu_us"), yerr=yerr(rows, "cpu_us"), marker="o", capsize=3, label="CPU (median, min-max)")
    if gpu:
        ax_t.errorbar(sizes, values(rows, "gpu_us"), yerr=yerr(rows, "gpu_us"), marker="s", capsize=3,
                      label="GPU (median rank; min-max of all trials)")
    ax_t.set(xscale="log", yscale="log", xlabel="n (n x n matmul)", ylabel="\u00b5s per matmul", title="time per multiplication")
    if gpu:
        ax_s.errorbar(sizes, values(rows, "speedup"), yerr=yerr(rows, "speedup"), marker="o", capsize=3, color="C2",
                      label="CPU time / GPU time (range: fastest vs slowest trials)")
        ax_s.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="break-even (1x)")
        ax_s.set(xscale="log", yscale="log", xlabel="n", ylabel="CPU time / GPU time", title="GPU speedup (>1: GPU faster)")
    else:
        gflops_rows = [{"v": r["cpu_gflops"], "v_min": _gf(r["size"], r.get("cpu_us_max")), "v_max": _gf(r["size"], r.get("cpu_us_min"))}
                       for r in rows]
        ax_s.errorbar(sizes, values(gflops_rows, "v"), yerr=yerr(gflops_rows, "v"), marker="o", capsize=3,
                      label="CPU GFLOP/s (median, min-max)")
        ax_s.set(xscale="log", xlabel="n", ylabel="GFLOP/s", title="CPU throughput (no GPU: speedup not measured)")
        ax_s.set_ylim(bottom=0)
    bad = [r for r in rows if r.get("flags")]
    if bad:
        ax_t.scatter([r["size"] for r in bad], values(bad, "cpu_us"), s=160, facecolors="none", edgecolors="red",
                     linewidths=1.5, zorder=5, label="flagged (see note)")
    for ax in (ax_t, ax_s):
        ax.grid(alpha=0.3, which="both")
        integer_ticks(ax, sizes)  # the sizes measured, not powers of ten
        legend_below(ax, ncol=1)
    fig.suptitle(f"{result['job']} on {devices_label(result)}")
    notes = [f"n={r['size']}: {r['note']}" for r in rows if r.get("note")]
    if not gpu:
        notes.append("GPU side not measured: no GPU on this machine (no speedup is drawn rather than an estimate)")
    notes.append("error bars: min-max of the trials")
    return [save_figure(fig, run_dir, "cpu_vs_gpu.png", notes)]


def _gf(n: int, us: float | None) -> float | None:
    return _gflops(n, us)
