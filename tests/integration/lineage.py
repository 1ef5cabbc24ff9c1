"""An entrypoint that reports where its rank process came from (``test_start_method.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    dist.all_reduce(value)
    ctx.metrics.step()
    parent = os.getppid()
    return {
        "pid": os.getpid(),
        "parent_pid": parent,
        "parent_cmdline": " ".join(psutil.Process(parent).cmdline()),
        "parent_name": Path(f"/proc/{parent}/comm").read_text().strip(),  # what prctl(PR_SET_NAME) set
        "grandparent_cmdline": " ".join(psutil.Process(psutil.Process(parent).ppid()).cmdline()),
        "sum": float(value.item()),
        "stage_dir_env": os.environ.get("GPULAUNCH_STAGE_DIR"),
    }

