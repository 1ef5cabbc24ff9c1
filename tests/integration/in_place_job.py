"""A small DDP job that opts in to recovery in place (``ctx.checkpoint.in_place``), for
``test_in_place.py`` (and ``tests/gpu/test_in_place_gpu.py``: on the rank's GPU): an MLP with Adam, each step's batch drawn from a generator seeded by the
step and the rank (the data order is deterministic whatever restarts), a checkpoint every
``params.checkpoint_every`` steps, the final model's SHA-256 in its result.

``params.kill_at``: rank ``params.victim`` SIGKILLs itself at the start of that step, once
(``params.marker`` remembers it across processes). ``params.replacement: fail``: a rank that
replaces a lost one in place exits at once (code 3), before it joins: the keeper must fall back
to the restart path; ``params.replacement: hang``: it joins the group and then sleeps, so the
recovery times out (``params.wait_s``). ``params.wait_s`` (600 by default: a hang guard, never reached where the
recovery works) bounds the recovery.

``params.kill_in_save_at``: rank ``params.victim`` SIGKILLs itself as its save of that step
begins, once (over several hosts its peers are in the save's broadcast then).

``params.stall_at``: rank ``params.victim`` stops at the start of that step, once (the marker
names its pid), its peers waiting for it in their next collective: a test powers its host off there.

``prepare`` (the spec's ``prepare``, with ``checkpoint.warm_spares``): the model and optimizer built
before the rank is known, each call's pid appended to ``params.prepared_log``; ``run`` then takes
them from ``ctx.prepared``. ``params.await_spare``: the victim dies only once a warm spare has
prepared (its ready file under the stage's ``in_place/``), so the spare that takes its place is
ready whatever the machine's speed; with ``params.spare_dies`` the spare exits in its ``prepare``
instead, and the victim dies once it is gone.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any


def _build() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def prepare(params: Any) -> tuple[Any, Any]:
    with open(params["prepared_log"], "a") as log:
        log.write(f"{os.getpid()}\n")
    if params.get("spare_dies") and "LOCAL_RANK" not in os.environ:  # a spare (no rank yet) that dies waiting
        os._exit(5)
    return _build()


def _await_spare(ctx: Any) -> None:
    """Until a spare is ready (its ready file), or, with ``params.spare_dies``, until the spare
    that prepared is gone (its pid the log's third line, after the two ranks')."""
    ready = Path(ctx.stage_dir) / "in_place" / "attempt0"
    deadline = time.monotonic() + 120  # a hang guard: a spare prepares in well under a second
    while time.monotonic() < deadline:
        if ctx.param("spare_dies"):
            pids = Path(ctx.param("prepared_log")).read_text().split()
            if len(pids) >= 3 and _gone(int(pids[2])):
                return
        elif any(ready.glob("spare.*.json")):
            return
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"  # ended, not reaped yet
    except OSError:
        return True


def run(ctx: Any) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ctx.param("replacement") == "fail" and os.environ.get("GPULAUNCH_IN_PLACE_GEN"):
        os._exit(3)
    if ctx.param("replacement") == "hang" and os.environ.get("GPULAUNCH_IN_PLACE_GEN"):
        time.sleep(3600)  # joined the group, never takes the state: the keeper's wait_s must name this line
    steps, every = int(ctx.param("steps", 30)), int(ctx.param("checkpoint_every", 10))
    model, opt = ctx.prepared if ctx.prepared is not None else _build()
    model.to(ctx.device)  # cuda:<local_rank // ranks_per_gpu> on a GPU node (the same Parameter objects: Adam keeps them)
    start = 0
    if (restored := ctx.checkpoint.load()) is not None:
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["opt"])
        start = restored.step
    live = ctx.checkpoint.in_place(model, opt, wrap=lambda m: DDP(m), step=start, wait_s=float(ctx.param("wait_s", 600)))
    first = live.step

    def train_step(step: int) -> None:
        if step == int(ctx.param("stall_at", -1)) and ctx.rank == int(ctx.param("victim", 1)):
            marker = Path(ctx.param("marker"))
            if not marker.exists():  # once: the test takes the host down while its peers wait for this rank
                marker.write_text(f"{os.getpid()}\n")
                time.sleep(3600)
        if step == int(ctx.param("kill_at", -1)) and ctx.rank == int(ctx.param("victim", 1)):
            marker = Path(ctx.param("marker"))
            if not marker.exists():
                if ctx.param("await_spare"):
                    _await_spare(ctx)
                marker.write_text(f"{os.getpid()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        data = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x, y = torch.randn(16, 32, generator=data).to(ctx.device), torch.randint(0, 4, (16,), generator=data).to(ctx.device)
        loss = torch.nn.functional.cross_entropy(live.model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ctx.metrics.step()

    for step in range(first, steps):
        live.run(train_step, step)
        if (step + 1) % every == 0:
            if step + 1 == int(ctx.param("kill_in_save_at", -1)) and ctx.rank == int(ctx.param("victim", 1)):
                marker = Path(ctx.param("marker"))
                if not marker.exists():  # once: the rank dies as its save begins, its peers in theirs
                    marker.write_text(f"{os.getpid()}\n")
                    os.kill(os.getpid(), signal.SIGKILL)
            ctx.checkpoint.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step + 1)
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return {"model_sha256": digest.hexdigest(), "first_step": first, "steps": steps, "gen": live.gen, "pid": os.getpid()}
