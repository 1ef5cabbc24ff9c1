"""The soak's training job (``benchmarks/goodput.py``), one program for its three variants.

A job with a real start: torch imported, a ~25M-parameter MLP built (1024 -> 4096 -> 4096 ->
1024 -> 10) with Adam, a data pipeline warmed up (a generated data set of ``--samples`` rows,
normalised, one pass through it); then DDP steps of ``--batch`` rows per rank, the data order the
step's own (any restart draws the same batches), until a shared deadline (``--end-at``: every rank
agrees at each step, one tiny all-reduce). Rank 0 appends each step to ``--steplog`` (step, its
start and end, its pid); every rank publishes its pid in ``--pids``/rank<k> (written then
renamed: the soak's killer never reads half a file).

* ``bare``: ``torchrun --max-restarts`` runs ``python goodput_job.py bare ...``: ``torch.save``
  of model and optimizer by rank 0 every ``--every`` steps (written then renamed), loaded at start;
* ``restart`` (the launcher, ``run(ctx)``): ``ctx.checkpoint.save`` every ``every`` steps, ``load`` at start;
* ``in_place`` (the launcher): the same, plus ``ctx.checkpoint.in_place``: a lost rank is replaced
  while the other keeps its process; with the spec's ``prepare: ...goodput_job:prepare`` the
  model, optimizer and data are built there (``ctx.prepared``), and a warm spare builds them ahead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

WIDTHS = (1024, 4096, 4096, 1024, 10)


def _publish(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _build(torch: Any, samples: int) -> tuple[Any, Any, Any]:
    """The model, its optimizer and the warmed-up data (the job's own start)."""
    torch.manual_seed(0)
    layers: list[Any] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(samples, WIDTHS[0], generator=data)
    x = (x - x.mean(0)) / x.std(0)  # the pipeline's warm-up: one pass over the data
    return model, opt, x


class _Trainer:
    def __init__(self, torch: Any, rank: int, args: Any, model: Any, opt: Any, x: Any) -> None:
        self.torch, self.rank, self.args, self.opt, self.x = torch, rank, args, opt, x
        self.model: Callable[[], Any] = lambda: None  # the DDP model now (in place: rebuilt after a recovery)
        self.log = open(args.steplog, "a", buffering=1) if rank == 0 else None  # noqa: SIM115 - one line per step

    def step(self, step: int) -> bool:
        torch = self.torch
        started = time.time()
        g = torch.Generator().manual_seed(step * 1000 + self.rank)
        rows = torch.randint(0, self.x.shape[0], (self.args.batch,), generator=g)
        xb, yb = self.x[rows], torch.randint(0, WIDTHS[-1], (self.args.batch,), generator=g)
        loss = torch.nn.functional.cross_entropy(self.model()(xb), yb)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        flag = torch.tensor([1 if time.time() > self.args.end_at else 0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # the group's deadline, agreed
        self.opt.step()
        if self.log is not None:
            self.log.write(f"{step} {started:.4f} {time.time():.4f} {os.getpid()}\n")
        return bool(flag.item())


def _loop(first: int, run_step: Callable[[int], Any], save: Callable[[int], None], every: int) -> int:
    step = first
    while True:
        done = run_step(step)
        step += 1
        if step % every == 0:
            save(step)
        if done:
            return step


def prepare(params: Any) -> tuple[Any, Any, Any]:
    """The job's start that does not depend on the rank (the spec's ``prepare``, when a variant
    names it): what a warm spare builds ahead of a loss."""
    import torch

    return _build(torch, int(params["samples"]))


def run(ctx: Any) -> dict[str, Any]:
    """The launcher's variants (``restart``, ``in_place``: ``params.mode``)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    args = argparse.Namespace(**ctx.params)
    _publish(Path(args.pids) / f"rank{ctx.rank}", str(os.getpid()))
    torch.set_num_threads(1)
    model, opt, x = ctx.prepared if ctx.prepared is not None else _build(torch, args.samples)
    first = 0
    if (restored := ctx.checkpoint.load()) is not None:
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["opt"])
        first = restored.step
    trainer = _Trainer(torch, ctx.rank, args, model, opt, x)

    def save(step: int) -> None:
        ctx.checkpoint.save({"model": model.state_dict(), "opt": opt.state_dict()}, step=step)

    if args.mode == "in_place":
        live = ctx.checkpoint.in_place(model, opt, wrap=lambda m: DDP(m), step=first)
        first = live.step
        trainer.model = lambda: live.model
        last = _loop(first, lambda step: live.run(trainer.step, step), save, args.every)
    else:
        ddp = DDP(model)
        trainer.model = lambda: ddp
        last = _loop(first, trainer.step, save, args.every)
    return {"first_step": first, "last_step": last}


def bare(argv: list[str]) -> None:
    """Under bare ``torchrun``: ``torch.save`` checkpoints, no launcher."""
    parser = argparse.ArgumentParser()
    for name in ("steplog", "pids", "ckpt"):
        parser.add_argument(f"--{name}", required=True)
    for name, kind in (("end_at", float), ("samples", int), ("batch", int), ("every", int)):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, required=True)
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from datetime import timedelta

    # a bounded group set-up: a restarted group's gloo connect was seen to hang here for minutes
    # under load (torch's default bound is 30 min); a user would bound it too
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    _publish(Path(args.pids) / f"rank{rank}", str(os.getpid()))
    torch.set_num_threads(1)
    model, opt, x = _build(torch, args.samples)
    first, ckpt = 0, Path(args.ckpt)
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = int(state["step"])
    trainer = _Trainer(torch, rank, args, model, opt, x)
    ddp = DDP(model)
    trainer.model = lambda: ddp

    def save(step: int) -> None:
        if rank == 0:
            tmp = ckpt.with_name(ckpt.name + ".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()

    _loop(first, trainer.step, save, args.every)
    dist.destroy_process_group()


if __name__ == "__main__":
    bare(sys.argv[1:])
