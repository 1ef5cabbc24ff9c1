"""GPU figures that explain themselves: NVML sampled over a figure's run (fake and recorded NVML,
no GPU here), the summary of the samples, and the words the selftest and the matmul job say."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.hardware.nvml import GpuClocks, GpuSample, GpuSampler, RecordedNvml, summarize_samples
from launcher.workloads import matmul
from launcher.workloads.selftest_report import summarize

NVML_DATA = Path(__file__).parent / "data" / "nvml"


class FakeError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class ScriptedNvml:
    """pynvml's shape for one H100 whose readings follow a script: each sample takes the next row."""

    NVMLError = FakeError

    def __init__(self, rows: list[dict[str, Any]], uuid: str = "GPU-abc") -> None:
        self.rows, self.i, self.uuid = rows, 0, uuid
        self.inits = self.shutdowns = 0

    def _row(self) -> dict[str, Any]:
        return self.rows[min(self.i, len(self.rows) - 1)]

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.uuid

    def nvmlDeviceGetMaxClockInfo(self, h: int, kind: int) -> int:
        return 1980

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        return self._row()["sm"] if kind == 1 else 2619

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._row()["mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return 700_000

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        temperature = self._row().get("c", 60)
        self.i += 1  # the last reading of a sample: the next sample reads the next row
        return temperature

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._row()["mask"]


def test_the_sampler_summarises_clocks_power_and_the_share_of_samples_with_each_reason():
    rows = [{"sm": 1980, "mw": 500_000, "mask": 0}] + [{"sm": 1590 + 10 * i, "mw": 700_000, "mask": 0x04} for i in range(4)]
    nvml = ScriptedNvml(rows)
    with GpuSampler(uuid="GPU-abc", nvml=nvml, interval_s=0.005) as sampler:
        while nvml.i < len(rows):
            time.sleep(0.005)
    c = sampler.clocks
    assert c is not None and c.samples >= 5 and nvml.inits == nvml.shutdowns == 1
    assert (c.sm_mhz_min, c.sm_mhz_max, c.sm_mhz_top, c.mem_mhz_median) == (1590, 1980, 1980, 2619)
    assert c.power_w_max == 700.0 and c.power_limit_w == 700.0 and c.reasons["sw_power_cap"] >= 0.6
    assert c.why() is not None and c.why().startswith("power cap: 700 W reached in ") and "SM clock 1590-1980 MHz" in c.why()
    assert GpuClocks.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_summary_of_samples_and_its_words():
    samples = [GpuSample(i * 0.1, 1590 if i % 5 else 1980, 2619, 700.0, 700.0, 70, ("sw_power_cap",) if i % 5 else ()) for i in range(10)]
    c = summarize_samples(samples, 1980)
    assert c is not None and c.reasons == {"sw_power_cap": 0.8}
    assert c.why() == "power cap: 700 W reached in 80% of samples, SM clock 1590-1980 MHz"
    hot = summarize_samples([GpuSample(0, 1200, None, 300.0, None, 91, ("sw_thermal",)), GpuSample(1, 1300, None, 310.0, None, 92, ())])
    assert hot is not None and hot.why() == "thermal slowdown in 50% of samples (up to 92 C), SM clock 1200-1300 MHz"
    calm = summarize_samples([GpuSample(0, 1980, None, 400.0, 700.0, 50, ())])
    assert calm is not None and calm.why() is None and "SM clock 1980 MHz" in calm.words()
    assert summarize_samples([]) is None


def test_without_nvml_or_a_gpu_the_sampler_samples_nothing_and_never_raises():
    off = GpuSampler(uuid=None)
    with off:
        pass
    assert off.clocks is None and off.why_not == "no GPU"
    missing = RecordedNvml({"system": {"nvmlInit": {"nvml_error": 12}}, "devices": []})
    with GpuSampler(uuid="GPU-x", nvml=missing) as s:
        pass
    assert s.clocks is None and "NVML did not start" in (s.why_not or "")
    other = ScriptedNvml([{"sm": 1, "mw": 1, "mask": 0}], uuid="GPU-other")
    with GpuSampler(uuid="GPU-x", nvml=other) as s:
        pass
    assert s.clocks is None and other.inits == other.shutdowns == 1


def test_the_sampler_reads_a_recorded_node():
    rec = json.loads((NVML_DATA / "h200_1gpu.json").read_text())
    uuid = rec["devices"][0]["nvmlDeviceGetUUID"]
    with GpuSampler(uuid=uuid, nvml=RecordedNvml(rec), interval_s=0.001) as s:
        time.sleep(0.01)
    c = s.clocks
    assert c is not None and c.sm_mhz_min == 345 and c.sm_mhz_top == 1980 and c.power_limit_w is None and c.reasons == {}


# --- the selftest's report and the matmul job's summary ---------------------------------------------

CAPPED = summarize_samples([GpuSample(i * 0.1, 1590 + 39 * (i % 11), 2619, 700.0, 700.0, 64, ("sw_power_cap",) if i % 5 else ())
                            for i in range(50)], 1980)


def _selftest_stage(figures: list[dict[str, Any]], *, uuids: tuple[str, str] = ("GPU-a", "GPU-b"), per_gpu: int = 1,
                    device1: str = "cuda:1") -> list[dict[str, Any]]:
    ranks = []
    for r, (uuid, device) in enumerate(zip(uuids, ("cuda:0", device1))):
        placement = {"device": device, "expected": device, "tensor_device": device, "visible": None, "index": int(device[-1]),
                     "uuid": uuid, "name": "H100", "ranks_per_gpu": per_gpu}
        ranks.append({"rank": r, "host": "n", "status": "ok", "world_size": 2, "result": {
            "placement": placement, "figures": [f for f in figures if f["rank"] == r], "not_run": [],
            "sync_check": {"steps": 5, "host_reads": 0, "device_sync": None, "baseline_sync": None, "clean": True, "cuda": True},
            "straggler": {"slow_rank": 1, "slow_ms": 20.0, "marks": "cuda events"}}})
    return [{"world_size": 2, "status": "succeeded", "ranks": ranks, "stragglers": [{"rank": 1}]}]


def _figure(check: str, rank: int, value: float, **extra: Any) -> dict[str, Any]:
    return {"check": check, "rank": rank, "host": "n", "device": f"cuda:{rank}", "value": value, "low": value, "high": value,
            "unit": "TFLOP/s" if check.startswith("matmul") else "GB/s", "detail": "d", **extra}


def test_the_selftest_says_why_a_figure_ran_slowed_and_sets_it_beside_the_hand_loop():
    assert CAPPED is not None
    ref = {"what": "hand loop", "value": 786.0, "ratio": 780.0 / 786.0, "iters": 1500, "seconds": 2.1, "figure_seconds": 2.0, "n": 8192}
    figures = [_figure("matmul_bf16", 0, 780.0, clocks=CAPPED.to_dict(), reference=ref), _figure("matmul_bf16", 1, 700.0)]
    s = summarize(_selftest_stage(figures), {"level": "full"})
    said = "\n".join(s["conclusions"])
    assert "matmul bf16 on n cuda:0 (780 TFLOP/s) ran slowed: power cap: 700 W reached in 80% of samples, SM clock 1590-1980 MHz" in said
    assert "0.992 of a hand loop's 786 TFLOP/s right after (n=8192, 2 s timed vs the loop's 2.1 s): within 3%" in said
    hand = [f for f in s["figures"] if f["check"] == "matmul_bf16_hand"]
    assert len(hand) == 1 and hand[0]["value"] == 786.0 and hand[0]["verdict"] == "-"
    assert "gpu_clocks" in s["columns"] and "power cap 80%" in s["rows"][0]["gpu_clocks"]
    far = {**ref, "ratio": 727.0 / 786.0}
    s = summarize(_selftest_stage([_figure("matmul_bf16", 0, 727.0, reference=far)]), {})
    assert "NOT within 3%" in "\n".join(s["conclusions"])


def test_ranks_sharing_a_gpu_pass_placement_when_asked_and_fail_when_not():
    figures = [_figure("allreduce_node", 0, 3.0, backend="gloo", shared=True, device="")]
    asked = summarize(_selftest_stage(figures, uuids=("GPU-a", "GPU-a"), per_gpu=2, device1="cuda:0"), {})
    placement = [c for c in asked["checks"] if c["check"] == "placement"]
    assert all(c["passed"] for c in placement) and any("as ranks_per_gpu=2 asks" in c["detail"] for c in placement)
    (allreduce,) = [f for f in asked["figures"] if f["check"] == "allreduce_node"]
    assert allreduce["limit"] is None and allreduce["verdict"] == "-"
    unasked = summarize(_selftest_stage(figures, uuids=("GPU-a", "GPU-a"), per_gpu=1, device1="cuda:0"), {})
    bad = [c for c in unasked["checks"] if c["check"] == "placement" and not c["passed"]]
    assert len(bad) == 1 and "2 ranks share 1 GPU(s)" in bad[0]["detail"] and "ranks_per_gpu is 1" in bad[0]["detail"]
    assert unasked["passed"] is False


def test_the_matmul_summary_gives_each_size_its_duration_and_says_why_it_ran_slowed():
    assert CAPPED is not None
    p = matmul.Params(sizes=(8192,), iters=10, trials=3)
    ms = [1400.0, 1410.0, 1420.0]
    ranks = [{"rank": 0, "host": "h", "device": "cuda:0", "status": "ok", "world_size": 1,
              "metrics": {"times_ms": {"matmul/8192": ms}, "values": {}},
              "result": {"threads": 16, "threads_policy": "share", "clocks": {"8192": CAPPED.to_dict()}}}]
    s = matmul.summarize([{"status": "succeeded", "world_size": 1, "ranks": ranks}], p.model_dump())
    (row,) = s["rows"]
    assert row["timed_s"] == pytest.approx(4.23) and row["shared_gpu"] is False and row["clocks"]["sm_mhz_min"] == 1590
    said = "\n".join(s["conclusions"])
    assert "1 worker(s) at n=8192 ran slowed (4.23 s of timed trials): power cap: 700 W reached in 80% of samples" in said


def test_the_matmul_summary_without_nvml_says_nothing_of_clocks():
    p = matmul.Params(sizes=(64,), iters=2, trials=3)
    ranks = [{"rank": 0, "host": "h", "device": "cpu", "status": "ok", "world_size": 1,
              "metrics": {"times_ms": {"matmul/64": [1.0, 1.0, 1.0]}, "values": {}}, "result": {"threads": 1}}]
    s = matmul.summarize([{"status": "succeeded", "world_size": 1, "ranks": ranks}], p.model_dump())
    assert s["rows"][0]["clocks"] is None and s["rows"][0]["why"] is None
    assert not any("ran slowed" in line or "GPU SM" in line for line in s["conclusions"])


# --- ranks that share a GPU, with ctx stubs -------------------------------------------------------------


def test_sharing_is_the_specs_ranks_per_gpu_on_a_gpu_and_one_on_the_cpu():
    from types import SimpleNamespace

    from launcher.workloads.selftest import in_turns, sharing

    gpu = SimpleNamespace(type="cuda", index=0)
    assert sharing(SimpleNamespace(device=gpu, ranks_per_gpu=2)) == 2
    assert sharing(SimpleNamespace(device=gpu)) == 1  # an older context: one rank per GPU
    assert sharing(SimpleNamespace(device=SimpleNamespace(type="cpu"), ranks_per_gpu=2)) == 1
    alone = SimpleNamespace(device=gpu, ranks_per_gpu=1, local_rank=0)
    assert in_turns(alone, None, lambda: 42) == 42  # its own GPU: no turns, no barrier


def test_the_ping_pong_stages_through_the_host_where_gloo_carries_it():
    import torch

    from launcher.workloads import transfer

    sent: list[Any] = []

    class Dist:
        def send(self, t: Any, peer: int) -> None:
            sent.append((t.device.type, peer))

        def recv(self, t: Any, peer: int) -> None:
            t.fill_(7.0)

    buf = torch.zeros(4)
    transfer._ping(Dist(), buf, True)
    assert sent == [("cpu", 1)] and buf.tolist() == [7.0] * 4


def test_the_levels_warm_up_in_time_and_full_sets_the_hand_loop_beside_the_figure():
    from launcher.workloads.selftest import LEVELS, Params

    assert all(level.warmup_s >= 1.0 and level.trial_s > 0 and level.matmul_trials >= 10 for level in LEVELS.values())
    assert LEVELS["full"].hand_loop and not LEVELS["quick"].hand_loop
    assert Params.model_validate({"hand_loop": True}).hand_loop is True
