"""A small DDP job that opts in to recovery in place (``ctx.checkpoint.in_place``), for
``test_in_place.py``: an MLP with Adam, each step's batch drawn from a generator seeded by the
step and the rank (the data order is deterministic whatever restarts), a checkpoint every
``params.checkpoint_every`` steps, the final model's SHA-256 in its result.

``params.kill_at``: rank ``params.victim`` SIGKILLs itself at the start of that step, once
(``params.marker`` remembers it across processes). ``params.replacement: fail``: a rank that
replaces a lost one in place exits at once (code 3), before it joins: the keeper must fall back
to the restart path. ``params.wait_s`` (600 by default: a hang guard, never reached where the
recovery works) bounds the recovery.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any


def run(ctx: Any) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ctx.param("replacement") == "fail" and os.environ.get("GPULAUNCH_IN_PLACE_GEN"):
        os._exit(3)
    steps, every = int(ctx.param("steps", 30)), int(ctx.param("checkpoint_every", 10))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    start = 0
    if (restored := ctx.checkpoint.load()) is not None:
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["opt"])
        start = restored.step
    live = ctx.checkpoint.in_place(model, opt, wrap=lambda m: DDP(m), step=start, wait_s=float(ctx.param("wait_s", 600)))
    first = live.step

    def train_step(step: int) -> None:
        if step == int(ctx.param("kill_at", -1)) and ctx.rank == int(ctx.param("victim", 1)):
            marker = Path(ctx.param("marker"))
            if not marker.exists():
                marker.write_text(f"{os.getpid()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        data = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)
        loss = torch.nn.functional.cross_entropy(live.model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ctx.metrics.step()

    for step in range(first, steps):
        live.run(train_step, step)
        if (step + 1) % every == 0:
            ctx.checkpoint.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step + 1)
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return {"model_sha256": digest.hexdigest(), "first_step": first, "steps": steps, "gen": live.gen}
