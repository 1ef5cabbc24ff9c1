"""A light job for the live-monitoring tests: every rank counts a step every ``params.step_s`` for
``params.seconds``, asleep in between, so that a run stays live for several scrapes whatever the
machine's speed and leaves the cores to the rest of the suite meanwhile."""

from __future__ import annotations

import time
from typing import Any


def run(ctx: Any) -> dict[str, Any]:
    seconds, step_s = float(ctx.param("seconds", 8.0)), float(ctx.param("step_s", 0.02))
    end, steps = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        time.sleep(step_s)
        ctx.metrics.step()
        steps += 1
    return {"steps": steps}
