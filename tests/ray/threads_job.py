"""A rank that reports the threads it was given: OMP_NUM_THREADS, torch's intra-op threads, the
context's ``threads`` and the Ray node it runs on (for the per-node thread tests)."""

from __future__ import annotations

import os
from typing import Any


def run(ctx: Any) -> dict[str, Any]:
    import ray
    import torch

    return {
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "ctx_threads": ctx.threads,
        "node_id": ray.get_runtime_context().get_node_id(),
    }
