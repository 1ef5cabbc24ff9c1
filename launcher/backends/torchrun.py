"""The torchrun engine: one PyTorch elastic agent (torch.distributed.run) per node.

The plan says what each node runs; this module turns it into torchrun's own terms (the agent's
argv, its log-line prefix) and starts each node's agent through that node's transport: a child
process here, or the OpenSSH client for another host (``launcher.backends.ssh``). Either way the
agent's merged output comes back through a pipe to the LogRouter: the ranks' lines, and the
ranks' beacons and reports that the agent forwards (the stage's live event stream). Stopping it
is: the transport's stop (an SSH lifeline cut), SIGTERM to the agent (which stops its workers),
SIGKILL after a grace period, then SIGKILL to any worker still alive here, by pid.
"""

from __future__ import annotations

import functools
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from launcher.backends.transports import LOCAL, Transport
from launcher.errors import BackendError
from launcher.evidence import RankEvidence
from launcher.procutil import kill_now, stage_worker_pids, stop_groups
from launcher.protocol import HOST_LOST, LOG_PREFIX_SEPARATOR, PORT_IN_USE_EXIT
from launcher.stage.engine import HandleStatus, LaunchRequest, StageEngine, StageHandle
from launcher.stage.events import RanksLost
from launcher.stage.logrouting import LogRouter
from launcher.stage.plan import NodeSlot, NodeTarget, StagePlan

# How long a failed agent's pipe may stay silent before its remaining output is given up on
# (a stray child can hold the pipe open)
AGENT_DRAIN_IDLE_S = 2.0
AGENT_MODULE = "launcher.runtime.agent"
WORKER_MODULE = "launcher.runtime.worker"


def agent_argv(plan: StagePlan, node: NodeSlot) -> tuple[str, ...]:
    """``python -m launcher.runtime.agent`` is torchrun (same parser, same elastic agent) plus a
    parent-death signal and a machine-readable failure file. Static rendezvous on a port the
    launcher chose, never the fixed 29500, whose store node 0's agent serves on ``--master-addr``
    alone (127.0.0.1 for a stage on this machine, where gloo and NCCL use ``lo``: ``node_env``).
    With --start-method=forkserver the agent runs the worker as a function in ranks forked from a
    forkserver (torchrun's own start methods)."""
    return (
        node.target.python,
        "-m",
        AGENT_MODULE,
        f"--nnodes={len(plan.nodes)}",
        f"--nproc-per-node={node.nproc}",
        f"--node-rank={node.node_rank}",
        "--rdzv-backend=static",
        f"--master-addr={plan.rendezvous.addr}",
        f"--master-port={plan.rendezvous.port}",
        "--max-restarts=0",  # restarts are the run loop's, the same for every backend
        "--monitor-interval=0.1",
        f"--start-method={plan.start_method}",
        f"--log-dir={plan.paths.agent_log_dir(node.node_rank)}",
        "--tee=3",
        "-m",
        WORKER_MODULE,
        str(plan.paths.worker_config),
    )


def agent_env(node: NodeSlot) -> dict[str, str]:
    """The node's env plus torchrun's log-line prefix, which lets the LogRouter split the agent's
    merged output back into ranks."""
    return {**node.env, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"{node.host}:${{rank}}{LOG_PREFIX_SEPARATOR}"}


@functools.cache
def _ssh() -> Transport:
    from launcher.backends.ssh import SshTransport  # the ssh client is needed only for clusters

    return SshTransport()


def transport_for(target: NodeTarget) -> Transport:
    """The one transport instance for how ``target`` is reached."""
    return LOCAL if target.ssh is None else _ssh()


class TorchrunEngine(StageEngine):
    name = "torchrun"

    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        """Per node: the exact command (plain ``torchrun`` form; over SSH, the ssh command)."""
        commands = tuple(f"[{node.host}] $ {self.transport(node).describe(node, plan, agent_argv(plan, node))}" for node in plan.nodes)
        notes = [f"each node runs its command via `python -m {AGENT_MODULE}`: torchrun with a parent-death signal"]
        if plan.start_method == "forkserver":
            notes.append("--start-method=forkserver: ranks are forked from a server that has imported torch once per node")
        return LaunchRequest(self.name, commands, tuple(notes))

    def transport(self, node: NodeSlot) -> Transport:
        return transport_for(node.target)

    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        stage = TorchrunStage(plan, logs, self.transport)
        stage.start()
        return stage


