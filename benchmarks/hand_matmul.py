"""Hand-written ``torch.matmul`` timing loop: the reference the matmul job is compared with.

The same work as one rank of ``launcher.workloads.matmul``: two random n x n matrices made on the
device, ``warmup`` untimed products, then ``iters`` timed products (host clock around the loop,
with a device synchronisation before and after on a GPU). Prints one JSON line: GFLOP/s per size.

    python benchmarks/hand_matmul.py --sizes 1024 --iters 50 --threads 2 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    out = {"device": str(device), "threads": torch.get_num_threads(), "gflops": {}, "ms": {}}
    for n in args.sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(args.warmup):
            torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            c = torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t0) * 1e3
        out["ms"][str(n)] = ms
        out["gflops"][str(n)] = 2.0 * n**3 * args.iters / (ms / 1e3) / 1e9
        del c
    print(json.dumps(out))


if __name__ == "__main__":
    main()
