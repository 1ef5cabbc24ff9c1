"""An entrypoint that reports where its rank process came from (``test_start_method.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
        "parent_cmdline": _cmdline(parent),
        "parent_name": Path(f"/proc/{parent}/comm").read_text().strip(),
        "grandparent_cmdline": _cmdline(_parent_of(parent)),
        "sum": float(value.item()),
        "stage_dir_env": os.environ.get("GPULAUNCH_STAGE_DIR"),
    }


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])
