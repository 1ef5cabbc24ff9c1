"""What straggler timing costs a DDP step: two gloo ranks on this machine, a small MLP (8 x 256x256
linear layers, 0.25 MB buckets: 9 buckets a step, many more than a GPU job's 25 MB), the same
steps timed, interleaved, in four variants:

- ``plain``: DDP as torch ships it (built-in C++ all-reduce);
- ``timed``: with ``launcher.runtime.workclock.install_ddp_timing`` (what every rank gets):
  post-accumulate-grad hooks on the parameters and one optimizer step pre-hook;
- ``python_comm_hook``: DDP with torch's own Python ``allreduce_hook`` registered, the cost a
  design that wraps the communication in a Python comm hook would pay;
- the ratio of each to ``plain`` (median of per-repetition ratios, min-max).

    python benchmarks/straggler_overhead.py [--smoke] [--reps N]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import base_parser, fmt, machine_info, summary, write_result  # noqa: E402

VARIANTS = ("plain", "timed", "python_comm_hook")


def mlp(torch: Any) -> Any:
    """The benchmark's model: 8 x 256x256 linear layers, the same weights every time."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])


def ddp_steps_us(torch: Any, dist: Any, model: Any, steps: int) -> float:
    """Microseconds per training step of ``model`` (a fresh SGD, one fixed batch), from a barrier."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 256)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return (time.perf_counter() - t0) / steps * 1e6


def _rank(rank: int, store_path: str, reps: int, steps: int, out_path: str) -> None:
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from launcher.runtime.workclock import WorkClock, install_ddp_timing

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(reps):  # interleaved: every variant sees the same machine
        times["plain"].append(ddp_steps_us(torch, dist, DDP(mlp(torch), bucket_cap_mb=0.25), steps))
        undo = install_ddp_timing(WorkClock())
        times["timed"].append(ddp_steps_us(torch, dist, DDP(mlp(torch), bucket_cap_mb=0.25), steps))
        undo()
        hooked = DDP(mlp(torch), bucket_cap_mb=0.25)
        hooked.register_comm_hook(None, allreduce_hook)
        times["python_comm_hook"].append(ddp_steps_us(torch, dist, hooked, steps))
    if rank == 0:
        Path(out_path).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    reps = args.reps or (1 if args.smoke else 7)
    steps = 20 if args.smoke else 300
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.spawn(_rank, args=(str(Path(tmp) / "store"), reps, steps, out), nprocs=2)
        times = json.loads(Path(out).read_text())
    ratios = {v: summary([t / p for t, p in zip(times[v], times["plain"])]) for v in VARIANTS if v != "plain"}
    data = {
        "mode": "smoke" if args.smoke else "full",
        "machine": machine_info(),
        "steps_per_rep": steps,
        "step_us": {v: summary(times[v]) for v in VARIANTS},
        "x_plain": ratios,
    }
    for v in VARIANTS:
        s = data["step_us"][v]
        extra = "" if v == "plain" else f"  x plain {fmt(ratios[v]['median'])} [{fmt(ratios[v]['min'])}..{fmt(ratios[v]['max'])}]"
        print(f"{v:18s} step {fmt(s['median'], 0)} us [{fmt(s['min'], 0)}..{fmt(s['max'], 0)}]{extra}")
    write_result("straggler_overhead", data, args.out)


if __name__ == "__main__":
    main()
