"""``python -m launcher.runtime.agent ARGS`` is ``torchrun ARGS``: PyTorch's own parser and elastic agent.

Five additions: the agent dies with the launcher (a parent-death signal, so a SIGKILLed
launcher leaves no agent and hence no worker behind); it forwards its node's ranks' beacons and
reports on its own output as they change (``launcher.runtime.forwarder``: the stage's live
channel, whatever carries that output to the launcher); when workers fail it prints one
machine-readable line per failure (rank, exit code, signal, OOM) for the launcher's report; and
with ``--start-method=forkserver`` and the ``-m launcher.runtime.worker WORKER_JSON`` entrypoint, it
hands torchrun ``launcher.worker.forked_rank`` as a function entrypoint instead of a command, so
that torchrun forks the ranks from a multiprocessing forkserver that has imported torch once; and
node 0's agent serves the rendezvous store on ``--master-addr`` alone (127.0.0.1 for a stage on
this machine), not on every interface as torch's own store does. Once its workers have ended,
the beacon of each that ended in silence gets its exact step count from the rank's step counter
(``launcher.runtime.stepcount``) before the forwarder's last sweep.

Why a server and not the agent itself: torchrun's launcher API calls
``torch.cuda.is_available()`` in the agent, and children forked after CUDA is initialised cannot
use it. So the agent imports torch and the runtime (``rank_preload``) first, then forks the server
before torchrun touches CUDA: the server starts with everything a rank needs already imported, at
no cost of its own (a server started as a fresh interpreter would import torch a second time, 1.5 s
of CPU per node and stage), and serves multiprocessing's forkserver protocol, so torchrun's
``start_method=forkserver`` forks the ranks from it. A rank forked from it starts with torch,
torch.distributed and the launcher's runtime already imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import warnings
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from typing import Any

from launcher.procutil import die_with_parent, fast_exit, oom_kill_count, set_process_name, signal_name
from launcher.protocol import AGENT_FAILURE_TAG, ENV_AGENT_PID, ENV_PARENT_PID, ENV_STAGE_DIR, PORT_IN_USE_EXIT, StagePaths
from launcher.runtime.forwarder import RankForwarder, node_ranks, print_line
from launcher.runtime.inplace import ENV_KEEPER

FORKED_ENTRYPOINT = ("-m", "launcher.runtime.worker")
RANK_SERVER_NAME = "gpulaunch-ranks"  # the rank server's process name (it shares the agent's command line)


class _LossyStream:
    """stdout/stderr that go quiet once the launcher (the pipe's reader) is gone.

    Without it, when a SIGKILLed launcher takes the pipe with it, torchrun's log tailers fail on
    EPIPE and the agent spends seconds importing torch._dynamo just to format that error,
    outliving its launcher. Nobody is left to read the output then anyway.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._broken = False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ValueError):  # the reader is gone, or the stream closed
                self._broken = True
            except OSError:
                pass  # this line is lost; the next may go through
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                self._broken = True
            except OSError:
                pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    # Blocking writes: an srun step hands a remote task a non-blocking pipe, where a write that
    # finds it full fails with EAGAIN; the agent's output (its ranks' lines, their forwarded
    # beacons and reports) must wait for room instead of being lost.
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.set_blocking(fd, True)
    sys.stdout, sys.stderr = _LossyStream(sys.stdout), _LossyStream(sys.stderr)  # before torch binds them
    # The launcher stops the agent with SIGTERM as soon as a rank has failed, possibly while
    # torch's elastic logger is still formatting that failure (which imports torch._dynamo for
    # seconds): the signal's exception then surfaces inside logging, whose "--- Logging error ---"
    # and traceback would read as a second failure. Teardown is not news: logging stays silent.
    import logging

    logging.raiseExceptions = False
    # torch's agent logs a worker's failure with logger.exception: formatting that traceback imports
    # torch._dynamo (sympy, inductor: 1-2 s here) before the agent can report and exit, which every
    # restart then waits for; the rank's traceback is in its own report and log already.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_traceback)
    parent = os.environ.get(ENV_PARENT_PID)
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    # Workers inherit this: it lets them check their own parent-death request against the race
    # where the agent died before the request was made (see procutil.die_with_parent).
    os.environ[ENV_AGENT_PID] = str(os.getpid())
    oom_before = oom_kill_count()
    argv = sys.argv[1:] if argv is None else argv
    forked_config = _forked_rank_config(argv)
    # a world of a fixed size (an elastic one's changes with its nodes: the restart path has it)
    keeps = forked_config is not None and any(re.fullmatch(r"--nnodes=\d+", a) for a in argv) and bool(os.environ.get(ENV_STAGE_DIR))
    if keeps:
        os.environ[ENV_KEEPER] = "1"  # before the server's fork: its ranks know a keeper can replace a lost one
    if forked_config is not None:
        _start_rank_server()  # before torchrun (and CUDA): the server is this process's fork

    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(argv)
    config, entrypoint, entry_args = config_from_args(args)
    if forked_config is not None:
        from launcher.runtime.worker import forked_rank

        entrypoint, entry_args = forked_rank, [forked_config]
    if keeps and forked_config is not None:
        world_size = config.max_nodes * config.nproc_per_node
        _keep_ranks(forked_config, int(args.node_rank) * config.nproc_per_node, world_size, (args.master_addr, int(args.master_port)))
    _serve_store_on_rendezvous_address()
    _tails_end_when_told()
    forwarder = _forwarder(int(args.node_rank), config.nproc_per_node)
    try:
        return _launch(config, entrypoint, entry_args, args, forked_config, oom_before)
    finally:
        _settle_steps(int(args.node_rank), config.nproc_per_node)  # before the last forward, which carries them
        if forwarder is not None:
            forwarder.stop()  # the reports the ranks wrote on their way out go too


