"""Test entrypoint: ``ddp_train`` whose rank ``params.kill_rank`` is SIGKILLed at its step
``params.kill_at``, on the first attempt only (``params.marker`` remembers it), as a rank lost to
a bad host or the OOM killer would be; or that stops ``params.kill_rank``'s own process mid-save
(``params.kill_in_save``: the checkpoint being written is cut short). ``params.kill_at: -1`` kills
nothing; ``params.step_sleep_s`` slows every step (a run long enough to be stopped mid-way)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

from launcher.workloads import train
from launcher.workloads.train import plot, summarize  # noqa: F401 - the job's own table and plots


class Params(train.Params):
    kill_rank: int = 1
    kill_at: int = 10
    marker: str
    kill_in_save: bool = False
    step_sleep_s: float = 0.0


def run(ctx: Any) -> dict[str, Any]:
    p = Params.model_validate(ctx.params)
    marker = Path(p.marker)
    first_attempt = not marker.exists()
    if p.step_sleep_s:
        ctx.metrics.add_step_hook(lambda _steps, _s: time.sleep(p.step_sleep_s))
    if first_attempt and ctx.rank == p.kill_rank and p.kill_at >= 0:
        if p.kill_in_save:
            _die_in_the_save_after(ctx, p.kill_at, marker)
        else:
            ctx.metrics.add_step_hook(lambda steps, _s: _die(marker) if steps == p.kill_at else None)
    own = set(Params.model_fields) - set(train.Params.model_fields)
    return train.run(dataclasses.replace(ctx, params={k: v for k, v in ctx.params.items() if k not in own}))


def _die(marker: Path) -> None:
    marker.write_text("killed once\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _die_in_the_save_after(ctx: Any, step: int, marker: Path) -> None:
    """The save of the first checkpoint after ``step`` dies after it wrote its first bytes (the
    rank that writes: rank 0)."""
    import torch

    original = torch.save

    def half_a_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if ctx.metrics.steps >= step:
            half = b"PK\x03\x04 half a checkpoint"
            f.write(half) if hasattr(f, "write") else Path(f).write_bytes(half)
            _die(marker)
        original(obj, f, *args, **kwargs)

    torch.save = half_a_save
