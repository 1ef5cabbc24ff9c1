"""Hand-written ``torch.matmul`` timing loop: the reference the matmul job and the selftest are compared with.

The same work as one rank of ``launcher.workloads.matmul``: two random n x n matrices made on the
device, ``warmup`` untimed products, then ``iters`` timed products (host clock around the loop,
with a device synchronisation before and after on a GPU: ``launcher.workloads.probes.hand_loop_seconds``). Prints one JSON line: GFLOP/s per size,
with each size's timed seconds and products.

    python benchmarks/hand_matmul.py --sizes 1024 --iters 50 --threads 2 [--device cuda]
    python benchmarks/hand_matmul.py --sizes 8192 --seconds 12.5 --dtype bfloat16 --device cuda

``--seconds S`` times as many products as take S seconds (what a comparison with a job at equal
duration needs: under a power cap a long run holds lower clocks than a short one); ``iters`` is
then set from a warm product's time. ``--against-selftest`` first measures each size the way
``launch selftest`` does (``launcher.workloads.probes.matmul_tflops``: a warm-up in time, trials
of ``--trial-s``), then runs this loop right after, in the same process, over the same number
of products, and adds both figures and their ratio (``selftest``) to the JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

# the loop itself has one home, which the selftest's reference figure uses too
from launcher.workloads.probes import hand_loop_seconds as hand_loop


def iters_for_seconds(device: Any, dtype: Any, n: int, seconds: float) -> int:
    """How many products take ``seconds`` here (from a short warm loop)."""
    probe = max(1, min(50, int(2e11 / (2.0 * n**3))))
    one = hand_loop(device, dtype, n, iters=probe) / probe
    return max(1, round(seconds / max(one, 1e-9)))


def against_selftest(device: Any, dtype_name: str, n: int, *, warmup_s: float, trial_s: float, trials: int) -> dict[str, Any]:
    """The selftest's matmul figure, then this loop right after over the same products: both TFLOP/s, the ratio."""
    import torch

    from launcher.workloads.probes import matmul_tflops

    got = matmul_tflops(device, dtype_name, n, trials=trials, warmup=3, warmup_s=warmup_s, trial_s=trial_s)
    iters = got.per_trial * got.trials
    seconds = hand_loop(device, getattr(torch, dtype_name), n, iters=iters)
    hand = 2.0 * n**3 * iters / seconds / 1e12
    return {"n": n, "selftest_tflops": got.median, "selftest_seconds": got.seconds, "selftest_trials": got.trials,
            "hand_tflops": hand, "hand_seconds": seconds, "products": iters, "ratio": got.median / hand}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seconds", type=float, default=None, help="time this long per size instead of --iters products")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--against-selftest", action="store_true", help="the selftest's measurement first, then this loop")
    p.add_argument("--warmup-s", type=float, default=2.0, help="--against-selftest: the selftest's warm-up seconds")
    p.add_argument("--trial-s", type=float, default=0.1, help="--against-selftest: the selftest's seconds per trial")
    p.add_argument("--trials", type=int, default=20, help="--against-selftest: the selftest's trials")
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    out: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads(), "dtype": args.dtype, "gflops": {}, "ms": {},
                           "seconds": {}, "iters": {}}
    if args.against_selftest:
        out["selftest"] = {}
    for n in args.sizes:
        if args.against_selftest:
            out["selftest"][str(n)] = against_selftest(device, args.dtype, n, warmup_s=args.warmup_s, trial_s=args.trial_s,
                                                       trials=args.trials)
        iters = iters_for_seconds(device, dtype, n, args.seconds) if args.seconds else args.iters
        seconds = hand_loop(device, dtype, n, iters=iters, warmup=args.warmup)
        out["ms"][str(n)] = seconds * 1e3
        out["seconds"][str(n)] = seconds
        out["iters"][str(n)] = iters
        out["gflops"][str(n)] = 2.0 * n**3 * iters / seconds / 1e9
    print(json.dumps(out))


if __name__ == "__main__":
    main()
