"""A warm spare: a rank process forked ahead of any loss, which has run the job's ``prepare``
(its model built, its data warmed up) and waits to take a lost rank's place.

Recovery in place (``launcher.runtime.inplace``) replaces a lost rank with a process forked from
the node's rank server: torch and the runtime are imported already, but the job starts from its
top, and a real job's start (its model built, its data pipeline warmed up: seconds to minutes) is
most of the recovery. A job that splits its start into ``prepare(params)``, what does not depend
on the rank, and ``run(ctx)``, which finds it in ``ctx.prepared``, lets the node's keeper
(``launcher.runtime.keeper``) fork spares that run ``prepare`` while the ranks step, then block on
a pipe. At a loss the keeper sends one the lost rank's place (its local index, the generation it
joins, torch's error file for it); the spare takes torch's own path for that rank from there
(the rank's environment and log, ``launcher.runtime.worker.forked_rank``) with ``prepare``'s
result kept, so its start is the group's rendezvous and the state's transfer from a peer.

A spare holds torch's arguments for every local rank of the node (torch's agent builds one
tuple for all of them), so any of them can become any rank. A pipe closed before an order (the
attempt ended) ends the spare at once; the rank server's death ends it too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

from launcher.procutil import die_with_parent, write_json_atomic
from launcher.protocol import ENV_RANK_SERVER_PID, WorkerConfig
from launcher.runtime.entry import load_entrypoint
from launcher.runtime.inplace import joining_args

NOT_PREPARED = object()  # what a rank that was never a spare finds (``prepare`` may return None)
_prepared: list[Any] = []  # what ``prepare`` returned in this process while it was a spare (taken once)


def ready_path(root: Path, pid: int) -> Path:
    """Written by a spare once its ``prepare`` returned: the keeper's record says whether the
    replacement it sent was ready."""
    return root / f"spare.{pid}.json"


def take_prepared() -> Any:
    """What this process prepared as a spare (then forgotten here: the rank owns it), or
    :data:`NOT_PREPARED` for a rank that was never a spare."""
    return _prepared.pop() if _prepared else NOT_PREPARED


def serve(rank_target: Callable[..., Any], fn: Any, args: tuple[Any, ...], orders: Any, root: str) -> None:
    """The spare's process (forked from the rank server with torch's arguments for the node's
    ranks, ``args``: elastic's ``(entry, entry args, envs, ...)`` by local rank): ``prepare``,
    then the first order, then the rank it names, as torch would have started it."""
    server = int(os.environ.get(ENV_RANK_SERVER_PID, "0"))
    die_with_parent(signal.SIGKILL, server if server and server != os.getpid() else None)
    entry_args = args[1]
    config = WorkerConfig.from_json(Path(next(iter(entry_args.values()))[0]).read_text())
    if config.prepare:
        _prepare(config, Path(root))
    try:
        order = orders.recv()
    except (EOFError, OSError):
        os._exit(0)  # the attempt ended with no loss for this spare
    orders.close()
    index = int(order["index"])
    rank_target(fn, index, joining_args(args, index, int(order["gen"])), order["error_file"])


def _prepare(config: WorkerConfig, root: Path) -> None:
    import torch

    if config.threads_per_worker is not None:  # the threads the rank it becomes will have
        torch.set_num_threads(config.threads_per_worker)
    started = time.time()
    _prepared.append(load_entrypoint(str(config.prepare))(config.params))
    done = time.time()
    write_json_atomic(ready_path(root, os.getpid()), {"pid": os.getpid(), "prepared_at": done, "prepare_s": round(done - started, 4)}, durable=False)
