"""A synchronous DDP job in which one rank does extra work before its all-reduce every step.

Nothing in it knows about straggler detection (the runtime times the DDP model through its
gradients and optimizer steps) unless ``sections`` is set: then it all-reduces by hand and marks
its own work with ``ctx.metrics.work()``. The extra work is a sleep: the same to a clock as compute, and kind to a
2-core machine running the other ranks.
"""

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def run(ctx):
    slow_rank, extra_s = ctx.param("slow_rank", 1), ctx.param("extra_s", 0.02)
    duration_s = ctx.param("duration_s", 4.0)
    idle_s = ctx.param("idle_s", 0.0)  # every rank, between steps: outside its own work
    # every rank's own work, in its step: with none, a rank's own work is a few ms, and on a loaded
    # machine a peer preempted for a few ms a step looks 1.5x slower than its median for seconds
    base_s = ctx.param("base_s", 0.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32).to(ctx.device)
    by_hand = ctx.param("sections", False)
    if not by_hand:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, started = 0, time.perf_counter()
    while True:
        # every rank agrees on going on (rank 0's clock decides): the same number of steps for all
        go = torch.tensor([1 if time.perf_counter() - started < duration_s else 0])
        dist.broadcast(go, src=0)
        if not go.item():
            break
        if by_hand:
            with ctx.metrics.work():
                _own_work(ctx, model, opt, slow_rank, extra_s, base_s)
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
        else:
            _own_work(ctx, model, opt, slow_rank, extra_s, base_s)
            opt.step()
        ctx.metrics.step()
        steps += 1
        if idle_s:
            time.sleep(idle_s)
    return {"steps": steps}


def _own_work(ctx, model, opt, slow_rank, extra_s, base_s):
    time.sleep(base_s + (extra_s if ctx.rank == slow_rank else 0.0))
    x = torch.randn(16, 32, device=ctx.device)
    opt.zero_grad()
    model(x).square().mean().backward()
