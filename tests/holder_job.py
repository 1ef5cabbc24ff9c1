"""A job that runs until the test lets it end: it steps (one every 50 ms) until the file named by
``params.release`` exists, saying so now and then. The detach/attach tests ship this file as the
job's own code (a Ray job's working directory, a Slurm job's folder)."""

import os
import time


def run(ctx):
    """Steps (one every 50 ms) until params.release exists, saying so now and then."""
    n = 0
    while not os.path.exists(ctx.param("release")):
        n += 1
        time.sleep(0.05)
        ctx.metrics.step()
        if n % 20 == 0:
            print(f"holder: rank {ctx.rank} step {n}", flush=True)
    return {"steps": n}
