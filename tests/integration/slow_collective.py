"""Test entrypoint: one rank is late, the others wait for it (tests/integration/test_collective_timeout.py).

``params.late_rank`` sleeps ``params.sleep_s`` before an all-reduce the others are already in, as
a rank 0 saving a checkpoint does. With ``SLOW_IMPORT_RANK``/``SLOW_IMPORT_S`` in the environment,
that rank is late *before the rendezvous* instead: the worker imports this module before it joins
the process group.
"""

from __future__ import annotations

import os
import time
from typing import Any

if os.environ.get("SLOW_IMPORT_RANK") is not None and os.environ.get("SLOW_IMPORT_RANK") == os.environ.get("RANK"):
    time.sleep(float(os.environ.get("SLOW_IMPORT_S", "0")))


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if ctx.rank == int(ctx.params.get("late_rank", 0)):
        time.sleep(float(ctx.params.get("sleep_s", 0)))
    value = torch.ones(1, device=ctx.device)
    dist.all_reduce(value)
    ctx.metrics.step()
    return {"sum": float(value.item())}
