"""``launch selftest``'s job: what a node's GPUs, links and the launcher's own GPU paths do, measured
in real ranks (one per GPU, or ``cpu_workers`` on a machine without one) started the way every
job is started.

Each rank, in turn where ranks would disturb each other and together where the hardware is
separate, measures:

- its placement: on ``cuda:<local_rank>``, and torch's device there is the GPU it was granted
  (the UUID NVML gives for its ``CUDA_VISIBLE_DEVICES`` entry: a CUDA_DEVICE_ORDER mix-up shows);
- matmul TFLOP/s in bf16 and fp32 (CUDA events, median of trials);
- host<->device copies, pageable and pinned (one rank at a time: they share the host's links),
  and on each node GPU 0 -> GPU 1 (peer);
- all-reduce bus bandwidth over the node's ranks and, across nodes, over all of them;
- the recorder's promise: a training-like loop logging every step through ``ctx.metrics`` makes
  no host sync (under ``torch.cuda.set_sync_debug_mode("error")`` on a GPU);
- the straggler marks: the last rank makes its own work slower on purpose; the launcher, which
  reads every rank's own-work figure live, must flag it (``summarize`` checks it did).

What a CPU-only machine cannot measure is listed as not run, with the reason. Figures go to
``summarize`` (``launcher.workloads.selftest_report``), which sets them against the hardware's
limits.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Literal, TypeVar

from launcher.workloads import probes
from launcher.workloads.measure import clocks_dict, gpu_sampler
from launcher.workloads.params import WorkloadParams
from launcher.workloads.selftest_report import plot, summarize  # noqa: F401 - the job's hooks

LevelName = Literal["quick", "default", "full"]
T = TypeVar("T")


class Params(WorkloadParams):
    level: LevelName = "default"  # quick ~30 s, default ~2 min, full < 8 min on an 8-GPU node
    slow_ms: float = 20.0  # how much slower the last rank's own work is made, per step
    straggler_s: float | None = None  # how long the straggler phase runs (default: the level's)
    hand_loop: bool | None = None  # also time a hand-written matmul loop beside the figure (default: the level's; full: on)


@dataclass(frozen=True)
class Level:
    """How much each measurement does at one level (GPU figures; the CPU's are smaller)."""

    matmul_n: tuple[int, ...]  # GPU matrix sizes (the best size's median is the figure)
    cpu_matmul_n: int
    trials: int
    copy_mb: int
    allreduce_mb: tuple[float, ...]  # GPU message sizes (the largest gives the figure)
    cpu_allreduce_mb: tuple[float, ...]
    sync_steps: int
    straggler_s: float
    warmup_s: float = 1.0  # GPU matmul: seconds of products before the first size (clocks settle in time, not in count)
    trial_s: float = 0.1  # GPU matmul: one trial's duration (the products it repeats)
    matmul_trials: int = 10  # GPU matmul: timed trials per size (at least; the level's trials where more)
    hand_loop: bool = False  # GPU matmul: a hand-written loop right after each size, same products (the reference)


LEVELS: dict[str, Level] = {
    "quick": Level((8192,), 512, 5, 64, (64.0,), (4.0,), 50, 4.0, warmup_s=1.0),
    "default": Level((8192,), 1024, 10, 256, (1.0, 16.0, 256.0), (1.0, 16.0), 200, 5.0, warmup_s=2.0, matmul_trials=15),
    "full": Level((4096, 8192, 16384), 1024, 20, 1024, (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0), (1.0, 16.0, 64.0), 500, 6.0,
                  warmup_s=2.0, matmul_trials=20, hand_loop=True),
}
# a later size of a sweep starts on a warm GPU: a shorter warm-up settles the new size
LATER_WARMUP_S = 0.5


@dataclass(frozen=True)
class Figure:
    """One measured figure, as a rank reports it (``summarize`` adds the limit)."""

    check: str  # matmul_bf16, matmul_fp32, h2d_pinned, ..., allreduce_node, allreduce_all
    rank: int  # the rank that measured it (for a node's or the group's figure: the first of them)
    host: str
    device: str  # "cuda:0", "cpu", or "" for a figure of a node or of the whole group
    value: float
    low: float
    high: float
    unit: str
    detail: str  # how it was measured, in a few words
    # the GPU's clocks, power and clock-event reasons over the figure's run (NvmlClocks' dict; None: not sampled)
    clocks: dict[str, Any] | None = None
    # the same measurement by a hand-written loop, right after (matmul): value, ratio, iters, seconds
    reference: dict[str, Any] | None = None
    backend: str | None = None  # a collective's process group backend ("nccl", "gloo")
    shared: bool = False  # measured on a GPU other ranks of the node share (resources.ranks_per_gpu)


@dataclass(frozen=True)
class NotRun:
    """A part of the selftest this machine cannot run; ``host`` "*": the whole group."""

    check: str  # what, in words: "bf16 matmul vs the datasheet"
    host: str
    why: str  # short, shared by the parts it stops: "no GPU"


def run(ctx: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from launcher.workloads.measure import host_barrier_group

    p = Params.model_validate(ctx.params)
    level = LEVELS[p.level]
    quiet = host_barrier_group(dist, ctx)  # ranks waiting their turn sleep in gloo, not spin in NCCL
    figures: list[Figure] = []
    not_run: list[NotRun] = []
    out: dict[str, Any] = {"placement": placement(ctx), "host": ctx.host, "device": str(ctx.device)}
    if ctx.local_rank == 0:
        out["node"] = node_facts(ctx)
        if out["node"]["inventory"] is None:
            not_run.append(NotRun("GPU inventory and health (NVML)", ctx.host, "no NVIDIA driver"))
    figures += matmul_figures(ctx, level, quiet, not_run, hand=level.hand_loop if p.hand_loop is None else p.hand_loop)
    figures += copy_figures(ctx, level, quiet, not_run)
    figures += allreduce_figures(ctx, level, not_run)
    out["sync_check"] = sync_check(ctx, level, not_run)
    out["straggler"] = straggler_phase(ctx, p, level, not_run, quiet)
    out["figures"] = [asdict(f) for f in figures]
    out["not_run"] = [asdict(n) for n in not_run if n.host != "*" or ctx.rank == 0]  # the group's: said once
    return out


# --- what the rank is on ---------------------------------------------------------------------------


def placement(ctx: Any) -> dict[str, Any]:
    """Where this rank's tensors land, and which GPU torch's device is (UUID), for ``summarize``
    to check against the GPU NVML says its ``CUDA_VISIBLE_DEVICES`` entry grants it."""
    import torch

    probe = torch.ones(1, device=ctx.device)
    share = sharing(ctx)
    facts: dict[str, Any] = {
        "device": str(ctx.device),
        "expected": f"cuda:{ctx.local_rank // share}" if ctx.device.type == "cuda" else "cpu",
        "ranks_per_gpu": share,
        "tensor_device": str(probe.device),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_order": os.environ.get("CUDA_DEVICE_ORDER"),
    }
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        facts.update(
            current_device=torch.cuda.current_device(),
            index=ctx.device.index,
            name=props.name,
            uuid="GPU-" + str(getattr(props, "uuid", "")).removeprefix("GPU-"),
            memory_mib=props.total_memory // 2**20,
        )
    return facts


def node_facts(ctx: Any) -> dict[str, Any]:
    """The node's inventory (NVML) and software versions, from its first rank."""
    import torch

    from launcher.hardware.devices import usable_cpu_count
    from launcher.hardware.nvml import read_inventory

    inventory = read_inventory()
    versions = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "python": ".".join(map(str, __import__("sys").version_info[:3])),
        "pg_backend": ctx.pg_backend,
    }
    return {
        "hostname": socket.gethostname(),
        "cpus": usable_cpu_count(),
        "ranks": ctx.local_world_size,
        "ranks_per_gpu": sharing(ctx),
        "versions": versions,
        "inventory": None if inventory is None else inventory.to_dict(),
        "nvml": "read" if inventory is not None else "NVML did not start: no NVIDIA driver on this host",
    }


# --- throughput ------------------------------------------------------------------------------------


def sharing(ctx: Any) -> int:
    """How many ranks of the node compute on this rank's GPU (1: a GPU of its own; always 1 on the CPU)."""
    return max(1, int(getattr(ctx, "ranks_per_gpu", 1) or 1)) if ctx.device.type == "cuda" else 1


def in_turns(ctx: Any, quiet: Any, measure: Callable[[], T]) -> T | None:
    """``measure`` on every rank: at once where each rank has a GPU of its own, in turns where ranks
    share one (each then alone on it: its figure is the GPU's, not a share of it). Ranks wait their
    turn in a host barrier."""
    import torch.distributed as dist

    share = sharing(ctx)
    got: T | None = None
    for turn in range(share):
        if ctx.local_rank % share == turn:
            got = measure()
        if share > 1:
            dist.barrier(group=quiet)
    return got


def matmul_figures(ctx: Any, level: Level, quiet: Any, not_run: list[NotRun], *, hand: bool = False) -> list[Figure]:
    """Every rank at once (each on its own GPU; in turns where ranks share one; on the CPU, one
    thread each), lined up before each size.

    On a GPU it measures as a hand-written loop does, long enough for the clocks the card holds
    under sustained load: ``warmup_s`` seconds of products first (a count of products would be
    gone in milliseconds, on boost clocks the power cap then takes back), then trials of
    ``trial_s`` each (the products a trial repeats), the median of ``matmul_trials`` the figure;
    the best size's median is the figure. NVML samples the GPU over the timed trials. With
    ``hand``: a hand-written loop (host clock around the same number of products) right after
    each size, recorded beside the figure with the ratio."""
    import torch
    import torch.distributed as dist

    gpu = ctx.device.type == "cuda"
    if not gpu:
        torch.set_num_threads(1)  # like for like with any other CPU figure of this project
        not_run.append(NotRun("matmul bf16 and fp32 vs the datasheet", "*", "no GPU"))
    shared = sharing(ctx) > 1

    def sweep(dtype: str) -> Figure:
        best: tuple[probes.Trials, int, dict[str, Any] | None, probes.Trials | None] | None = None
        for i, n in enumerate(level.matmul_n if gpu else (level.cpu_matmul_n,)):
            if not shared:
                dist.barrier(group=quiet)
            if gpu:
                sampler = gpu_sampler(ctx.device)
                got = probes.matmul_tflops(ctx.device, dtype, n, trials=max(level.matmul_trials, level.trials), warmup=3,
                                           warmup_s=level.warmup_s if i == 0 else LATER_WARMUP_S, trial_s=level.trial_s, sampler=sampler)
                clocks = clocks_dict(sampler)
                ref = probes.hand_loop_tflops(ctx.device, dtype, n, iters=got.per_trial * got.trials) if hand else None
            else:
                got, clocks, ref = probes.matmul_tflops(ctx.device, dtype, n, repeat=3, trials=level.trials, warmup=3), None, None
            if best is None or got.median > best[0].median:
                best = (got, n, clocks, ref)
        assert best is not None
        got, n, clocks, ref = best
        check = "matmul_bf16" if dtype == "bfloat16" else "matmul_fp32"
        detail = f"n={n}, median of {got.trials} trials"
        if gpu:
            warm = level.warmup_s if n == (level.matmul_n[0]) else LATER_WARMUP_S
            detail += f" of {got.per_trial} products ({got.seconds:.2g} s timed, after {warm:g} s of warm-up)"
        reference = None if ref is None else {
            "what": "hand loop", "value": ref.median, "ratio": got.median / ref.median if ref.median else None,
            "iters": ref.per_trial, "seconds": ref.seconds, "figure_seconds": got.seconds, "n": n}
        return Figure(check, ctx.rank, ctx.host, str(ctx.device), got.median, got.low, got.high, got.unit, detail,
                      clocks=clocks, reference=reference, shared=shared)

    figures = []
    for dtype in ("bfloat16", "float32") if gpu else ("float32",):
        got = in_turns(ctx, quiet, functools.partial(sweep, dtype))
        assert got is not None
        figures.append(got)
    return figures


def copy_figures(ctx: Any, level: Level, quiet: Any, not_run: list[NotRun]) -> list[Figure]:
    """One rank at a time (the host's memory and root ports are shared); then GPU 0 -> GPU 1."""
    import torch
    import torch.distributed as dist

    gpu = ctx.device.type == "cuda"
    figures: list[Figure] = []
    for turn in range(ctx.world_size):
        if turn == ctx.rank:
            figures += _own_copies(ctx, level) if gpu else [_host_copy(ctx, level)]
        dist.barrier(group=quiet)
    if not gpu:
        not_run.append(NotRun("host<->GPU copies vs PCIe", "*", "no GPU"))
        not_run.append(NotRun("GPU->GPU peer copy", "*", "no GPU"))
    elif ctx.local_rank == 0 and torch.cuda.device_count() < 2:
        why = "ranks share one GPU" if sharing(ctx) > 1 else "one GPU on the node"
        not_run.append(NotRun("GPU->GPU peer copy", ctx.host, why))
    elif ctx.local_rank == 0:
        sampler = gpu_sampler(ctx.device)
        try:
            with sampler:
                got = probes.peer_copy_gbs(torch.device("cuda:0"), torch.device("cuda:1"), mb=level.copy_mb, trials=level.trials)
        except RuntimeError as exc:  # GPU 1 in exclusive-process mode belongs to rank 1's context
            not_run.append(NotRun("GPU->GPU peer copy", ctx.host, str(exc).splitlines()[0]))
        else:
            access = torch.cuda.can_device_access_peer(0, 1)
            figures.append(Figure("peer_copy", ctx.rank, ctx.host, "cuda:0->cuda:1", got.median, got.low, got.high, got.unit,
                                  f"{level.copy_mb} MiB, peer access {'on' if access else 'off (through the host)'}",
                                  clocks=clocks_dict(sampler)))
    dist.barrier(group=quiet)
    return figures


def _own_copies(ctx: Any, level: Level) -> list[Figure]:
    figures = []
    for direction in ("h2d", "d2h"):
        for pinned in (False, True):
            sampler = gpu_sampler(ctx.device)
            with sampler:
                got = probes.copy_gbs(ctx.device, direction, pinned=pinned, mb=level.copy_mb, trials=level.trials)
            kind = "pinned" if pinned else "pageable"
            figures.append(Figure(f"{direction}_{kind}", ctx.rank, ctx.host, str(ctx.device), got.median, got.low, got.high, got.unit,
                                  f"{level.copy_mb} MiB {kind}", clocks=clocks_dict(sampler), shared=sharing(ctx) > 1))
    return figures


def _host_copy(ctx: Any, level: Level) -> Figure:
    got = probes.host_copy_gbs(mb=level.copy_mb, trials=level.trials)
    return Figure("host_memcpy", ctx.rank, ctx.host, "cpu", got.median, got.low, got.high, got.unit, f"{level.copy_mb} MiB in host memory")


def allreduce_figures(ctx: Any, level: Level, not_run: list[NotRun]) -> list[Figure]:
    """Over each node's ranks (a subgroup when there are several nodes), then over all ranks."""
    import torch.distributed as dist

    sizes = list(level.allreduce_mb if ctx.device.type == "cuda" else level.cpu_allreduce_mb)
    figures: list[Figure] = []
    if ctx.device.type != "cuda":
        not_run.append(NotRun("NCCL all-reduce (gloo measured)", "*", "no GPU"))
    if ctx.world_size == 1:
        not_run.append(NotRun("all-reduce", "*", "one rank"))
        return figures
    multi_node = ctx.world_size > ctx.local_world_size
    node_group = None
    if multi_node:  # every rank creates every node's group (new_subgroups), then uses its own
        node_group, _ = dist.new_subgroups(group_size=ctx.local_world_size)
    if ctx.local_world_size > 1:
        figures += _allreduce(ctx, "allreduce_node", sizes, level.trials, node_group, ctx.local_rank == 0)
    elif ctx.rank == 0:
        not_run.append(NotRun("all-reduce within a node", "*", "one rank per node"))
    if multi_node:
        figures += _allreduce(ctx, "allreduce_all", sizes, level.trials, None, ctx.rank == 0)
    return figures


def _allreduce(ctx: Any, check: str, sizes: list[float], trials: int, group: Any, keep: bool) -> list[Figure]:
    import torch.distributed as dist

    sampler = gpu_sampler(ctx.device)
    with sampler:
        sweep = probes.allreduce_sweep(ctx.device, sizes, trials=trials, group=group)
    if not keep:
        return []
    top = max(sweep, key=lambda s: s.busbw_gbs)
    ranks = dist.get_world_size(group)
    table = ", ".join(f"{s.bytes / 2**20:g} MiB: {s.busbw_gbs:.3g}" for s in sweep)
    shared = sharing(ctx) > 1
    over = f"{ctx.pg_backend} over CUDA tensors" if ctx.device.type == "cuda" and ctx.pg_backend == "gloo" else ctx.pg_backend
    why = f" ({sharing(ctx)} ranks share each GPU: NCCL refuses two ranks on one GPU)" if shared else ""
    return [Figure(check, ctx.rank, ctx.host if check == "allreduce_node" else "", "", top.busbw_gbs, min(s.busbw_gbs for s in sweep), top.busbw_gbs,
                   "GB/s", f"{over} busbw over {ranks} ranks{why}; by size: {table}", clocks=clocks_dict(sampler),
                   backend=ctx.pg_backend, shared=shared)]


# --- the launcher's own promises ---------------------------------------------------------------------


def sync_check(ctx: Any, level: Level, not_run: list[NotRun]) -> dict[str, Any]:
    """The rank's own recorder (``ctx.metrics``, with the runtime's step hooks) in a training-like
    loop: host reads counted, device syncs raised (GPU)."""
    got = probes.recorder_sync_check(ctx.device, ctx.metrics, level.sync_steps)
    if ctx.device.type != "cuda":
        not_run.append(NotRun("device syncs under set_sync_debug_mode (host reads counted)", "*", "no GPU"))
    return {**asdict(got), "clean": got.clean, "cuda": ctx.device.type == "cuda"}


def straggler_phase(ctx: Any, p: Params, level: Level, not_run: list[NotRun], host_barrier: Any = None) -> dict[str, Any]:
    """Steps of own work (``ctx.metrics.work()``) then a small all-reduce; the last rank's own work
    is ``slow_ms`` longer. On a GPU the work is device time (``torch.cuda._sleep``), so only the
    CUDA-event marks can see it; the host waits for each step at its end (outside the marks), as
    a real loop's data loading would keep it from running far ahead."""
    import torch
    import torch.distributed as dist

    if ctx.world_size == 1:
        not_run.append(NotRun("straggler flag", "*", "one rank"))
        return {"slow_rank": None}
    gpu = ctx.device.type == "cuda"
    base_ms, slow_rank = 5.0, ctx.world_size - 1
    own_ms = base_ms + (p.slow_ms if ctx.rank == slow_rank else 0.0)
    duration = p.straggler_s or level.straggler_s
    steps = max(30, int(duration * 1e3 / (base_ms + p.slow_ms)))  # every rank computes the same count
    # ranks that share a GPU time its sleep cycles in turns: at once, the GPU's time slices would halve it
    cycles = (in_turns(ctx, host_barrier, lambda: probes.gpu_sleep_cycles_per_ms(ctx.device)) or 0.0) if gpu else 0.0
    flag = torch.zeros(1, device=ctx.device)
    for _ in range(steps):
        with ctx.metrics.work():
            if gpu:
                torch.cuda._sleep(int(own_ms * cycles))
            else:
                time.sleep(own_ms / 1e3)
        dist.all_reduce(flag)
        ctx.metrics.step()
        if gpu:
            torch.cuda.current_stream().synchronize()
    if not gpu:
        not_run.append(NotRun("straggler marks on CUDA events (host clock used)", "*", "no GPU"))
    marks = "cuda events" if gpu else "host clock"
    if sharing(ctx) > 1:
        marks += f", {sharing(ctx)} ranks per GPU"
    return {"slow_rank": slow_rank, "slow_ms": p.slow_ms, "base_ms": base_ms, "steps": steps, "marks": marks}
