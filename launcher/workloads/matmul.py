"""d2l "GPUs", exercise 4: n x n matmuls on every rank's device, scaling over ranks, concurrency.

Measured like a benchmark: per size, ``warmup`` untimed matmuls, then ``trials`` trials (more
while a size has run for less than ``min_time_s``), each trial a block of ``iters`` matmuls timed
on its own (CUDA events on a GPU, read once at the end; a host clock on the CPU, where the work is
synchronous). Before each trial the ranks line up (a host barrier), so that at world size N the N
ranks contend for the machine at the same moment, trial after trial. Nothing is read back inside
the loops.

The comparison between world sizes is like for like: on the CPU every rank runs
``threads_per_rank`` torch threads (default 1) at every world size, instead of the launcher's
share of the cores (2 threads for one worker on 2 cores, 1 each for two), which would compare one
2-thread worker with two 1-thread workers. The summary says what each stage ran with.

The summary reports, per world size and size, the total GFLOP/s of each trial (all ranks' work
over the slowest rank's time: they started together), its median and min-max, the per-rank
GFLOP/s, and the scaling efficiency throughput(N) / (N x throughput(1)) with its range. A figure
whose trials spread widely is flagged "noisy", an efficiency above 1.05 "super-linear"; neither is
stated as a result in the conclusions.

With two or more ranks the job also runs d2l's exercise 4 proper: the same two matmul tasks
(``concurrent_iters`` multiplications of ``concurrent_size`` matrices each) one after the other on
rank 0's device, then at the same time on rank 0's and rank 1's devices, ``trials`` times each.
The ratio of the median times is the speedup from the second device ("almost linear": close to 2
on two GPUs).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from pydantic import Field

from launcher.fieldtypes import Real
from launcher.workloads.fairness import busy_stages, load_words, threads_words
from launcher.hardware.nvml import GpuClocks
from launcher.workloads.measure import clocks_dict, gpu_sampler, host_barrier_group, machine_state, set_threads, sync, torch_dtype, trial_loop
from launcher.workloads.params import Count, DtypeName, NonNegative, Sizes, ThreadsPerRank, WorkloadParams
from launcher.workloads.plotting import integer_ticks, legend_below, save_figure, values, yerr
from launcher.workloads.stats import NOISY_SPREAD, SUPERLINEAR, Stat, doubts_in_words, flags_for, pct, rnd, span, stat, stat_fields, times, times_range


class Params(WorkloadParams):
    sizes: Sizes = (256, 1024)  # matrix sizes n, each timed as n x n @ n x n
    iters: Count = 10  # multiplications per trial (one timed block)
    trials: Count = 5  # timed trials per size (median and min-max reported)
    min_time_s: Real = Field(default=0.0, ge=0)  # more trials (up to 100) while a size has run for less
    warmup: NonNegative = 3  # untimed multiplications per size, before the trials
    dtype: DtypeName = "float32"
    threads_per_rank: ThreadsPerRank = None  # null: 1 on the CPU at every world size; "share": the launcher's share
    concurrent_size: Count | None = None  # the concurrency tasks' n; default: the largest size
    concurrent_iters: Count | None = None  # their multiplications; default: iters


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    p = Params.model_validate(ctx.params)
    out: dict[str, Any] = {**set_threads(ctx, p.threads_per_rank), "machine_start": machine_state(),
                           "ranks_per_gpu": getattr(ctx, "ranks_per_gpu", 1), "clocks": {}}
    dtype = torch_dtype(p.dtype)
    rec = ctx.metrics
    host = host_barrier_group(dist, ctx)  # waiting ranks sleep in gloo instead of spinning
    done = _resume_sizes(ctx, rec)  # after a restart: the sizes measured before it, their figures restored
    for n in p.sizes:
        if n in done:
            continue
        if ctx.should_stop:  # a stop notice: what is measured is saved (every rank asks, once per size)
            out["stopped_before"] = n
            break
        a = torch.randn(n, n, device=ctx.device, dtype=dtype)  # made on the device: no host copy
        b = torch.randn(n, n, device=ctx.device, dtype=dtype)
        c = a
        for _ in range(p.warmup):
            torch.matmul(a, b)
        # each trial starts on every rank at once (the loop's barrier), on an idle device; NVML
        # samples the GPU's clocks, power and clock-event reasons over the trials
        sampler = gpu_sampler(ctx.device)
        with sampler:
            for _ in trial_loop(ctx.device, p.trials, p.min_time_s, group=host):
                with rec.timer(f"matmul/{n}"):
                    for _ in range(p.iters):
                        c = torch.matmul(a, b)
                        rec.step()
        if (clocks := clocks_dict(sampler)) is not None:
            out["clocks"][str(n)] = clocks
        rec.log(f"checksum/{n}", c.norm())  # stays on the device until the end
        done.append(n)
        _save_sizes(ctx, rec, done)
    if "stopped_before" in out:
        return out
    if ctx.world_size >= 2:
        _concurrent_vs_sequential(ctx, p, torch, dist, dtype, host)
    out["machine_end"] = machine_state()
    return out


def _save_sizes(ctx: Any, rec: Any, done: list[int]) -> None:
    """A checkpoint once a size is measured: the sizes done and every rank's figures so far (a
    rank's own, gathered to rank 0, which saves them). Copying the figures to the host here, once
    per size and not per step, is the price of surviving a restart."""
    import torch.distributed as dist

    mine = rec.to_host()
    every = [mine]
    if ctx.world_size > 1:
        every = [None] * ctx.world_size
        dist.all_gather_object(every, mine)
    ctx.checkpoint.save({"sizes_done": list(done), "ranks": every}, step=len(done))


def _resume_sizes(ctx: Any, rec: Any) -> list[int]:
    """The sizes a restarted stage measured before (none on a fresh start); this rank's figures
    for them go back into its recorder, as if measured in this attempt."""
    restored = ctx.checkpoint.load()
    if restored is None:
        return []
    figures = restored.state["ranks"][ctx.rank]
    for name, trials_ms in figures["times_ms"].items():
        for ms in trials_ms:
            rec.add_time_ms(name, ms)
    for name, logged in figures["values"].items():
        for value in logged:
            rec.log(name, value)
    return [int(n) for n in restored.state["sizes_done"]]


def concurrency_params(p: Params) -> tuple[int, int]:
    """The tasks' matrix size and iterations: by default the largest size and ``iters``."""
    return p.concurrent_size or max(p.sizes), p.concurrent_iters or p.iters


