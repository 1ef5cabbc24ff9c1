"""d2l "GPUs", "Copying": what a copy between host and device (and between devices) costs.

Every rank, in turn (so that ranks do not share the host's memory bus while timed), measures
for each size:

* host->device and device->host, from pageable memory (``x.to(device)``, ``y.cpu()``) and from
  pinned memory (``pin_memory()`` + ``non_blocking=True``), on a GPU;
* on the CPU, where there is no device to copy to, the host memcpy bandwidth as a reference
  (host->device and device->host are reported as not measured).

Then, where there are two devices: a device->device copy between the first two GPUs a process sees
(``x.to("cuda:1")``), and a rank 0 <-> rank 1 ping-pong through the process group (NCCL between
GPUs, gloo between CPU processes). Finally d2l's identity check: ``.to()`` of a tensor already on
its device returns the very same tensor (``Z.cuda(1) is Z``); no copy is made.

Every copy is measured like a benchmark: ``warmup`` untimed copies, then ``repeats`` trials, each
one copy timed on its own: CUDA events for host<->device copies on a GPU, the host clock for the
host memcpy (synchronous) and, with the devices drained, for the GPU<->GPU copy and the ping-pong
(which involve two devices or two processes). The summary reports GB/s (10^9 bytes/s) as the
median of the trials with their min-max, and flags noisy figures.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

from launcher.workloads.measure import host_barrier_group, machine_state, trial_loop, wall_clock
from launcher.workloads.params import Count, NonNegative, PositiveSizes, WorkloadParams
from launcher.workloads.plotting import devices_label, legend_below, save_figure, values, yerr
from launcher.workloads.stats import flags_for, ok_ranks, rnd, span, stat, times


class Params(WorkloadParams):
    sizes_mb: PositiveSizes = (1, 16, 128)  # MiB per copy
    repeats: Count = 5  # timed trials (one copy each) per kind and size: median and min-max reported
    warmup: NonNegative = 1


GPU_KINDS = ("h2d/pageable", "h2d/pinned", "d2h/pageable", "d2h/pinned")
DESCRIPTIONS = {
    "h2d/pageable": "host->device, pageable",
    "h2d/pinned": "host->device, pinned",
    "d2h/pageable": "device->host, pageable",
    "d2h/pinned": "device->host, pinned",
    "h2h/memcpy": "host memcpy (no device)",
    "d2d/peer": "cuda:0->cuda:1, one process",
    "pg/pingpong": "rank0<->rank1, process group",
}


def _numel(mb: float) -> int:
    return max(1, int(mb * 2**20) // 4)  # float32 elements


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    p = Params.model_validate(ctx.params)
    sizes, repeats, warmup = p.sizes_mb, p.repeats, p.warmup
    dev, rec = ctx.device, ctx.metrics

    def measure(name: str, copy: Callable[[], Any], *, events: bool = True) -> None:
        """Warm-up, then ``repeats`` trials of one copy each. ``events``: the recorder's timer (CUDA
        events on a GPU, the host clock on the CPU); otherwise the host clock, devices drained."""
        for _ in range(warmup):
            copy()
        for _ in trial_loop(dev, repeats, together=False):  # this rank alone: the others wait, asleep
            if events:
                with rec.timer(name):
                    copy()
            else:
                with wall_clock(dev) as ms:
                    copy()
                rec.add_time_ms(name, ms())
        rec.step()

    out: dict[str, Any] = {"measured": [], "identity": _identity_checks(torch, ctx), "machine_start": machine_state()}
    quiet = host_barrier_group(dist, ctx)  # waiting ranks sleep instead of spinning on a core
    for turn in range(ctx.world_size):  # one rank at a time on the host <-> device links
        if turn == ctx.rank:
            for mb in sizes:
                host = torch.randn(_numel(mb))
                if dev.type == "cuda":
                    pinned = host.pin_memory()
                    on_dev = host.to(dev)
                    pinned_out = torch.empty_like(host).pin_memory()
                    measure(f"h2d/pageable/{mb:g}", partial(host.to, dev))
                    measure(f"h2d/pinned/{mb:g}", partial(pinned.to, dev, non_blocking=True))
                    measure(f"d2h/pageable/{mb:g}", partial(on_dev.to, "cpu"))
                    measure(f"d2h/pinned/{mb:g}", partial(pinned_out.copy_, on_dev, non_blocking=True))
                    out["pinned_is_pinned"] = bool(pinned.is_pinned() and pinned_out.is_pinned())
                    out["measured"] += [f"{k}/{mb:g}" for k in GPU_KINDS]
                else:
                    dst = torch.empty_like(host)
                    measure(f"h2h/memcpy/{mb:g}", partial(dst.copy_, host))
                    out["measured"].append(f"h2h/memcpy/{mb:g}")
            if dev.type == "cuda" and ctx.local_rank == 0 and torch.cuda.device_count() >= 2:
                out["peer_access"] = bool(torch.cuda.can_device_access_peer(0, 1))
                for mb in sizes:
                    src = torch.randn(_numel(mb), device="cuda:0")
                    measure(f"d2d/peer/{mb:g}", partial(_to_second_gpu, torch, src), events=False)
                    out["measured"].append(f"d2d/peer/{mb:g}")
        dist.barrier(group=quiet)
    # gloo sends host memory only (send/recv of a CUDA tensor is NCCL's): with ranks sharing a GPU the
    # ping-pong stages each buffer through the host, and says so
    staged = dev.type == "cuda" and ctx.pg_backend == "gloo"
    out["pingpong_staged"] = staged
    if ctx.world_size >= 2 and ctx.rank in (0, 1):
        for mb in sizes:
            buf = torch.randn(_numel(mb), device=dev)
            if ctx.rank == 0:
                measure(f"pg/pingpong/{mb:g}", partial(_ping, dist, buf, staged), events=False)
                out["measured"].append(f"pg/pingpong/{mb:g}")
            else:
                for _ in range(warmup + repeats):
                    _pong(dist, buf, staged)
    if ctx.world_size >= 2:
        dist.barrier()
    out["pg_backend"] = ctx.pg_backend
    out["machine_end"] = machine_state()
    return out


def _to_second_gpu(torch: Any, src: Any) -> None:
    """A peer copy, timed on the host: it is done when cuda:1 has it."""
    src.to("cuda:1")
    torch.cuda.synchronize("cuda:1")


def _ping(dist: Any, buf: Any, staged: bool = False) -> None:
    _send(dist, buf, 1, staged)
    _recv(dist, buf, 1, staged)


def _pong(dist: Any, buf: Any, staged: bool = False) -> None:
    _recv(dist, buf, 0, staged)
    _send(dist, buf, 0, staged)


def _send(dist: Any, buf: Any, peer: int, staged: bool) -> None:
    dist.send(buf.cpu() if staged else buf, peer)


def _recv(dist: Any, buf: Any, peer: int, staged: bool) -> None:
    if not staged:
        dist.recv(buf, peer)
        return
    host = buf.new_empty(buf.shape, device="cpu")
    dist.recv(host, peer)
    buf.copy_(host)


def _identity_checks(torch: Any, ctx: Any) -> dict[str, bool]:
    """d2l: ``Z.cuda(1) is Z``: moving a tensor to the device it is on returns it, uncopied."""
    z = torch.ones(2, 3, device=ctx.device)
    same = z.cuda(ctx.device.index) if ctx.device.type == "cuda" else z.cpu()  # its own GPU (ranks may share one)
    copied = z.to(ctx.device, copy=True)
    return {
        "to_same_device_is_same": z.to(ctx.device) is z,
        "cuda_or_cpu_call_is_same": same is z,
        "same_storage": same.data_ptr() == z.data_ptr(),
        "copy_true_makes_new": copied is not z and copied.data_ptr() != z.data_ptr(),
    }


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """GB/s per direction, memory kind and size (median over ranks), plus the identity checks."""
    ranks = ok_ranks(stages)
    sizes = Params.model_validate(params).sizes_mb
    on_cuda = any(str(r["device"]).startswith("cuda") for r in ranks)
    kinds = (*GPU_KINDS, "d2d/peer", "pg/pingpong") if on_cuda else ("h2h/memcpy", "pg/pingpong")
    rows = []
    for kind in kinds:
        for mb in sizes:
            name = f"{kind}/{mb:g}"
            timed = [r for r in ranks if r["metrics"]["times_ms"].get(name)]
            if not timed:
                continue
            # a ping-pong moves the buffer twice: one way is half the round trip
            half = 0.5 if kind == "pg/pingpong" else 1.0
            gbytes = mb * 2**20 / 1e9
            per_rank = [stat(ms * half for ms in r["metrics"]["times_ms"][name] if ms and ms > 0) for r in timed]
            every = stat(ms * half for r in timed for ms in r["metrics"]["times_ms"][name] if ms and ms > 0)
            if every is None:
                continue
            medians = sorted(x.median for x in per_rank if x is not None)
            ms = medians[len(medians) // 2]  # the median rank's median
            flags, note = flags_for(every.spread, trials=min(x.n for x in per_rank if x is not None))
            rows.append(
                {
                    "copy": DESCRIPTIONS[kind],
                    "mib": mb,
                    "ms": rnd(ms, 4),
                    "ms_min": rnd(every.min, 4),
                    "ms_max": rnd(every.max, 4),
                    "gb_s": rnd(gbytes / (ms / 1e3), 3),
                    "gb_s_min": rnd(gbytes / (every.max / 1e3), 3),  # the slowest trial
                    "gb_s_max": rnd(gbytes / (every.min / 1e3), 3),  # the fastest
                    "gb_s_range": span(gbytes / (every.max / 1e3), gbytes / (every.min / 1e3)),
                    "trials": every.n,
                    "spread": rnd(every.spread, 3),
                    "ranks": len(timed),
                    "flags": flags,
                    "note": note,
                    "kind": kind,
                }
            )
    identity = {r["rank"] if len(stages) == 1 else f"{r['world_size']}:{r['rank']}": (r.get("result") or {}).get("identity") for r in ranks}
    identity_ok = bool(identity) and all(v and all(v.values()) for v in identity.values())
    pg = sorted({str(b) for r in ranks if (b := (r.get("result") or {}).get("pg_backend"))})
    pingpong_hosts = {r["host"] for r in ranks if r["rank"] in (0, 1) and r["world_size"] >= 2}
    staged = any((r.get("result") or {}).get("pingpong_staged") for r in ranks)
    not_measured = [] if on_cuda else [DESCRIPTIONS[k] for k in GPU_KINDS] + [DESCRIPTIONS["d2d/peer"]]
    if on_cuda and not any(r["kind"] == "d2d/peer" for r in rows):
        not_measured.append(DESCRIPTIONS["d2d/peer"] + " (needs two GPUs visible to one process)")
    if not any(r["kind"] == "pg/pingpong" for r in rows):
        not_measured.append(DESCRIPTIONS["pg/pingpong"] + " (needs world size 2)")
    return {
        "title": "copy bandwidth in GB/s (median of trials, min-max)",
        "columns": ["copy", "mib", "ms", "gb_s", "gb_s_range", "ranks", "note"],
        "rows": rows,
        "on_gpu": on_cuda,
        "not_measured": not_measured,
        "identity": identity,
        "identity_ok": identity_ok,
        "pinned_vs_pageable": _pinned_ratios(rows),
        "pg_backends": pg,
        "pingpong_across_hosts": len(pingpong_hosts) > 1,
        "pingpong_staged": staged,
        "conclusions": _conclusions(rows, on_cuda, identity_ok, not_measured, pg, staged),
    }


def _pinned_ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    by = {(r["kind"], r["mib"]): r["gb_s"] for r in rows if r["gb_s"]}
    out = {}
    for direction in ("h2d", "d2h"):
        for (kind, mb), gbs in by.items():
            if kind == f"{direction}/pinned" and by.get((f"{direction}/pageable", mb)):
                out[f"{direction}/{mb:g}"] = rnd(gbs / by[(f"{direction}/pageable", mb)], 3)
    return out


def _conclusions(rows: list[dict[str, Any]], on_cuda: bool, identity_ok: bool, not_measured: list[str], pg: list[str],
                 staged: bool = False) -> list[str]:
    out = []
    if not rows:
        return ["no rank finished: nothing to compare"]
    largest = max(r["mib"] for r in rows)
    top = {r["kind"]: r for r in rows if r["mib"] == largest and not r["flags"]}
    flagged = [f"{r['copy']} at {r['mib']:g} MiB ({r['note']})" for r in rows if r["flags"]]
    if flagged:
        out.append(f"flagged, not conclusive: {', '.join(flagged)}")
    if on_cuda:
        for d, words in (("h2d", "host->device"), ("d2h", "device->host")):
            pin, page = top.get(f"{d}/pinned"), top.get(f"{d}/pageable")
            if pin and page:
                out.append(
                    f"{words} at {largest:g} MiB: pinned {pin['gb_s']:.3g} GB/s vs pageable {page['gb_s']:.3g} GB/s "
                    f"(pinned {times(pin['gb_s'] / page['gb_s'], digits=2)})"
                )
        if "d2d/peer" in top:
            out.append(f"GPU to GPU in one process at {largest:g} MiB: {top['d2d/peer']['gb_s']:.3g} GB/s")
    else:
        if "h2h/memcpy" in top:
            out.append(f"host memcpy at {largest:g} MiB: {top['h2h/memcpy']['gb_s']:.3g} GB/s (the CPU reference: no device here)")
        out.append("no GPU: host<->device copies (pageable and pinned) and GPU-to-GPU copies not measured")
    if "pg/pingpong" in top:
        what = "GPU to GPU" if on_cuda else "CPU process to CPU process, not a GPU copy"
        if staged:
            what = "ranks on one GPU: gloo sends host memory, so each way is GPU->host, host->host, host->GPU"
        out.append(f"rank 0 -> rank 1 through {'/'.join(pg)} at {largest:g} MiB: {top['pg/pingpong']['gb_s']:.3g} GB/s one way ({what})")
    out.append(
        "x.to(its own device) returns x itself: no copy (d2l's Z.cuda(1) is Z), while copy=True makes one"
        if identity_ok
        else "WARNING: .to() of a tensor already on its device did not return the same tensor"
    )
    return out


def plot(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    summary = result.get("summary") or {}
    rows = summary.get("rows") or []
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(8.5, 5.6))
    styles = {"pinned": "-", "pageable": "--"}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["mib"])
        ax.errorbar([r["mib"] for r in mine], values(mine, "gb_s"), yerr=yerr(mine, "gb_s"), marker="o", capsize=3,
                    linestyle=styles.get(kind.split("/")[1], "-"), label=DESCRIPTIONS.get(kind, kind))
    bad = [r for r in rows if r.get("flags")]
    if bad:
        ax.scatter([r["mib"] for r in bad], values(bad, "gb_s"), s=160, facecolors="none", edgecolors="red",
                   linewidths=1.5, zorder=5, label="flagged (see note)")
    ax.set(xscale="log", xlabel="copy size (MiB)", ylabel="GB/s (median of trials, min-max)", title="copy bandwidth")
    sizes = sorted({r["mib"] for r in rows})
    ax.set_xticks(sizes)
    ax.set_xticklabels([f"{m:g}" for m in sizes])
    ax.xaxis.set_minor_formatter(_null())
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both")
    legend_below(ax)
    ok = "yes" if summary.get("identity_ok") else "NO"
    fig.suptitle(f"{result['job']} on {devices_label(result)}  \u00b7  x.to(own device) is x: {ok}")
    notes = [f"{r['copy']}, {r['mib']:g} MiB: {r['note']}" for r in rows if r.get("note")]
    if summary.get("not_measured"):
        notes.append("not measured: " + "; ".join(summary["not_measured"]))
    notes.append("GB/s = 10^9 bytes/s; error bars: min-max of the trials")
    return [save_figure(fig, run_dir, "transfer.png", notes)]


def _null() -> Any:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()
