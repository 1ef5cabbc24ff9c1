"""A job that counts steps around collectives, and hangs on purpose (``params.hang``) at step
``params.at`` on rank ``params.rank``. Nothing in it knows about hang detection.

- ``sleep``: the rank sleeps forever between two collectives; the others wait in the next one.
- ``skip``: the rank skips that step's all-reduce and goes on to the step's broadcast, so the
  others wait in an all-reduce it never enters (and it waits in a broadcast they never reach).
- ``stop``: the rank freezes its own process (SIGSTOP): no stack of its own, no beacon.
- ``lock``: a helper thread of the rank takes a lock and never lets go; the main thread waits on it.
- ``pause`` (no hang): every rank pauses ``params.pause_s`` at that step (a checkpoint), and the
  steps take irregular times throughout (``params.jitter_s``).
- ``early`` (no hang): the ranks step on their own (no collectives) and the target rank stops
  after ``params.at`` steps and returns, while the others go on to ``params.steps``.
- ``none``: ``params.steps`` steps and the end.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

FOREVER_S = 3600.0


def run(ctx: Any) -> dict[str, Any]:
    hang, target, at = ctx.param("hang", "none"), int(ctx.param("rank", 1)), int(ctx.param("at", 20))
    steps, step_s, jitter_s = int(ctx.param("steps", 10**9)), float(ctx.param("step_s", 0.02)), float(ctx.param("jitter_s", 0.0))
    rng = random.Random(ctx.rank)
    grads, flag = torch.ones(8, device=ctx.device), torch.zeros(1, device=ctx.device)
    for step in range(steps):
        if step == at and ctx.rank == target and hang in HANGS:
            if HANGS[hang](grads, flag):
                continue
        if step == at and hang == "pause":
            time.sleep(float(ctx.param("pause_s", 1.0)))
        if step == at and hang == "early" and ctx.rank == target:
            return {"steps": step}  # done: its share was smaller
        time.sleep(step_s + rng.uniform(0, jitter_s))  # the step's own work
        if hang != "early":
            dist.all_reduce(grads)
            dist.broadcast(flag, src=0)
        ctx.metrics.step()
    return {"steps": steps}


def _sleep(grads: torch.Tensor, flag: torch.Tensor) -> bool:
    time.sleep(FOREVER_S)
    return False


def _skip(grads: torch.Tensor, flag: torch.Tensor) -> bool:
    dist.broadcast(flag, src=0)  # the all-reduce before it skipped
    return True


def _stop(grads: torch.Tensor, flag: torch.Tensor) -> bool:
    # to this thread: it stops on the way out of this call (a Ray actor runs the rank on a thread
    # of its own, which a signal to the process would let run on a little)
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    return False


def _lock(grads: torch.Tensor, flag: torch.Tensor) -> bool:
    lock, never = threading.Lock(), threading.Event()

    def hold() -> None:
        with lock:
            never.wait()

    threading.Thread(target=hold, name="holder", daemon=True).start()
    time.sleep(0.2)
    with lock:  # never acquired: the holder keeps it
        pass
    return False


HANGS = {"sleep": _sleep, "skip": _skip, "stop": _stop, "lock": _lock}
