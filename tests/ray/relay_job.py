"""A light job for the relay test: every rank prints a numbered line every 0.1 s for
``params.seconds``, counts a step each time, and prints a last line just before it returns."""

from __future__ import annotations

import time
from typing import Any


def run(ctx: Any) -> dict[str, Any]:
    seconds = float(ctx.param("seconds", 5.0))
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        print(f"relay-line rank {ctx.rank} n {n}", flush=True)
        ctx.metrics.step()
        n += 1
        time.sleep(0.1)
    print(f"relay-last rank {ctx.rank} after {n}", flush=True)
    return {"lines": n}
