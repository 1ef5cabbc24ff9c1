"""The on-device recorder keeps values where they are and moves them once at the end."""

from __future__ import annotations

import pytest
import torch

from launcher.runtime.metrics import MetricsRecorder


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


def test_log_keeps_a_tensor_copy_not_a_python_number_nor_a_view():
    rec = MetricsRecorder(torch.device("cpu"))
    value = torch.tensor(3.0)
    rec.log("v", value)
    kept = rec._tensors["v"][0]
    assert isinstance(kept, torch.Tensor) and kept.device == value.device  # no .item(), stays where it was
    assert kept.data_ptr() != value.data_ptr()  # its own storage: later in-place updates do not reach it


def test_an_accumulator_updated_in_place_logs_its_value_at_each_step():
    rec = MetricsRecorder(torch.device("cpu"))
    total = torch.zeros(())
    grads = torch.zeros(3, requires_grad=True)
    for _ in range(3):
        total += 1  # in place, as a running sum in a training loop is
        rec.log("total", total)
        rec.log("first", grads[:1])  # a one-element view of a larger tensor that needs grad
        with torch.no_grad():
            grads += 1
    assert rec.to_host()["values"] == {"total": [1.0, 2.0, 3.0], "first": [0.0, 1.0, 2.0]}


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    rec = MetricsRecorder(torch.device("cpu"))
    rec.log("lr", np.float32(0.5))
    rec.log("epoch", np.int64(2))
    rec.log("ok", True)
    assert rec._tensors == {}  # kept on the host as Python numbers
    assert rec.to_host()["values"] == {"lr": [0.5], "epoch": [2.0], "ok": [1.0]}


@pytest.mark.gpu
def test_values_from_another_device_are_kept_without_a_sync_and_come_back_in_order():
    """A CUDA rank logs a CPU tensor (e.g. a DataLoader's count), its own GPU's and another GPU's
    tensors; inside the loop nothing synchronises (sync debug mode raises otherwise)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    dev = torch.device("cuda", 0)
    other = torch.device("cuda", 1) if torch.cuda.device_count() > 1 else dev
    rec = MetricsRecorder(dev)
    acc = torch.zeros((), device=dev)
    acc_other = torch.zeros((), device=other)
    host = torch.zeros(())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            acc += 1
            acc_other += 10
            host += 100
            rec.log("mixed", acc)
            rec.log("mixed", host)
            rec.log("other", acc_other)
            rec.log("n", 0.5)
            rec.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(t.device in (dev, torch.device("cpu")) for ts in rec._tensors.values() for t in ts)
    values = rec.to_host()["values"]
    assert values["mixed"] == [1.0, 100.0, 2.0, 200.0, 3.0, 300.0]
    assert values["other"] == [10.0, 20.0, 30.0] and values["n"] == [0.5] * 3


def test_step_hooks_get_host_counts():
    rec = MetricsRecorder(torch.device("cpu"))
    seen = []
    rec.add_step_hook(lambda steps, dt: seen.append((steps, dt >= 0)))
    rec.step()
    rec.step()
    assert seen == [(1, True), (2, True)]
