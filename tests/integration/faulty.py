"""Fault-injection workloads for the reliability tests (issue 6), selected by ``params``.

``entrypoint: tests.integration.faulty:run`` with ``params.fault`` one of:

- ``none``: every rank joins one all-reduce and returns (a healthy job).
- ``raise``: rank ``params.rank`` raises ``ValueError``; the others block in an all-reduce
  that only the fail-fast teardown can end (the gloo timeout is an hour).
- ``exit``: rank ``params.rank`` calls ``os._exit(params.code)`` (no Python exception at all).
- ``sleep``: every rank writes its pid and sleeps, so a test can SIGKILL one by pid.
- ``hang``: rank ``params.rank`` spins in ``stuck_in_python`` forever, the others block in an
  all-reduce; only ``timeouts.run_s`` ends it.
- ``flaky``: its process dies on the first attempt only (``os._exit``, as a lost rank would; a marker
  file in ``params.marker``), then works.

With ``params.var`` set, every rank prints that env variable (and a raise quotes it), as a careless
job would print a token: the launcher must mask it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_FOREVER_S = 3600.0


def run(ctx: Any) -> dict[str, Any]:
    fault = ctx.param("fault", "none")
    target = int(ctx.param("rank", 0))
    print(f"faulty: rank {ctx.rank} pid {os.getpid()} fault {fault}", flush=True)
    if ctx.param("var"):  # a careless job that prints a secret: the launcher must mask it
        print(f"{ctx.param('var')}={os.environ.get(ctx.param('var'), '')}", flush=True)
    if fault == "raise" and ctx.rank == target:
        time.sleep(float(ctx.param("delay_s", 0.5)))
        leak = f" ({ctx.param('var')}={os.environ.get(ctx.param('var'), '')})" if ctx.param("var") else ""
        raise ValueError(f"injected failure on rank {ctx.rank}{leak}")
    if fault == "exit" and ctx.rank == target:
        time.sleep(float(ctx.param("delay_s", 0.5)))
        print(f"faulty: exiting at {time.time()!r}", flush=True)
        os._exit(int(ctx.param("code", 3)))
    if fault == "sleep":
        return {"slept": _sleep(ctx)}
    if fault == "hang" and ctx.rank == target:
        stuck_in_python(float(ctx.param("hang_s", _FOREVER_S)))
    if fault == "flaky":
        marker = Path(ctx.param("marker"))
        if ctx.rank == target and not marker.exists():
            marker.write_text("failed once\n")
            print("transient failure (first attempt only)", flush=True)
            os._exit(3)
    if fault in ("raise", "exit", "hang") or ctx.world_size > 1:
        _all_reduce(ctx)
    ctx.metrics.step()
    return {"rank": ctx.rank, "fault": fault}


def _sleep(ctx: Any) -> float:
    seconds = float(ctx.param("sleep_s", _FOREVER_S))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
    return seconds


def stuck_in_python(seconds: float) -> None:
    """A rank stuck in pure Python: the name the faulthandler dump must show. It mostly sleeps, so
    that the stuck rank leaves the machine's cores to the other tests meanwhile."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1
        if x % 1000 == 0:
            time.sleep(0.01)


def _all_reduce(ctx: Any) -> None:
    import torch
    import torch.distributed as dist

    if ctx.world_size > 1:
        t = torch.ones(1)
        dist.all_reduce(t)