def _concurrent_vs_sequential(ctx: Any, p: Params, torch: Any, dist: Any, dtype: Any, host: Any) -> None:
    """Two tasks on one device one after the other (rank 0), then on two devices at once (ranks 0, 1),
    ``trials`` times each, alternating so that both see the same machine."""
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
    for _ in trial_loop(ctx.device, p.trials, group=host):
        if ctx.rank == 0:
            with ctx.metrics.timer("concurrent/sequential"):
                for a, b in tasks:
                    work(a, b)
        sync(ctx.device)  # the sequential pair is done on the device too
        dist.barrier(group=host)  # both ranks start their task together
        if ctx.rank in (0, 1):
            with ctx.metrics.timer("concurrent/parallel"):
                work(*tasks[ctx.rank])


def _gflops(n: int, iters: int, ms: float) -> float:
    return 2.0 * n**3 * iters / (ms / 1e3) / 1e9


def _stage_trials(stage: Mapping[str, Any], n: int, iters: int) -> tuple[Stat | None, list[Stat]]:
    """Total GFLOP/s per trial (every rank's work over the slowest rank's time; the ranks started each
    trial together) and each rank's own GFLOP/s over its trials."""
    ranks = sorted((r for r in stage["ranks"] if r.get("status") == "ok"), key=lambda r: r["rank"])
    times = [r.get("metrics", {}).get("times_ms", {}).get(f"matmul/{n}") or [] for r in ranks]
    if not times or not all(times):
        return None, []
    per_rank = [stat(_gflops(n, iters, ms) for ms in t if ms > 0) for t in times]
    trials = min(len(t) for t in times)
    totals = [len(ranks) * _gflops(n, iters, max(t[i] for t in times)) for i in range(trials) if max(t[i] for t in times) > 0]
    return stat(totals), [s for s in per_rank if s is not None]


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """Per world size and matrix size: total and per-rank GFLOP/s (median and min-max of the trials),
    scaling efficiency with its range, flags, and conclusions that claim nothing flagged."""
    p = Params.model_validate(params)
    done = [s for s in stages if s["status"] == "succeeded" and any(r.get("status") == "ok" for r in s["ranks"])]
    device, cores = "?", None
    threads: dict[int, int | None] = {}
    policy: set[str] = set()
    totals: dict[tuple[int, int], tuple[Stat | None, list[Stat]]] = {}
    for stage in done:
        ws = stage["world_size"]
        for rank in stage["ranks"]:
            res = rank.get("result") or {}
            device = str(rank.get("device", device)).split(":")[0]
            threads.setdefault(ws, res.get("threads"))
            if res.get("threads_policy"):
                policy.add(res["threads_policy"])
            cores = cores or (res.get("machine_start") or {}).get("cores")
        for n in p.sizes:
            totals[(ws, n)] = _stage_trials(stage, n, p.iters)
    base_ws = min((s["world_size"] for s in done), default=None)
    stage_of = {s["world_size"]: s for s in done}
    busy = busy_stages(done)
    rows = []
    for ws in sorted({s["world_size"] for s in done}):
        for n in p.sizes:
            total, per_rank = totals.get((ws, n), (None, []))
            if total is None:
                continue
            base = totals[(base_ws, n)][0] if base_ws is not None else None
            row = _row(ws, n, total, per_rank, base, base_ws, threads.get(ws), busy.get(ws))
            rows.append({**row, **_run_facts(stage_of[ws], n)})
    fair_words, fair = threads_words(threads, policy, cores, device)
    load, was_busy = load_words(done)
    concurrency = _concurrency_rows(stages, p)
    return {
        "title": "matmul throughput and scaling (median of trials)",
        "concurrency": concurrency,
        "columns": ["workers", "size", "gflops", "gflops_range", "efficiency", "note"],  # per rank and threads: in the rows
        "rows": rows,
        "scaling": rows,
        "like_for_like": fair,
        "threads_per_rank": {str(ws): t for ws, t in sorted(threads.items())},
        "method": (f"per size: {p.warmup} warm-up matmul(s), then at least {p.trials} trials of {p.iters} matmuls, each "
                   f"timed ({'CUDA events' if device == 'cuda' else 'host clock, synchronous CPU work'}), the ranks "
                   f"lined up before each; median and min-max of the trials; noisy: spread (interquartile range / "
                   f"median) > {NOISY_SPREAD:.0%}, "
                   f"super-linear: efficiency > {SUPERLINEAR:.2f}; busy: other load than the job's own ranks above "
                   "half the cores (1-minute load average)"),
        "conclusions": _conclusions(rows, p, base_ws, device, fair_words, fair, load, was_busy, concurrency),
    }


