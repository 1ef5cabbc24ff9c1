"""The start-up benchmark's job: join the process group, do one all-reduce, count one step.

``launch benchmarks/jobs/allreduce.yaml`` runs ``run`` in every rank (the launcher's worker has
already initialised the process group); ``bare_allreduce.py`` is the same work as a plain
torchrun script. Nothing else happens, so the wall time is the launcher's (or torchrun's) cost.
"""

from __future__ import annotations

from typing import Any


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    value = torch.ones(1, device=ctx.device)
    dist.all_reduce(value)
    ctx.metrics.step()  # the worker stamps phases["first_step"] here
    return {"sum": float(value.item())}  # after the step: the one read-back of the job
