"""What a GPU (or a CPU) can do, measured the way the tools people trust measure it: a warm-up,
then timed trials (CUDA events on a GPU, the host clock with nothing in flight on the CPU), the
median reported with the spread. Shared by ``launch selftest`` and the GPU benchmarks, so that a
figure is measured one way only.

- matmul throughput (TFLOP/s) at a dtype, against ``launcher.hardware.limits``'s datasheet peaks;
- host<->device copies (pageable and pinned), peer copies between two GPUs, and a host memcpy;
- all-reduce bus bandwidth as NCCL's ``all_reduce_perf`` reports it (algbw x 2(n-1)/n);
- the recorder's promise: a training-like loop logging every step makes no host sync.

torch is imported lazily: the launcher imports the workloads before it spawns anything.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from launcher.hardware.limits import allreduce_bus_factor

GB = 1e9  # link speeds are quoted in 10^9 bytes per second


@dataclass(frozen=True)
class Trials:
    """One figure from repeated trials: the median, with the fastest and the slowest."""

    median: float
    low: float
    high: float
    trials: int
    unit: str
    per_trial: int = 1  # operations (matmuls, copies) timed together as one trial
    seconds: float = 0.0  # the timed trials' total time

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def time_ms(device: Any, fn: Callable[[], Any], *, warmup: int, trials: int, repeat: int = 1) -> list[float]:
    """Milliseconds per call of ``fn`` in each trial (``repeat`` calls per trial, timed as one).

    On a GPU each trial is bracketed by CUDA events on the current stream: the host only queues,
    the device's own clock times the work. On the CPU every op is synchronous: the host clock.
    """
    import torch

    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    out: list[float] = []
    for _ in range(trials):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / repeat)
        else:
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            out.append((time.perf_counter() - t0) * 1e3 / repeat)
    return out


def rate(ms: list[float], amount: float, unit: str, per_trial: int = 1) -> Trials:
    """``amount`` per trial's time, as a rate: the fastest trial gives the highest rate (``ms``:
    per operation, ``per_trial`` operations in each trial)."""
    rates = [amount / (m / 1e3) for m in ms]
    return Trials(statistics.median(rates), min(rates), max(rates), len(rates), unit, per_trial, round(sum(ms) * per_trial / 1e3, 4))


def warm_up(device: Any, fn: Callable[[], Any], seconds: float, *, at_least: int = 1) -> int:
    """Run ``fn`` for ``seconds`` of wall time (the device drained every ~20 ms of work), after
    ``at_least`` calls: clocks and power settle over time, not over a count of calls (a GPU takes
    about a second to reach the clock its power cap holds under a long run). Calls made."""
    import torch

    cuda = device.type == "cuda"
    for _ in range(at_least):
        fn()
    done, chunk = at_least, 1
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        done += chunk
        if time.perf_counter() - t0 < 0.02:
            chunk *= 2
    return done


def matmul_tflops(device: Any, dtype: str, n: int, *, repeat: int | None = None, trials: int, warmup: int = 3,
                  warmup_s: float = 0.0, trial_s: float = 0.0, sampler: Any = None) -> Trials:
    """n x n times n x n products at ``dtype`` (``torch.bfloat16``'s name, ...): TFLOP/s.

    Measured as a hand-written loop does its work (``torch.matmul(a, b)``, the result a new tensor
    from the caching allocator), after ``warmup`` products and ``warmup_s`` seconds of them (warm
    clocks). Each trial repeats ``repeat`` products, or as many as take ``trial_s`` (timed once,
    warm) when ``repeat`` is None. ``sampler`` (a ``GpuSampler``): entered around the timed trials.
    fp32 stays true fp32 (torch's default: TF32 off), to compare with the fp32 datasheet figure.
    """
    import torch

    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))

    def product() -> Any:
        return torch.matmul(a, b)

    warm_up(device, product, warmup_s, at_least=max(1, warmup))
    if repeat is None:
        (one,) = time_ms(device, product, warmup=0, trials=1, repeat=2)
        repeat = max(1, round(trial_s * 1e3 / max(one, 1e-3)))
    with sampler if sampler is not None else contextlib.nullcontext():
        ms = time_ms(device, product, warmup=0, trials=trials, repeat=repeat)
    return rate(ms, 2.0 * n**3 / 1e12, "TFLOP/s", repeat)


def hand_loop_seconds(device: Any, dtype: Any, n: int, *, iters: int, warmup: int = 3) -> float:
    """The matmul loop people write by hand: ``warmup`` products of two n x n matrices of ``dtype``
    (a torch dtype), then ``iters`` of them with the host clock around the loop and the device
    drained before and after; the loop's seconds. ``benchmarks/hand_matmul.py`` times this too."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def hand_loop_tflops(device: Any, dtype: str, n: int, *, iters: int, warmup: int = 3) -> Trials:
    """The hand loop (``hand_loop_seconds``) as one figure, no trials: the reference the
    selftest's own figure is set beside."""
    import torch

    seconds = hand_loop_seconds(device, getattr(torch, dtype), n, iters=iters, warmup=warmup)
    tflops = 2.0 * n**3 * iters / seconds / 1e12
    return Trials(tflops, tflops, tflops, 1, "TFLOP/s", iters, round(seconds, 4))


def copy_gbs(device: Any, direction: str, *, pinned: bool, mb: int, trials: int, warmup: int = 2) -> Trials:
    """A host<->device copy of ``mb`` MiB: ``direction`` "h2d" or "d2h"; GB/s (10^9 bytes)."""
    import torch

    numel = mb * 2**20
    host = torch.empty(numel, dtype=torch.uint8, pin_memory=pinned)
    on_device = torch.empty(numel, dtype=torch.uint8, device=device)
    if direction == "h2d":
        ms = time_ms(device, lambda: on_device.copy_(host, non_blocking=pinned), warmup=warmup, trials=trials)
    else:
        ms = time_ms(device, lambda: host.copy_(on_device, non_blocking=pinned), warmup=warmup, trials=trials)
    return rate(ms, numel / GB, "GB/s")


def host_copy_gbs(*, mb: int, trials: int, warmup: int = 2) -> Trials:
    """A memcpy within host memory (the CPU-only machine's copy figure): GB/s read."""
    import torch

    src = torch.ones(mb * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = time_ms(torch.device("cpu"), lambda: dst.copy_(src), warmup=warmup, trials=trials)
    return rate(ms, src.numel() / GB, "GB/s")


def peer_copy_gbs(src: Any, dst: Any, *, mb: int, trials: int, warmup: int = 2) -> Trials:
    """A copy from GPU ``src`` to GPU ``dst`` (NVLink or PCIe peer-to-peer where the pair allows
    it, else staged through the host by the driver), timed on the source's stream."""
    import torch

    a = torch.empty(mb * 2**20, dtype=torch.uint8, device=src)
    b = torch.empty(mb * 2**20, dtype=torch.uint8, device=dst)
    with torch.cuda.device(src):
        ms = time_ms(src, lambda: b.copy_(a, non_blocking=True), warmup=warmup, trials=trials)
    torch.cuda.synchronize(dst)
    return rate(ms, a.numel() / GB, "GB/s")


@dataclass(frozen=True)
class AllReduce:
    """One message size's all-reduce, as ``all_reduce_perf`` prints it (out-of-place aside)."""

    bytes: int
    time_ms: float  # median of the trials
    algbw_gbs: float
    busbw_gbs: float


def allreduce_sweep(device: Any, sizes_mb: list[float], *, trials: int, group: Any = None, warmup: int = 3) -> list[AllReduce]:
    """float32 all-reduces (sum) of each size over ``group``: algbw = bytes / time, busbw = algbw
    x 2(n-1)/n, the figure comparable to a link's speed whatever the number of ranks. Every rank
    of the group must call it with the same sizes. Trials follow each other with no barrier between
    them (as ``all_reduce_perf`` runs them): each all-reduce waits for the slowest rank anyway, and
    a small message's time includes the ranks' skew."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    factor = allreduce_bus_factor(world)
    out: list[AllReduce] = []
    for mb in sizes_mb:
        buf = torch.ones(max(1, int(mb * 2**20) // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buf, group=group)  # connections made outside the timing
        ms = statistics.median(time_ms(device, functools.partial(dist.all_reduce, buf, group=group), warmup=warmup, trials=trials))
        algbw = buf.numel() * 4 / GB / (ms / 1e3)
        out.append(AllReduce(buf.numel() * 4, ms, algbw, algbw * factor))
    return out


@dataclass(frozen=True)
class SyncCheck:
    """What a training-like loop that logs through the recorder every step made the host wait for."""

    steps: int
    host_reads: int  # tensor values handed to Python in the loop (every device)
    device_sync: str | None  # CUDA only: what raised under set_sync_debug_mode("error"), else None
    baseline_sync: str | None  # the same loop without the recorder: a sync here is torch's, not ours
    values_kept: int  # steps whose logged value and timer the recorder returned at the end

    @property
    def clean(self) -> bool:
        return self.host_reads == 0 and self.device_sync is None


def recorder_sync_check(device: Any, recorder: Any, steps: int) -> SyncCheck:
    """Forward, backward and an SGD step, ``recorder.timer`` / ``log`` (a tensor, a float) / ``step()`` every
    step, on ``device``: host reads counted (a TorchFunctionMode, every device) and, on CUDA, run
    under ``torch.cuda.set_sync_debug_mode("error")``, which raises on the first synchronising
    call. The loop runs once without the recorder first: if that raises, the loop itself syncs
    on this torch build and the recorder is not to blame."""
    import torch

    from launcher.workloads.synccount import SyncCounter

    w = torch.randn(256, 256, device=device, requires_grad=True)
    x = torch.randn(64, 256, device=device)
    opt = torch.optim.SGD([w], lr=1e-3, momentum=0.9)

    def train() -> Any:
        loss = (x @ w).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    def step(rec: Any | None) -> None:
        if rec is None:
            train()
            return
        with rec.timer("selftest/step"):  # CUDA events on a GPU
            loss = train()
        rec.log("selftest/loss", loss)  # a device tensor
        rec.log("selftest/lr", 1e-3)  # a host number
        rec.step()

    for _ in range(3):  # lazy initialisation (cuBLAS handles, optimizer state) before the check
        step(None)
    def loop(rec: Any | None) -> None:
        for _ in range(steps):
            step(rec)

    baseline = _under_sync_errors(device, functools.partial(loop, None))
    counter = SyncCounter(device)
    with counter.counting("loop"):
        error = _under_sync_errors(device, functools.partial(loop, recorder))
    host = recorder.to_host()  # after the loop: the one sync and copy the recorder makes
    kept = min(len(host["values"].get("selftest/loss", [])), len(host["times_ms"].get("selftest/step", [])))
    return SyncCheck(steps, counter.host_reads["loop"], error, baseline, kept)


def _under_sync_errors(device: Any, loop: Callable[[], Any]) -> str | None:
    """Run ``loop`` with CUDA's sync debug mode on "error" (the CPU has nothing to sync): what
    the first synchronising call raised, or None."""
    import torch

    if device.type != "cuda":
        loop()
        return None
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loop()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def gpu_sleep_cycles_per_ms(device: Any) -> float:
    """How many ``torch.cuda._sleep`` cycles make a millisecond on this GPU (measured: its clock
    moves with boost and power state), to make a rank slower on its own device by a set time."""
    import torch

    cycles = 2_000_000
    ms = statistics.median(time_ms(device, lambda: torch.cuda._sleep(cycles), warmup=1, trials=3))
    return cycles / max(ms, 1e-3)
