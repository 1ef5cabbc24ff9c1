"""Hand-written torchrun DDP script: the reference for the ``ddp_train`` job's samples/s.

The same model, data, optimiser and batches as ``launcher.workloads.train`` (an MLP
features -> hidden -> hidden -> classes, AdamW, labels from a fixed random teacher network,
DistributedSampler, ``batch_size`` per rank), written the way one would without the launcher:
``init_process_group``, DDP, a timed loop per epoch (host clock; a device synchronisation at the
epoch's ends on a GPU). Rank 0 prints one JSON line: samples/s per rank (samples per epoch over
the median epoch time) and in total.

    torchrun --standalone --nproc-per-node=2 benchmarks/ddp_baseline.py --epochs 4
    BENCH_DEVICE=cuda BENCH_RANKS_PER_GPU=2 torchrun --standalone --nproc-per-node=2 benchmarks/ddp_baseline.py
        # two ranks sharing one GPU (gloo over CUDA tensors), as the job with resources.ranks_per_gpu: 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# The data is not what is measured: take the job's own generator so both train on identical samples.
from launcher.workloads.train import make_dataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n-train", type=int, default=32768)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accounting", action="store_true",
                   help="also sum loss, correct answers and samples on the device every step, as the ddp_train job does")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = os.environ.get("BENCH_DEVICE", "cuda" if torch.cuda.is_available() else "cpu") == "cuda"
    # ranks sharing each GPU (the job's resources.ranks_per_gpu): rank on cuda:<local_rank // k>,
    # and gloo over CUDA tensors, since NCCL refuses two ranks on one GPU
    share = int(os.environ.get("BENCH_RANKS_PER_GPU", "1"))
    if cuda:
        dev = torch.device("cuda", local_rank // share)
        torch.cuda.set_device(dev)
        if share > 1:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, args.classes),
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ddp = DDP(model, device_ids=[dev.index] if cuda else None)
    x, y = make_dataset(args.n_train, args.features, args.classes, args.seed, split=0)
    train = TensorDataset(x, y)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, pin_memory=cuda)
    loss_fn = nn.CrossEntropyLoss()
    epoch_s = []
    stats = torch.zeros(args.epochs, 3, device=dev, dtype=torch.float64)
    ddp.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for xb, yb in loader:
            xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
            out = ddp(xb)
            loss = loss_fn(out, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if args.accounting:
                stats[epoch, 0] += loss.detach() * yb.shape[0]
                stats[epoch, 1] += (out.argmax(dim=1) == yb).sum()
                stats[epoch, 2] += yb.shape[0]
        if cuda:
            torch.cuda.synchronize(dev)
        epoch_s.append(time.perf_counter() - t0)
    sps = len(sampler) / statistics.median(epoch_s)
    every = [None] * world
    dist.all_gather_object(every, sps)
    if rank == 0:
        print("DDP_BASELINE " + json.dumps({"world_size": world, "rank_sps": statistics.median(every), "total_sps": sum(every),
                                            "rank_sps_by_rank": every, "epoch_s": epoch_s, "device": str(dev)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