def _keep_ranks(worker_json: str, first_rank: int, world_size: int, store_address: tuple[str, int]) -> None:
    """Recovery in place on this node (``launcher.runtime.keeper``): a lost rank whose job opted
    in is replaced while torch's agent polls, before it would stop the others."""
    from launcher.protocol import WorkerConfig
    from launcher.runtime.keeper import Keeper

    config = WorkerConfig.from_json(Path(worker_json).read_text())
    stage_dir = Path(os.environ[ENV_STAGE_DIR])
    Keeper(stage_dir, config.attempt, first_rank, spares=config.warm_spares, world_size=world_size, store_address=store_address).install()


def _serve_store_on_rendezvous_address() -> None:
    """The stage's store, which node 0's agent hosts for every rank (torchrun's static
    rendezvous), listening on the rendezvous address alone (``--master-addr``: 127.0.0.1 for a
    stage on this machine) instead of on every interface, through ``TCPStore(master_listen_fd=...)``
    (``launcher.runtime.rendezvous_store.serve_store``; torch's TCPStore has no option to bind one address).
    The static rendezvous builds its store through its module's ``TCPStore``: the server is made
    here, a client (the other nodes' agents) as before. Where the address is a name, or one this
    machine does not hold, torch's own store serves it as before."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    from launcher.runtime.rendezvous_store import serve_store

    def store(
        host_name: str, port: int, world_size: int | None = None, is_master: bool = False, timeout: timedelta = timedelta(seconds=300), **options: Any
    ) -> Any:
        if is_master:
            served = serve_store(host_name, port, timeout, world_size=world_size, **options)  # wait_for_workers: as torch
            if served is not None:
                return served
        return TCPStore(host_name, port, world_size, is_master, timeout, **options)

    static_tcp_rendezvous.TCPStore = store  # type: ignore[assignment,misc]


class _WakingClock:
    """``time`` for torch's log tailers, whose ``sleep`` between two reads of a rank's log ends as
    soon as the tailer is told to stop (its ``finished`` event), not a whole interval later."""

    def __init__(self) -> None:
        self.finished = threading.local()

    def sleep(self, seconds: float) -> None:
        event = getattr(self.finished, "event", None)
        if event is None:
            time.sleep(seconds)
        else:
            event.wait(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _tails_end_when_told() -> None:
    """With ``--tee``, torch copies each rank's log to the agent's output with one tailer thread per
    file that reads, then sleeps 0.1 s; once the ranks have exited the agent waits for every tailer
    to finish its sleep (up to 0.1 s, then another poll) before it can exit, and the launcher waits
    for the agent. Here the sleep ends when the tailer is told to stop: the same reads to the end of
    each file, no wait. A torch whose tailer is not this shape is left as it is."""
    try:
        from torch.distributed.elastic.multiprocessing import tail_log
    except ImportError:
        return
    tail = getattr(tail_log, "tail_logfile", None)
    if tail is None or getattr(tail_log, "time", None) is not time:
        return
    clock = _WakingClock()

    def tail_logfile(header: str, file: str, dst: Any, finished: Any, *args: Any, **kwargs: Any) -> Any:
        clock.finished.event = finished
        return tail(header, file, dst, finished, *args, **kwargs)

    tail_log.time = clock  # type: ignore[assignment]
    tail_log.tail_logfile = tail_logfile


def _without_traceback(record: Any) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


def _forwarder(node_rank: int, nproc_per_node: int) -> RankForwarder | None:
    """This node's ranks' beacons and reports, forwarded on the agent's output (started after the
    rank server's fork: that server must start with no thread of ours)."""
    stage = os.environ.get(ENV_STAGE_DIR)
    if not stage:
        return None  # run by hand, outside a stage: nobody reads the forwarded lines
    return RankForwarder(StagePaths(Path(stage)), node_ranks(node_rank, nproc_per_node), print_line).start()


