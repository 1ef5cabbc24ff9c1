"""Cost of the on-device metrics recorder inside a step loop.

1. Per call: ``log(tensor)``, ``log(float)``, ``step()`` and ``timer()`` in microseconds, each timed
   over a block of calls (median of several blocks), against the target of 1% of a 1 ms step
   (10 us per recorded value).
2. In a loop of ~1 ms steps (a matmul sized to take ~1 ms here): the same loop with and without a
   ``log`` + ``step`` per step, interleaved, median step time of each.
3. On a GPU (``--device cuda``, the default when one is present): the loop runs under
   ``torch.cuda.set_sync_debug_mode("error")`` with the recorder active, so any host
   synchronisation inside the loop raises; ``to_host`` runs after the mode is reset.

    python benchmarks/recorder_overhead.py [--smoke | --full] [--device cpu|cuda]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import base_parser, fmt, has_gpu, machine_info, summary, write_result  # noqa: E402

TARGET_US = 10.0  # 1% of a 1 ms step


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(torch: Any, device: Any, calls: int, blocks: int) -> dict[str, Any]:
    from launcher.runtime.metrics import MetricsRecorder

    value = torch.ones((), device=device)

    def block(op: Callable[[Any], None]) -> float:
        rec = MetricsRecorder(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            op(rec)
        return (time.perf_counter() - t0) / calls * 1e6

    def timer_op(rec: Any) -> None:
        with rec.timer("t"):
            pass

    ops: dict[str, Callable[[Any], None]] = {
        "empty_loop": lambda rec: None,
        "log_tensor": lambda rec: rec.log("loss", value),
        "log_float": lambda rec: rec.log("lr", 0.1),
        "step": lambda rec: rec.step(),
        "timer": timer_op,
    }
    samples: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(blocks):
        for name, op in ops.items():  # interleaved: noise hits every op alike
            samples[name].append(block(op))
    floor = statistics.median(samples["empty_loop"])
    out = {}
    for name, xs in samples.items():
        s = summary(xs)
        s["net_us"] = round(s["median"] - floor, 4) if name != "empty_loop" else 0.0
        out[name] = s
    # the one-off end-of-run copy, per recorded value
    rec = MetricsRecorder(device)
    for _ in range(calls):
        rec.log("loss", value + 0)
        rec.step()
    _sync(torch, device)
    t0 = time.perf_counter()
    rec.to_host()
    out["to_host_per_value"] = {"median": round((time.perf_counter() - t0) / calls * 1e6, 4), "values_recorded": calls}
    return out


def step_loop(torch: Any, device: Any, steps: int, reps: int, target_ms: float = 1.0) -> dict[str, Any]:
    """~1 ms steps with and without recording; returns median step time of each and the overhead."""
    from launcher.runtime.metrics import MetricsRecorder

    n = 64
    while True:  # size the matmul so one step takes about target_ms on this device
        a = torch.randn(n, n, device=device)
        for _ in range(3):
            a @ a
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        _sync(torch, device)
        ms = (time.perf_counter() - t0) / 20 * 1e3
        if ms >= target_ms or n >= 16384:
            break
        n = int(n * max(1.1, min(2.0, (target_ms / max(ms, 1e-3)) ** (1 / 3))))

    def loop(record: bool) -> float:
        rec = MetricsRecorder(device)
        x = a
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = (x @ a).mean()  # a 0-d result, as a loss is (both loops compute it)
            if record:
                rec.log("loss", loss)
                rec.step()
        _sync(torch, device)
        return (time.perf_counter() - t0) / steps * 1e3

    plain, recorded = [], []
    loop(False)
    for _ in range(reps):
        plain.append(loop(False))
        recorded.append(loop(True))
    p, r = statistics.median(plain), statistics.median(recorded)
    return {
        "matmul_n": n, "steps": steps, "step_ms_plain": summary(plain), "step_ms_recorded": summary(recorded),
        "overhead_pct_of_step": round((r - p) / p * 100, 3),
    }


def sync_debug_check(torch: Any, device: Any, steps: int) -> dict[str, Any]:
    """A training-like loop under set_sync_debug_mode("error") with the recorder logging every
    step: the selftest's own check (``launcher.workloads.probes.recorder_sync_check``), so that the
    benchmark and ``launch selftest`` measure it one way."""
    from launcher.runtime.metrics import MetricsRecorder
    from launcher.workloads.probes import recorder_sync_check

    got = recorder_sync_check(device, MetricsRecorder(device), steps)
    return {"steps": steps, "baseline_error": got.baseline_sync, "error": got.device_sync, "host_reads": got.host_reads,
            "host_syncs_in_loop": 0 if got.clean else ">= 1", "values_copied": got.values_kept}


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is present")
    args = p.parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if has_gpu() and torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)  # the per-call cost is host work; one thread keeps it steady
    calls, blocks = (2000, 3) if args.smoke else (20000, 15)
    steps, reps = (50, 2) if args.smoke else (500, args.reps or 9)
    result: dict[str, Any] = {"benchmark": "recorder_overhead", "mode": "smoke" if args.smoke else "full" if args.full else "default",
                              "device": str(device), "machine": machine_info(), "target_us_per_value": TARGET_US}
    result["per_call_us"] = per_call_us(torch, device, calls, blocks)
    result["step_loop"] = step_loop(torch, device, steps, reps)
    if device.type == "cuda":
        result["sync_debug"] = sync_debug_check(torch, device, 20 if args.smoke else 200)
    else:
        result["sync_debug"] = {"skipped": "needs a GPU (torch.cuda.set_sync_debug_mode); run with --device cuda on one"}
    worst = max(result["per_call_us"][k]["net_us"] for k in ("log_tensor", "log_float", "step", "timer"))
    result["meets_target"] = worst < TARGET_US and (device.type != "cuda" or result["sync_debug"].get("error") is None)

    pc = result["per_call_us"]
    print(f"recorder overhead on {device} (net of an empty loop of {fmt(pc['empty_loop']['median'], 3)} us); target < {TARGET_US} us per value")
    for k in ("log_tensor", "log_float", "step", "timer"):
        print(f"  {k:12s} {fmt(pc[k]['net_us'], 3)} us  [{fmt(pc[k]['min'], 3)}..{fmt(pc[k]['max'], 3)} gross]")
    print(f"  to_host      {fmt(pc['to_host_per_value']['median'], 3)} us per value, once at the end")
    sl = result["step_loop"]
    print(f"  ~1 ms steps (matmul n={sl['matmul_n']}): {fmt(sl['step_ms_plain']['median'], 4)} ms plain, "
          f"{fmt(sl['step_ms_recorded']['median'], 4)} ms with log+step: {sl['overhead_pct_of_step']:+.2f}% (noise included)")
    print(f"  sync debug: {result['sync_debug']}")
    write_result("recorder_overhead", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
