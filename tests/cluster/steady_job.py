"""A job for the cluster tests that must catch ranks mid-run: each rank says where it runs (its
pid and host, in a file outside the run root, written by a rename), then steps like a training
loop (an all-reduce and a short sleep per step) until it is stopped."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    out = Path(ctx.params["out"])
    (out / f".rank{ctx.rank}").write_text(json.dumps({"pid": os.getpid(), "host": ctx.host}))
    os.replace(out / f".rank{ctx.rank}", out / f"rank{ctx.rank}.json")
    value = torch.ones(1)
    while True:
        dist.all_reduce(value)
        ctx.metrics.step()
        time.sleep(0.1)
