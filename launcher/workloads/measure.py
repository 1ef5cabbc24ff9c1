"""Measuring inside a rank: the device's clock, repeated trials that every rank runs together,
torch's threads, the machine's load, and a host-side barrier group.

torch is imported lazily: the launcher imports the workloads before it spawns anything.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from launcher.workloads.params import DtypeName

# The most trials a time budget (``min_time_s``) may add.
MAX_TRIALS = 100


def torch_dtype(name: DtypeName) -> Any:
    import torch

    return getattr(torch, name)


def sync(device: Any) -> None:
    """Wait for the device (no-op on the CPU, where every op is synchronous)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


@contextmanager
def wall_clock(device: Any) -> Iterator[Callable[[], float]]:
    """Host wall time of a block, with the device drained before and after: ``with ... as ms: ...; ms()``."""
    sync(device)
    t0 = time.perf_counter()
    out: list[float] = []
    yield lambda: out[0]
    sync(device)
    out.append((time.perf_counter() - t0) * 1e3)


def trial_loop(device: Any, count: int, min_time_s: float = 0.0, *, group: Any = None, together: bool = True) -> Iterator[int]:
    """Trial indices 0, 1, ...: at least ``count`` of them, more (up to ``MAX_TRIALS``) while the
    trials so far took less than ``min_time_s``. The device is drained after each trial (outside
    the timed block) so that the next starts on an idle device.

    ``together``: every rank runs the same number of trials and starts each at the same moment:
    before each trial the ranks agree on going on with one small all-reduce on a host (gloo)
    group, which is also the barrier that lines them up. Ranks measured one at a time pass
    ``together=False``.
    """
    import torch
    import torch.distributed as dist

    agree = together and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    started = time.perf_counter()
    i = 0
    while True:
        more = i < count or (min_time_s > 0 and i < max(MAX_TRIALS, count) and time.perf_counter() - started < min_time_s)
        if agree:
            flag = torch.tensor([1 if more else 0], dtype=torch.int32)  # on the host: no device sync
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            more = bool(flag[0])
        if not more:
            return
        yield i
        sync(device)
        i += 1


def set_threads(ctx: Any, threads_per_rank: Any) -> dict[str, Any]:
    """Apply ``threads_per_rank`` (see ``ThreadsPerRank``) in this rank; what it ran with, for the summary."""
    import torch

    if threads_per_rank == "share" or (threads_per_rank is None and ctx.device.type == "cuda"):
        policy = "share"
    else:
        torch.set_num_threads(1 if threads_per_rank is None else int(threads_per_rank))
        policy = "fair" if threads_per_rank is None else "set"
    return {"threads": torch.get_num_threads(), "threads_policy": policy, "launcher_share": ctx.threads}


def machine_state() -> dict[str, Any]:
    """This node's usable cores and load average (1, 5, 15 min), read on the host: no device involved."""
    from launcher.hardware.devices import usable_cpu_count

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cores": usable_cpu_count(), "load_avg": load}


def host_barrier_group(dist: Any, ctx: Any) -> Any:
    """A gloo group for barriers around host-side measurements (``None``: the default group).

    A rank waiting in an NCCL barrier may spin a CPU core; one waiting in gloo sleeps in a socket
    read, so ranks that wait while another times the CPU or the host's memory leave it alone.
    """
    return dist.new_group(backend="gloo") if ctx.pg_backend != "gloo" else None


def device_name(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return "cpu"


def device_uuid(device: Any) -> str | None:
    """The UUID of ``device``'s GPU as NVML spells it ("GPU-..."); None on the CPU or where torch
    does not say."""
    if device.type != "cuda":
        return None
    import torch

    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    return "GPU-" + uuid.removeprefix("GPU-") if uuid else None


def gpu_sampler(device: Any, *, interval_s: float = 0.02) -> Any:
    """A ``GpuSampler`` of ``device``'s GPU (its clocks, power and clock-event reasons while in a
    ``with``); on the CPU or without NVML one that samples nothing (its ``clocks`` stay None)."""
    from launcher.hardware.nvml import GpuSampler

    uuid = device_uuid(device)
    return GpuSampler(uuid=uuid, interval_s=interval_s, enabled=uuid is not None)


def clocks_dict(sampler: Any) -> dict[str, Any] | None:
    """A finished sampler's summary as ``result.json`` keeps it (None: nothing sampled)."""
    clocks = getattr(sampler, "clocks", None)
    return None if clocks is None else dict(clocks.to_dict())