def _run_facts(stage: Mapping[str, Any], n: int) -> dict[str, Any]:
    """How long a size's trials ran (the slowest rank's sum: what a comparison at equal duration
    needs), whether ranks shared a GPU, and the GPU's clocks over the trials (the rank whose GPU
    ran slowest, where NVML sampled: its clock-event reasons say why)."""
    ranks = [r for r in stage["ranks"] if r.get("status") == "ok"]
    timed = [sum(r.get("metrics", {}).get("times_ms", {}).get(f"matmul/{n}") or []) for r in ranks]
    devices = [(r.get("host"), r.get("device")) for r in ranks]
    shared = len(set(devices)) < len(devices) and any(str(d).startswith("cuda") for _, d in devices)
    sampled = [c for r in ranks if (c := GpuClocks.from_dict(((r.get("result") or {}).get("clocks") or {}).get(str(n))))]
    clocks = min(sampled, key=lambda c: c.sm_mhz_median or 0, default=None)
    return {"timed_s": rnd(max(timed) / 1e3, 3) if timed else None, "shared_gpu": shared,
            "clocks": clocks.to_dict() if clocks else None, "why": clocks.why() if clocks else None,
            "gpu_clocks": clocks.words() if clocks else None}


def _row(ws: int, n: int, total: Stat, per_rank: list[Stat], base: Stat | None, base_ws: int | None, threads: Any,
         busy: str | None = None) -> dict[str, Any]:
    eff = eff_lo = eff_hi = None
    if base is not None and base_ws and base.median > 0:
        per_worker = base.median / base_ws
        eff = total.median / (ws * per_worker)
        if ws != base_ws:  # the other stage's trials count too: its slowest against our fastest and back
            eff_lo = total.min / (ws * base.max / base_ws)
            eff_hi = total.max / (ws * base.min / base_ws)
    flags, note = flags_for(total.spread, eff if ws != base_ws else None, trials=total.n, busy=busy)
    rank_medians = [s.median for s in per_rank]
    return {
        "workers": ws,
        "size": n,
        **stat_fields("gflops", total, 3),
        "gflops_range": span(total.min, total.max),
        "spread": rnd(total.spread, 3),
        "trials": total.n,
        "gflops_per_rank": rnd(sorted(rank_medians)[len(rank_medians) // 2], 3) if rank_medians else None,
        "gflops_by_rank": [rnd(m, 3) for m in rank_medians],
        "efficiency": rnd(eff, 4),
        "efficiency_min": rnd(eff_lo, 4),
        "efficiency_max": rnd(eff_hi, 4),
        "threads_per_worker": threads,
        "flags": flags,
        "note": note,
    }


def _conclusions(rows: list[dict[str, Any]], p: Params, base_ws: int | None, device: str, fair_words: str, fair: bool,
                 load: str | None, busy: bool, concurrency: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["no stage finished: nothing to compare"]
    out = []
    largest = max(p.sizes)
    base_row = next((r for r in rows if r["workers"] == base_ws and r["size"] == largest), None)
    for row in (r for r in rows if r["size"] == largest and r["workers"] != base_ws and r["efficiency"] is not None):
        measured = (f"{row['gflops']:.1f} GFLOP/s in total (trials {row['gflops_range']}) vs {row['workers']} x "
                    f"{base_row['gflops'] / base_ws:.1f} for one worker" if base_row else f"{row['gflops']:.1f} GFLOP/s")
        doubts = doubts_in_words(row["flags"], row["workers"])
        doubts += doubts_in_words((base_row or {}).get("flags", []), base_ws, baseline=True)
        if not fair:
            doubts.append("not like for like")
        if doubts:
            out.append(
                f"{row['workers']} workers at n={largest}: the measured scaling efficiency, {pct(row['efficiency'])} "
                f"(range {pct(row['efficiency_min'])}-{pct(row['efficiency_max'])}), cannot be trusted: "
                f"{', '.join(doubts)} ({measured}); rerun on a quieter machine or with more trials"
                + ("; above 100% cannot come from adding workers of the same size" if "super-linear" in row["flags"] else "")
            )
        else:
            out.append(
                f"{row['workers']} workers reach {pct(row['efficiency'])} scaling efficiency at n={largest} "
                f"(range {pct(row['efficiency_min'])}-{pct(row['efficiency_max'])} over the trials; {measured})"
            )
        if row.get("shared_gpu"):
            out.append(f"{row['workers']} workers share GPUs (resources.ranks_per_gpu): their efficiency measures sharing a GPU, "
                       "not scaling to more GPUs (one GPU's throughput split between its ranks reads 1/k per rank)")
    out.append(fair_words)
    for row in rows:
        timed = f"{row['timed_s']:.3g} s of timed trials" if row.get("timed_s") is not None else "trials' time unknown"
        if row.get("why"):
            out.append(f"{row['workers']} worker(s) at n={row['size']} ran slowed ({timed}): {row['why']}")
        elif row.get("gpu_clocks") and row["size"] == largest:
            out.append(f"{row['workers']} worker(s) at n={row['size']}: {timed}; GPU {row['gpu_clocks']}")
    if load:
        out.append(load + (": the machine was busy, other work than this job's ranks competed for the cores" if busy else ""))
    flagged = [f"{r['workers']}x n={r['size']}" for r in rows if r["flags"]]
    if flagged:
        out.append(f"flagged rows ({', '.join(flagged)}): see their note; their figures are measurements, not conclusions")
    for row in concurrency:
        what = (f"two tasks of {row['iters']} matmuls (n={row['size']}): {row['sequential_ms']:.1f} ms one after the other on "
                f"{row['devices'][0]}, {row['concurrent_ms']:.1f} ms at once on {' + '.join(row['devices'])} (medians of "
                f"{row['trials']} trials)")
        at_once = f"at once {times(row['speedup'], digits=2)} than one after the other"
        spread = times_range(row["speedup_min"], row["speedup_max"], digits=2)
        shared = row["devices"][0] == row["devices"][1] and row["hosts"][0] == row["hosts"][1] and "cuda" in str(row["devices"][0])
        if row["flags"]:
            out.append(f"{what}: {at_once} (range {spread}) not conclusive: {row['note']}")
        elif shared:
            out.append(f"{what}: {at_once} (range {spread})")
        else:
            out.append(f"{what}: {at_once} (range {spread}; 2x faster would be linear)")
        if shared:
            out.append(f"rank 0 and rank 1 share {row['devices'][0]} (resources.ranks_per_gpu): the two tasks ran on one GPU at "
                       "once, so this measures sharing a GPU, not scaling to a second one (about 1x: the GPU was already busy)")
        if "cpu" in row["devices"]:
            out.append(
                f"CPU run: the two 'devices' are two worker processes with {row['threads_per_worker']} thread(s) each "
                "sharing this machine's cores, and the sequential run uses one worker's threads: the speedup measures "
                "cores, not GPUs"
            )
    return out


def _concurrency_rows(stages: list[dict[str, Any]], p: Params) -> list[dict[str, Any]]:
    n, iters = concurrency_params(p)
    rows = []
    for stage in stages:
        by_rank = {r["rank"]: r for r in stage["ranks"] if r.get("status") == "ok"}
        if stage["status"] != "succeeded" or 0 not in by_rank or 1 not in by_rank:
            continue
        times = {k: by_rank[k].get("metrics", {}).get("times_ms", {}) for k in (0, 1)}
        seq = times[0].get("concurrent/sequential") or []
        par0, par1 = times[0].get("concurrent/parallel") or [], times[1].get("concurrent/parallel") or []
        trials = min(len(seq), len(par0), len(par1))
        # both started together: the pair is done when the slower one is
        seq_s, par_s = stat(seq[:trials]), stat(max(a, b) for a, b in zip(par0[:trials], par1[:trials]))
        if seq_s is None or par_s is None:  # no trial of both
            continue
        speedup = seq_s.median / par_s.median if par_s.median > 0 else None
        lo = seq_s.min / par_s.max if par_s.max > 0 else None
        hi = seq_s.max / par_s.min if par_s.min > 0 else None
        spread = max(s.spread or 0 for s in (seq_s, par_s))
        flags, note = flags_for(spread, None, trials=trials)
        if speedup is not None and speedup > 2 * SUPERLINEAR:
            flags.append("super-linear")
            note = "; ".join(x for x in (note, "super-linear: check the load") if x)
        rows.append(
            {
                "workers": stage["world_size"],
                "size": n,
                "iters": iters,
                "trials": trials,
                "sequential_ms": round(seq_s.median, 3),
                "sequential_ms_min": round(seq_s.min, 3),
                "sequential_ms_max": round(seq_s.max, 3),
                "concurrent_ms": round(par_s.median, 3),
                "concurrent_ms_min": round(par_s.min, 3),
                "concurrent_ms_max": round(par_s.max, 3),
                "speedup": rnd(speedup, 4),
                "speedup_min": rnd(lo, 4),
                "speedup_max": rnd(hi, 4),
                "spread": rnd(spread, 3),
                "flags": flags,
                "note": note,
                "devices": [by_rank[0]["device"], by_rank[1]["device"]],
                "hosts": [by_rank[0]["host"], by_rank[1]["host"]],
                "threads_per_worker": (by_rank[0].get("result") or {}).get("threads"),
            }
        )
    return rows


def plot(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    rows = result.get("scaling") or (result.get("summary") or {}).get("scaling") or []
    if not rows:
        return []
    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(11, 5.2))
    workers = sorted({r["workers"] for r in rows})
    base_ws = workers[0]
    flagged_any = False
    for i, n in enumerate(sorted({r["size"] for r in rows})):
        mine = sorted((r for r in rows if r["size"] == n), key=lambda r: r["workers"])
        xs = [r["workers"] for r in mine]
        color = f"C{i}"
        ax_tp.errorbar(xs, values(mine, "gflops"), yerr=yerr(mine, "gflops"), marker="o", capsize=4, color=color,
                       label=f"n={n} (median, min-max)")
        base = next((r for r in mine if r["workers"] == base_ws), None)
        if base and base.get("gflops"):
            ideal = [base["gflops"] * w / base_ws for w in workers]
            ax_tp.plot(workers, ideal, linestyle=":", color=color, alpha=0.7, label=f"n={n}: ideal linear")
        eff_rows = [r for r in mine if r.get("efficiency") is not None]
        err = yerr(eff_rows, "efficiency")
        err = [[0.0 if math.isnan(e) else e for e in side] for side in err]  # the base stage has no range: 1 by definition
        ax_eff.errorbar([r["workers"] for r in eff_rows], values(eff_rows, "efficiency"), yerr=err, marker="o",
                        capsize=4, color=color, label=f"n={n}")
        bad = [r for r in mine if r.get("flags")]
        if bad:
            flagged_any = True
            for ax, key in ((ax_tp, "gflops"), (ax_eff, "efficiency")):
                pts = [r for r in bad if r.get(key) is not None]
                ax.scatter([r["workers"] for r in pts], values(pts, key), s=180, facecolors="none",
                           edgecolors="red", linewidths=1.6, zorder=5)
    if flagged_any:
        for ax in (ax_tp, ax_eff):
            ax.scatter([], [], s=180, facecolors="none", edgecolors="red", linewidths=1.6, label="flagged (see note)")
    ax_eff.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="ideal linear (1.0)")
    tops = [r.get("efficiency_max") or r.get("efficiency") or 0 for r in rows]
    ax_eff.set_ylim(0, max(1.15, max(tops) * 1.1))  # every point and error bar is inside: nothing clipped
    ax_tp.set_ylim(bottom=0)
    ax_tp.set(xlabel="workers", ylabel="total GFLOP/s", title="throughput (all ranks)")
    ax_eff.set(xlabel="workers", ylabel="throughput(N) / (N x throughput(1))", title="scaling efficiency")
    for ax in (ax_tp, ax_eff):
        integer_ticks(ax, workers)
        legend_below(ax)
        ax.grid(alpha=0.3)
    summary = result.get("summary") or {}
    device = result["ranks"][0]["device"] if result.get("ranks") else "?"
    threads = summary.get("threads_per_rank") or {}
    fig.suptitle(f"{result['job']} on {device}; torch threads per rank by world size: "
                 + (", ".join(f"{k}: {v}" for k, v in threads.items()) or "?"))
    notes = [f"{r['workers']} worker(s), n={r['size']}: {r['note']}" for r in rows if r.get("note")]
    notes.append("error bars: min-max of the trials; " + ("like for like" if summary.get("like_for_like") else
                                                          "NOT like for like (see the summary)"))
    return [save_figure(fig, run_dir, "scaling.png", notes), *_plot_concurrency(result, run_dir)]


def _plot_concurrency(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    rows = (result.get("summary") or {}).get("concurrency") or []
    if not rows:
        return []
    row = rows[0]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    labels = [
        f"sequential\n(both on rank 0: {row['devices'][0]})",
        f"concurrent\n(rank 0: {row['devices'][0]} + rank 1: {row['devices'][1]})",
    ]
    meds = [row["sequential_ms"], row["concurrent_ms"]]
    err = [[row["sequential_ms"] - row["sequential_ms_min"], row["concurrent_ms"] - row["concurrent_ms_min"]],
           [row["sequential_ms_max"] - row["sequential_ms"], row["concurrent_ms_max"] - row["concurrent_ms"]]]
    bars = ax.bar(labels, meds, yerr=err, capsize=6, color=["C1", "C2"], label="median (error bar: min-max)")
    for bar, top, med in zip(bars, (row["sequential_ms_max"], row["concurrent_ms_max"]), meds):
        ax.annotate(f"{med:.1f} ms", (bar.get_x() + bar.get_width() / 2, top), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom")
    ax.axhline(row["sequential_ms"] / 2, color="grey", linestyle="--", linewidth=1, label="linear (half the sequential time)")
    ax.set(ylabel="wall time (ms)",
           title=f"two tasks of {row['iters']} matmuls, n={row['size']}: {row['speedup']:.2f}x "
                 f"(range {row['speedup_min']:.2f}-{row['speedup_max']:.2f})")
    ax.set_ylim(0, max(row["sequential_ms_max"], row["concurrent_ms_max"]) * 1.2)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{result['job']}: concurrent vs sequential, {row['trials']} trials")
    notes = [row["note"]] if row.get("note") else []
    return [save_figure(fig, run_dir, "concurrency.png", notes)]