def _settle_steps(node_rank: int, nproc_per_node: int) -> None:
    """Its workers have ended (torch's agent stops them all before it returns or raises): each
    silent one's beacon gets the exact count of its step counter (``launcher.runtime.stepcount``),
    which the forwarder's last sweep then carries, as does this machine's disk."""
    stage = os.environ.get(ENV_STAGE_DIR)
    if not stage:
        return
    from launcher.runtime.stepcount import settle

    try:
        settle(StagePaths(Path(stage)), node_ranks(node_rank, nproc_per_node))
    except Exception:  # noqa: BLE001 - best effort: the beacons say what they said
        pass


def _launch(config: Any, entrypoint: Any, entry_args: list[Any], args: Any, forked_config: str | None, oom_before: int | None) -> int:
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as exc:
        # rank -> (local rank, exit code, pid, when); torch lists every failed process of a
        # command entrypoint, but only the first it noticed of a function entrypoint's
        exits: dict[int, tuple[int, int, int, float]] = {rank: (f.local_rank, f.exitcode, f.pid, f.timestamp) for rank, f in exc.failures.items()}
        if forked_config is not None:
            exits = {**_RankProcess.exits(first_rank=int(args.node_rank) * config.nproc_per_node), **exits}
        _report_failures(exits, oom=(oom_kill_count() or 0) > (oom_before or 0))
        return 1
    except DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        print(f"gpulaunch-agent: rendezvous port {args.master_port} is already in use", file=sys.stderr, flush=True)
        return PORT_IN_USE_EXIT
    except SignalException as exc:
        # The launcher (or the launcher's death) stopped us: the elastic agent has already stopped
        # its workers. One line, not a traceback: this is teardown, not the failure.
        print(f"gpulaunch-agent: stopped by {exc.sigval.name}; workers stopped", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


def _report_failures(exits: dict[int, tuple[int, int, int, float]], oom: bool) -> None:
    """One machine-readable line per failed rank, for the launcher's root-cause report."""
    # The agent stops the surviving workers with SIGTERM when one fails, and torch lists them
    # as failures too (same timestamp): those are collateral when another rank failed otherwise.
    stopped = {rank for rank, (_, code, _, _) in exits.items() if code == -signal.SIGTERM}
    own_failures = len(stopped) < len(exits)
    for rank, (local_rank, code, pid, when) in sorted(exits.items()):
        record = {
            "rank": rank,
            "local_rank": local_rank,
            "exitcode": code,
            "signal": signal_name(code) if code < 0 else None,
            "pid": pid,
            "oom_suspected": oom and code == -signal.SIGKILL,
            "timestamp": when,
            "collateral": own_failures and rank in stopped,
        }
        print(AGENT_FAILURE_TAG + json.dumps(record), flush=True)


class _RankProcess(ForkServerProcess):
    """A rank forked from the forkserver that remembers itself, so that every failed rank's exit
    status can be reported, not just the first one torch noticed."""

    _started: list["_RankProcess"] = []

    def start(self) -> None:
        # multiprocessing drops its target and arguments once started: kept for the keeper, which
        # forks a lost rank again with them, and for ``exits`` (the local rank is the second one)
        self.rank_target, self.rank_args = self._target, self._args  # type: ignore[attr-defined]
        super().start()
        _RankProcess._started.append(self)

    @classmethod
    def exits(cls, first_rank: int) -> dict[int, tuple[int, int, int, float]]:
        # torch has joined them all by now; each local rank's first failed process (a rank the
        # keeper replaced in place, then handed back to torch, is the loss itself), skipping the
        # processes whose loss was recovered in place
        now = time.time()
        found: dict[int, tuple[int, int, int, float]] = {}
        for proc in cls._started:
            if getattr(proc, "waiting_spare", False):
                continue  # a warm spare that never became a rank (``launcher.runtime.spare``)
            local_rank = int(proc.rank_args[1])  # torch.multiprocessing.spawn's _wrap(fn, i, ...)
            code = proc.exitcode
            if code and not getattr(proc, "recovered_in_place", False) and first_rank + local_rank not in found:
                found[first_rank + local_rank] = (local_rank, code, proc.pid or 0, now)
        return found


def _forked_rank_config(argv: list[str]) -> str | None:
    """The worker.json path when the ranks are to be forked from a forkserver, else None."""
    if "--start-method=forkserver" not in argv or len(argv) < 3 or tuple(argv[-3:-1]) != FORKED_ENTRYPOINT:
        return None
    return argv[-1]


def _start_rank_server() -> None:
    """Fork the node's rank server from this agent, once it has imported what every rank needs,
    and point multiprocessing's forkserver context (the one torch uses for
    ``start_method=forkserver``) at it. The same steps as ``ForkServer.ensure_running``, with a
    fork in place of a fresh interpreter."""
    import multiprocessing
    import socket
    from multiprocessing import connection, forkserver, resource_tracker

    from launcher.runtime import rank_preload

    context = multiprocessing.get_context("forkserver")
    context.Process = _RankProcess  # type: ignore[misc]  # the forkserver context's own class, for this process
    server: Any = forkserver._forkserver  # noqa: SLF001 - the context's server, which torch's ranks ask for
    resource_tracker.ensure_running()  # before the fork: the ranks share the agent's tracker
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        # every client (the agent, its ranks) holds the write end; the server ends at EOF on it
        alive_r, alive_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            # Python 3.12+ warns of fork() in a process with threads: the only other one here is
            # the BLAS pool that `import torch` starts, idle, and multiprocessing's own forkserver
            # forks every rank from such a process too
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the server: serve fork requests until the agent is gone
            try:
                os.close(alive_w)
                set_process_name(RANK_SERVER_NAME)  # in ps/top: not a second agent
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # the ranks get plain streams
                rank_preload.become_rank_server()
                forkserver.main(listener.fileno(), alive_r, [])
            finally:
                os._exit(0)
        os.close(alive_r)
    server._forkserver_address = address  # noqa: SLF001
    server._forkserver_alive_fd = alive_w  # noqa: SLF001
    server._forkserver_pid = pid  # noqa: SLF001


if __name__ == "__main__":
    fast_exit(main())  # the agent holds torch: a normal interpreter exit costs ~0.4 s
