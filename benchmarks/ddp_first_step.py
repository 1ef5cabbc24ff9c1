"""The hand-run comparison's job: a small DDP model, a few steps; every rank says when it made its first.

The same code runs two ways: as ``launch``'s entrypoint (``run(ctx)``: the launcher's worker has
initialised the process group) and as a plain torchrun script (``python -m torch.distributed.run
... benchmarks/ddp_first_step.py``: it initialises the group itself), so that the two are timed
on identical work. After its first optimizer step each rank prints ``gl-first-step RANK TIME``
(wall clock), the moment the launcher's worker stamps ``first_step`` too (``ctx.metrics.step()``).
"""

from __future__ import annotations

import os
import time
from typing import Any

STEPS = 20


def train(rank: int, device: Any, on_step: Any = None) -> int:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x = torch.randn(32, 64, device=device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step == 0:
            print(f"gl-first-step {rank} {time.time():.6f}", flush=True)
        if on_step is not None:
            on_step()
    return STEPS


def run(ctx: Any) -> dict[str, Any]:
    return {"steps": train(ctx.rank, ctx.device, ctx.metrics.step)}


def main() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    train(dist.get_rank(), torch.device("cpu"))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
