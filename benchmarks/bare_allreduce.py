"""Bare torchrun baseline for the start-up benchmark: init_process_group + one all-reduce.

Run as ``torchrun --standalone --nproc-per-node=2 benchmarks/bare_allreduce.py``. When
``BENCH_STAMP_DIR`` is set, each rank writes ``rank<k>.json`` with the wall-clock time right after
its all-reduce (the same moment the launcher's worker records ``first_step``). With
``BENCH_DEVICE=cuda``, rank k computes on ``cuda:<LOCAL_RANK // BENCH_RANKS_PER_GPU>``; ranks that
share a GPU (``BENCH_RANKS_PER_GPU`` > 1: NCCL refuses two ranks on one GPU) use gloo.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    use_cuda = os.environ.get("BENCH_DEVICE", "cpu") == "cuda"
    local_rank = int(os.environ["LOCAL_RANK"])
    ranks_per_gpu = int(os.environ.get("BENCH_RANKS_PER_GPU", "1"))
    if use_cuda:
        torch.cuda.set_device(local_rank // ranks_per_gpu)
        device = torch.device("cuda", local_rank // ranks_per_gpu)
        if ranks_per_gpu > 1:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    value = torch.ones(1, device=device)
    dist.all_reduce(value)
    stamp = time.time()
    assert float(value.item()) == dist.get_world_size()
    stamp_dir = os.environ.get("BENCH_STAMP_DIR")
    if stamp_dir:
        path = os.path.join(stamp_dir, f"rank{dist.get_rank()}.json")
        with open(path, "w") as handle:
            json.dump({"first_step": stamp, "rank": dist.get_rank()}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
