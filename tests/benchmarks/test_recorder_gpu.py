"""On a GPU: the metrics recorder adds no host synchronisation inside a step loop.

The loop (``launcher.workloads.probes.recorder_sync_check``: forward, backward, optimiser step,
``timer``, ``log`` of a device tensor and of a float, ``step``) runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any
synchronising call; ``to_host`` runs after the mode is reset and returns every value.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_recorder_adds_no_host_sync_in_the_step_loop():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from benchmarks.recorder_overhead import sync_debug_check

    out = sync_debug_check(torch, torch.device("cuda", 0), steps=50)
    if out["baseline_error"] is not None:
        pytest.skip(f"the plain loop already syncs on this torch build: {out['baseline_error']}")
    assert out["error"] is None, out["error"]
    assert out["values_copied"] == 50 and out["host_reads"] == 0
