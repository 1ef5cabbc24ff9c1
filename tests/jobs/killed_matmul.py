"""Test entrypoint: the matmul job whose rank ``params.kill_rank`` is SIGKILLed at its first step
after the job's first checkpoint (one size measured), on the first attempt only (``params.marker``)."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any, Mapping

from launcher.workloads import matmul
from launcher.workloads.matmul import plot  # noqa: F401 - the job's own plots


class Params(matmul.Params):
    kill_rank: int = 1
    marker: str


def run(ctx: Any) -> dict[str, Any]:
    p = Params.model_validate(ctx.params)
    marker = Path(p.marker)
    if not marker.exists() and ctx.rank == p.kill_rank:

        def die_after_the_first_checkpoint(_steps: int, _s: float) -> None:
            if ctx.checkpoint.last_step is not None:
                marker.write_text("killed once\n")
                os.kill(os.getpid(), signal.SIGKILL)

        ctx.metrics.add_step_hook(die_after_the_first_checkpoint)
    return matmul.run(dataclasses.replace(ctx, params=_matmuls(ctx.params)))


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    return matmul.summarize(stages, _matmuls(params))  # the job's own table


def _matmuls(params: Mapping[str, Any]) -> dict[str, Any]:
    own = set(Params.model_fields) - set(matmul.Params.model_fields)
    return {k: v for k, v in params.items() if k not in own}
