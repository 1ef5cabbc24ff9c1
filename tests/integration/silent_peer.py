"""A rank of ``test_in_place_watch.py``: three gloo ranks with ``ctx.checkpoint.in_place``'s
``InPlace`` on the test's store; rank 2 stops itself (SIGSTOP: alive, its connections open, silent,
as a powered-off host's ranks are), and ranks 0 and 1 then take a DDP step that waits on it. What
each survivor's step ends with goes to the store (``ended/<rank>``): the error, whether it is a
peer's loss, and the generations its watch heard of.

    python -m tests.integration.silent_peer RANK HOST PORT STAGE_DIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def main(rank: int, host: str, port: int, stage_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from launcher.runtime.inplace import GroupSeam, InPlace, is_peer_loss, opened_between, socket_fds

    store = dist.TCPStore(host, port, is_master=False)
    before = socket_fds()
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank, world_size=3)
    sockets = opened_between(before, socket_fds())
    seam = GroupSeam(stage_dir=Path(stage_dir), attempt=0, restart="r0", store=store, form=lambda gen: None, sockets=lambda: sockets)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    live = InPlace(model, opt, lambda m: DDP(m), step=0, wait_s=60, rank=rank, world_size=3, seam=seam, metrics=None, gen=0)
    store.set(f"ready/{rank}", "1")
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    store.wait(["go"])
    store.set(f"stepping/{rank}", "1")
    try:
        live.model(torch.ones(8, 256)).sum().backward()  # its all-reduce waits on rank 2
        ended = {"error": None}
    except RuntimeError as exc:
        ended = {"error": str(exc)[:300], "peer_loss": is_peer_loss(exc)}
    store.set(f"ended/{rank}", json.dumps({**ended, "nudged": live.nudged}))
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
