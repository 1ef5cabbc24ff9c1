"""A light job for the live-monitoring tests: every rank counts a step every ``params.step_s`` for
``params.seconds``, asleep in between, so that a run stays live for several scrapes whatever the
machine's speed and leaves the cores to the rest of the suite meanwhile.

``params.trace_dir``: each rank also writes when it did each step (``time.time()``, one list, at
the end: nothing in the step loop) to ``<trace_dir>/rank<k>.json``, the truth a test compares
Prometheus's figures to."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def run(ctx: Any) -> dict[str, Any]:
    seconds, step_s = float(ctx.param("seconds", 8.0)), float(ctx.param("step_s", 0.02))
    trace_dir = ctx.param("trace_dir")
    end, steps = time.monotonic() + seconds, 0
    times: list[float] = []
    while time.monotonic() < end:
        time.sleep(step_s)
        ctx.metrics.step()
        steps += 1
        if trace_dir:
            times.append(time.time())
    if trace_dir:
        Path(trace_dir, f"rank{ctx.rank}.json").write_text(json.dumps(times))
    return {"steps": steps}