class TorchrunStage(StageHandle):
    """One stage's agents, one per node, each through its node's transport."""

    def __init__(self, plan: StagePlan, logs: LogRouter, transport: Callable[[NodeSlot], Transport]) -> None:
        super().__init__(plan, logs)
        self._transport = transport
        self._agents: list[tuple[NodeSlot, Transport, subprocess.Popen]] = []
        self._lost: dict[str, str] = {}  # host -> why, once its loss was emitted

    def _transports(self) -> dict[Transport, list[NodeSlot]]:
        groups: dict[Transport, list[NodeSlot]] = {}
        for node in self.plan.nodes:
            groups.setdefault(self._transport(node), []).append(node)
        return groups

    def start(self) -> None:
        self.plan.stage_dir.mkdir(parents=True, exist_ok=True)
        groups = self._transports()
        for transport, nodes in groups.items():
            transport.prepare(self.plan, nodes)  # stage dir + worker.json where the ranks read it
        for transport, nodes in groups.items():
            for node in nodes:
                try:
                    proc = transport.spawn(node, self.plan, agent_argv(self.plan, node), agent_env(node))
                except OSError as exc:
                    self.stop()
                    raise BackendError(f"cannot start the torchrun agent for {node.host}: {exc}") from None
                assert proc.stdout is not None
                self.logs.follow(proc.stdout, node.host)
                self._agents.append((node, transport, proc))

    def poll(self) -> HandleStatus:
        lost = [(node, why) for node, transport, proc in self._agents if proc.poll() != 0 and (why := transport.lost(proc))]
        if lost:  # a host is gone (its agent's exit code, ssh's own 255 or none yet, says no more)
            for node, why in lost:
                self._host_lost(node, why)
            return HandleStatus(done=True, ok=False, detail="; ".join(f"lost host {node.host} ({why})" for node, why in lost))
        codes = [(node, proc.poll()) for node, _, proc in self._agents]
        failed = [(node, code) for node, code in codes if code not in (None, 0)]
        if failed:
            # One failed agent ends the job: the run loop stops the rest at once. Its failure
            # records and its ranks' reports are its last lines: route them before saying so.
            for node, _ in failed:
                self.logs.drain(node.host, idle_s=AGENT_DRAIN_IDLE_S)
            return HandleStatus(
                done=True, ok=False, detail=self._detail(failed), rendezvous_port_in_use=any(code == PORT_IN_USE_EXIT for _, code in failed)
            )
        if any(code is None for _, code in codes):
            return HandleStatus(done=False)
        for node, _, _ in self._agents:  # every agent ended well: their last forwarded reports first
            self.logs.drain(node.host, idle_s=AGENT_DRAIN_IDLE_S)
        return HandleStatus(done=True, ok=True)

    def _host_lost(self, node: NodeSlot, why: str) -> None:
        """The host's ranks were lost with it: said once, stamped when the loss was seen."""
        if node.host in self._lost:
            return
        self._lost[node.host] = why
        ranks = tuple(r.rank for r in self.plan.ranks if r.node_rank == node.node_rank)
        # no traceback: the last lines the launcher got from the ranks are in their logs
        self.emit(RanksLost(ranks, node.host, HOST_LOST, f"lost host {node.host} ({why})", at=time.time()))

    def _detail(self, failed: list[tuple[NodeSlot, int]]) -> str:
        return "; ".join(
            f"rendezvous port {self.plan.rendezvous.port} on {node.host} was already in use"
            if code == PORT_IN_USE_EXIT
            else f"agent on {node.host} exited with {code}"
            for node, code in failed
        )

    def stop(self, grace_s: float = 5.0) -> None:
        for transport in self._transports():
            live = [proc for _, t, proc in self._agents if t is transport and proc.poll() is None]
            if live:  # e.g. cut every SSH lifeline at once; returns when those hosts have stopped
                transport.stop(live, grace_s)
        stop_groups([proc for _, _, proc in self._agents if proc.poll() is None], grace_s)
        # Belt and braces: workers also die with their agent (parent-death signal), but a rank
        # that outlived both is found by the pid and start time in its progress file.
        outlived = list(stage_worker_pids(self.plan.stage_dir).values())
        if outlived:  # none after a stage that ended by itself: nothing to load psutil for
            kill_now(outlived)

    def signal_ranks(self, signum: int) -> None:
        for transport, nodes in self._transports().items():
            transport.signal(self.plan, [n for n in nodes if n.host not in self._lost], signum)

    def gather_evidence(self) -> list[RankEvidence]:
        """Every live host's evidence, each through its own transport, the hosts in parallel."""
        work = [(transport, node) for transport, nodes in self._transports().items() for node in nodes if node.host not in self._lost]
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(work)))) as pool:
            found = pool.map(lambda tn: tn[0].evidence(self.plan, tn[1]), work)
            return sorted((e for host in found for e in host), key=lambda e: e.rank)

    def collect(self) -> None:
        for transport, nodes in self._transports().items():
            transport.collect(self.plan, [n for n in nodes if n.host not in self._lost], self.logs)
