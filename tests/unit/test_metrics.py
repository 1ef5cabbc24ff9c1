"""The on-device recorder keeps values where they are and moves them once at the end."""

from __future__ import annotations

import torch

from launcher.metrics import MetricsRecorder


def test_values_and_timers_come_back_once_in_order():
    rec = MetricsRecorder(torch.device("cpu"))
    firsts = []
    rec = MetricsRecorder(torch.device("cpu"), on_first_step=lambda: firsts.append(1))
    x = torch.arange(4, dtype=torch.float32)
    for i in range(5):
        with rec.timer("step"):
            y = (x * i).sum()
        rec.log("y", y)
        rec.log("lr", 0.1 * i)
        rec.step()
    out = rec.to_host()
    assert out["steps"] == 5 and firsts == [1]
    assert out["values"]["y"] == [float((x * i).sum()) for i in range(5)]
    assert out["values"]["lr"] == [0.1 * i for i in range(5)]
    assert len(out["times_ms"]["step"]) == 5 and all(t >= 0 for t in out["times_ms"]["step"])


def test_log_keeps_a_reference_not_a_python_number():
    rec = MetricsRecorder(torch.device("cpu"))
    value = torch.tensor(3.0)
    rec.log("v", value)
    kept = rec._tensors["v"][0]
    assert isinstance(kept, torch.Tensor) and kept.data_ptr() == value.data_ptr()


def test_step_hooks_get_host_counts():
    rec = MetricsRecorder(torch.device("cpu"))
    seen = []
    rec.add_step_hook(lambda steps, dt: seen.append((steps, dt >= 0)))
    rec.step()
    rec.step()
    assert seen == [(1, True), (2, True)]
