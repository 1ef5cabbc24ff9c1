"""d2l "GPUs", exercise 3: log a value every step with ``.item()``, or keep the log on the device.

Every rank runs ``steps`` matmuls of ``n x n`` matrices and logs the Frobenius norm of each result
in three ways, each doing exactly the same arithmetic:

* ``item``: ``norms.append(torch.linalg.norm(c).item())``: one host read per step. On a GPU
  every ``.item()`` waits for the device, so the host cannot queue work ahead of it.
* ``device``: ``log[i] = torch.linalg.norm(c)`` into a tensor kept on the device, copied to
  the host once at the end (``log.tolist()``).
* ``recorder``: the launcher's own ``ctx.metrics.log(...)`` + ``ctx.metrics.step()``; the runtime
  copies the values to the host once, after the job.

Each variant is warmed up, then timed ``repeats`` times (trials), the variants taking turns so
that a change in the machine's load hits all three alike. The clock is the host's wall clock with
the device drained before and after: what differs between the variants is how long the host
waits, which is what this clock sees (CUDA events would miss the host's stalls). The summary
reports the median with the min-max of the trials and flags noisy figures. Each variant then runs
once more under a ``SyncCounter``: host reads counted on every device and, on CUDA, the
synchronisations PyTorch reports with ``torch.cuda.set_sync_debug_mode("warn")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from launcher.workloads.measure import machine_state, torch_dtype, wall_clock
from launcher.workloads.params import Count, DtypeName, NonNegative, WorkloadParams
from launcher.workloads.plotting import devices_label, save_figure, yerr
from launcher.workloads.stats import flags_for, ok_ranks, rnd, span, stat, times, times_range
from launcher.workloads.synccount import SyncCounter


class Params(WorkloadParams):
    steps: Count = 1000  # matmuls, each logging one norm
    n: Count = 100  # matrix size
    repeats: Count = 3  # timed trials of each variant (median and min-max reported)
    warmup: NonNegative = 1
    dtype: DtypeName = "float32"
    seed: NonNegative = 0


VARIANTS = ("item", "device", "recorder")
LABELS = {
    "item": ".item()/step",
    "device": "device log",
    "recorder": "ctx.metrics",
}
PLOT_LABELS = {"item": ".item() every step", "device": "log on device, 1 copy", "recorder": "ctx.metrics (launcher)"}


def run(ctx: Any) -> dict[str, Any]:
    import torch

    from launcher.runtime.metrics import MetricsRecorder

    p = Params.model_validate(ctx.params)
    steps, n, repeats, warmup, dtype = p.steps, p.n, p.repeats, p.warmup, torch_dtype(p.dtype)
    gen = torch.Generator(device="cpu").manual_seed(p.seed)
    # The same inputs on every rank and for every variant, made on the host once and moved once.
    a = torch.randn(n, n, generator=gen, dtype=dtype).to(ctx.device)
    xs = (torch.randn(steps, n, n, generator=gen, dtype=dtype) / n**0.5).to(ctx.device)

    def item_loop(_rec: Any) -> Any:
        norms = []
        for i in range(steps):
            norms.append(torch.linalg.norm(a @ xs[i]).item())  # waits for the device every step
        return norms

    def device_loop(_rec: Any) -> Any:
        log = torch.empty(steps, device=ctx.device, dtype=dtype)
        for i in range(steps):
            log[i] = torch.linalg.norm(a @ xs[i])  # stays on the device: nothing to wait for
        return log

    def recorder_loop(rec: Any) -> Any:
        for i in range(steps):
            rec.log("sync/norm", torch.linalg.norm(a @ xs[i]))
            rec.step()
        return rec

    # Each variant: its step loop, then how its log reaches the host at the end.
    variants: dict[str, tuple[Callable[[Any], Any], Callable[[Any], list[float]]]] = {
        "item": (item_loop, lambda norms: norms),
        "device": (device_loop, lambda log: log.tolist()),  # one copy to the host
        "recorder": (recorder_loop, lambda rec: rec.to_host()["values"]["sync/norm"]),  # what the runtime does
    }
    counter = SyncCounter(ctx.device)
    out: dict[str, Any] = {"steps": steps, "n": n, "norm_sum": {}, "machine_start": machine_state()}
    for loop, finish in variants.values():
        for _ in range(warmup):
            finish(loop(MetricsRecorder(ctx.device)))
    for _ in range(repeats):  # trials: the variants take turns
        for name, (loop, finish) in variants.items():
            scratch = MetricsRecorder(ctx.device)  # throw-away recorders: ctx.metrics keeps one clean log
            with wall_clock(ctx.device) as ms:
                finish(loop(scratch))
            ctx.metrics.add_time_ms(f"wall/{name}", ms())
    for name, (loop, finish) in variants.items():
        # Once more under the counter, with ctx.metrics itself for the recorder variant.
        rec = ctx.metrics if name == "recorder" else MetricsRecorder(ctx.device)
        with counter.counting(f"{name}/loop"):
            handle = loop(rec)
        with counter.counting(f"{name}/end"):
            norms = finish(handle)
        out["norm_sum"][name] = float(sum(norms))
    out["host_reads"] = dict(counter.host_reads)
    out["device_syncs"] = None if counter.device_syncs is None else dict(counter.device_syncs)
    out["device_name"] = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    out["machine_end"] = machine_state()
    return out


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """Wall time per variant (median over ranks), its ratio to the device log, and host syncs."""
    ranks = ok_ranks(stages)
    p = Params.model_validate(params)
    steps = p.steps
    per_rank = []
    walls: dict[str, list[float | None]] = {v: [] for v in VARIANTS}
    trials: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in ranks:
        res = r.get("result") or {}
        times = r.get("metrics", {}).get("times_ms", {})
        recorded = r.get("metrics", {}).get("values", {}).get("sync/norm", [])
        entry = {"world_size": r["world_size"], "rank": r["rank"], "device": r["device"], "variants": {}}
        for v in VARIANTS:
            own = stat(times.get(f"wall/{v}"))
            wall = own.median if own else None
            walls[v].append(wall)
            trials[v].extend(times.get(f"wall/{v}") or [])
            syncs = res.get("device_syncs")
            entry["variants"][v] = {
                "wall_ms": rnd(wall),
                "wall_ms_min": rnd(own and own.min),
                "wall_ms_max": rnd(own and own.max),
                "host_reads_per_step": rnd(res.get("host_reads", {}).get(f"{v}/loop", 0) / steps, 6),
                "host_reads_in_loop": res.get("host_reads", {}).get(f"{v}/loop"),
                "host_reads_at_end": res.get("host_reads", {}).get(f"{v}/end"),
                "device_syncs_in_loop": None if syncs is None else syncs.get(f"{v}/loop"),
                "device_syncs_at_end": None if syncs is None else syncs.get(f"{v}/end"),
            }
        sums = res.get("norm_sum", {})
        base = sums.get("item")
        entry["recorded_norms"] = len(recorded)
        entry["logs_agree"] = bool(
            base is not None
            and len(recorded) == steps
            and all(abs(sums.get(v, float("nan")) - base) <= 1e-3 * max(1.0, abs(base)) for v in VARIANTS)
        )
        per_rank.append(entry)
    rows = []
    on_cuda = any(str(r["device"]).startswith("cuda") for r in ranks)
    every = {v: stat(trials[v]) for v in VARIANTS}  # every trial of every rank: the range and the spread
    device_wall = _median_rank(walls["device"])
    dev = every["device"]
    for v in VARIANTS:
        wall = _median_rank(walls[v])  # the median rank's median
        first = [e["variants"][v] for e in per_rank]
        s_all = every[v]
        flags, note = flags_for(s_all and s_all.spread, trials=p.repeats)
        rows.append(
            {
                "variant": LABELS[v],
                "wall_ms": rnd(wall, 3),
                "wall_ms_min": rnd(s_all and s_all.min, 3),
                "wall_ms_max": rnd(s_all and s_all.max, 3),
                "wall_range": span(s_all.min, s_all.max) if s_all else None,
                "trials": s_all.n if s_all else 0,
                "spread": rnd(s_all and s_all.spread, 3),
                "us_step": rnd(wall * 1e3 / steps if wall is not None and steps else None, 3),
                "ratio": rnd(wall / device_wall if wall and device_wall else None, 3),
                "ratio_min": rnd(s_all.min / dev.max if s_all and dev and v != "device" else None, 3),
                "ratio_max": rnd(s_all.max / dev.min if s_all and dev and v != "device" else None, 3),
                "flags": flags,
                "note": note,
                "reads_loop": _same(e["host_reads_in_loop"] for e in first),
                "syncs_loop": _same(e["device_syncs_in_loop"] for e in first) if on_cuda else None,
                "at_end": _same(
                    (e["device_syncs_at_end"] if on_cuda else e["host_reads_at_end"]) for e in first
                ),
                "key": v,
            }
        )
    summary = {
        "title": f"logging {steps} matmul norms (n={p.n}): .item() per step vs on-device log (median of {p.repeats} trials)",
        "columns": ["variant", "wall_ms", "wall_range", "us_step", "ratio", "reads_loop", "syncs_loop", "at_end", "note"],
        "rows": rows,
        "variants": {row["key"]: row for row in rows},
        "per_rank": per_rank,
        "steps": steps,
        "device_syncs_measured": on_cuda,
        "logs_agree": bool(per_rank) and all(e["logs_agree"] for e in per_rank),
        "ratio_item_vs_device": rows[0]["ratio"] if rows else None,
        "conclusions": _conclusions(rows, on_cuda, per_rank, steps),
    }
    return summary


def _median_rank(walls: list[float | None]) -> float | None:
    got = sorted(w for w in walls if w is not None)
    return got[len(got) // 2] if got else None


def _same(values: Any) -> Any:
    """One value when every rank agrees (they should), else the list."""
    values = list(values)
    if not values:
        return None
    return values[0] if all(v == values[0] for v in values) else values


def _conclusions(rows: list[dict[str, Any]], on_cuda: bool, per_rank: list[dict[str, Any]], steps: int) -> list[str]:
    if not rows or rows[0]["wall_ms"] is None:
        return ["no rank finished: nothing to compare"]
    item, device, recorder = rows
    measured = (f".item() every step took {item['wall_ms']:.1f} ms, the on-device log {device['wall_ms']:.1f} ms "
                f"(medians of {item['trials']} trials over {len(per_rank)} rank(s), {steps} steps)")
    doubts = [f"{r['variant']}: {r['note']}" for r in (item, device) if r["flags"]]
    if doubts:
        out = [f"{measured}: .item() {_slower(item['ratio'])} (range {_slower_range(item)}) not "
               f"conclusive ({'; '.join(doubts)}); rerun on a quieter machine or with more repeats"]
    else:
        out = [f"{measured}: .item() every step is {_slower(item['ratio'])} than the on-device log "
               f"(range {_slower_range(item)})"]
    if on_cuda:
        out.append(
            f"host synchronisations reported by torch.cuda.set_sync_debug_mode: {item['syncs_loop']} in the "
            f".item() loop, {device['syncs_loop']} in the device-log loop (+{device['at_end']} copy at the end), "
            f"{recorder['syncs_loop']} for the launcher's recorder (+{recorder['at_end']} at the end)"
        )
    else:
        out.append(
            f"CPU run: no device to wait for, so no device syncs exist to count (not measured); host reads counted "
            f"instead: {item['reads_loop']} in the .item() loop, {device['reads_loop']} in the device-log "
            f"loop, {recorder['reads_loop']} for the launcher's recorder; each of the last two reads once at the end"
        )
        out.append("on the CPU .item() only costs a Python call per step; on a GPU each one also stalls the queue")
    out.append(
        "all three logs hold the same norms" if all(e["logs_agree"] for e in per_rank) else "WARNING: the three logs disagree"
    )
    return out


def _slower(ratio: float | None) -> str:
    """A ratio of wall times in words: 3.2 -> "3.20x slower", 0.8 -> "1.25x faster"."""
    return times(ratio, more="slower", less="faster", digits=2)


def _slower_range(row: Mapping[str, Any]) -> str:
    return times_range(row["ratio_min"], row["ratio_max"], more="slower", less="faster", digits=2)


def plot(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    rows = (result.get("summary") or {}).get("rows") or []
    if not rows or rows[0].get("wall_ms") is None:
        return []
    on_cuda = (result.get("summary") or {}).get("device_syncs_measured")
    labels = [PLOT_LABELS.get(r.get("key"), r["variant"]) for r in rows]
    colors = ["#d62728", "#2ca02c", "#1f77b4"]
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.6))
    bars = ax_t.bar(labels, [r["wall_ms"] for r in rows], yerr=yerr(rows, "wall_ms"), capsize=6, color=colors)
    for bar, r in zip(bars, rows):
        top = r.get("wall_ms_max") or r["wall_ms"]  # above the error bar, never over it
        ax_t.annotate(f"{r['wall_ms']:.1f} ms\n{r['ratio']:.2f}x", (bar.get_x() + bar.get_width() / 2, top),
                      xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=9)
    ax_t.set(ylabel="wall time (ms): median, min-max of trials", title="time to log every step")
    ax_t.set_ylim(0, max(r.get("wall_ms_max") or r["wall_ms"] for r in rows) * 1.3)
    key = "syncs_loop" if on_cuda else "reads_loop"
    counts = [_first(r[key]) or 0 for r in rows]
    bars = ax_s.bar(labels, counts, color=colors)
    for bar, c in zip(bars, counts):
        ax_s.annotate(str(c), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9)
    what = "device syncs (set_sync_debug_mode)" if on_cuda else "host reads (no device: CPU)"
    ax_s.set(ylabel=f"{what} in the loop", title=f"host waits during {result['summary'].get('steps')} steps")
    ax_s.margins(y=0.25)
    for ax in (ax_t, ax_s):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{result['job']} on {devices_label(result)}")
    notes = [f"{r['variant']}: {r['note']}" for r in rows if r.get("note")]
    return [save_figure(fig, run_dir, "sync_logging.png", notes)]


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value
