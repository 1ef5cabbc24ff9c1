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
from dataclasses import dataclass
from typing import Callable

from launcher.backends.transports import LOCAL, Transport
from launcher.backends.host_inplace import HostKeeper
from launcher.errors import BackendError
from launcher.evidence import RankEvidence
from launcher.procutil import kill_now, stage_worker_pids, stop_groups, write_json_atomic
from launcher.protocol import HOST_LOST, LOG_PREFIX_SEPARATOR, PORT_IN_USE_EXIT
from launcher.stage.engine import HandleStatus, LaunchRequest, StageEngine, StageHandle
from launcher.stage.events import RanksLost
from launcher.runtime.inplace import ENV_GEN, fallback_path, folder
from launcher.stage.logrouting import LogRouter
from launcher.stage.plan import NodeSlot, NodeTarget, StagePlan, on_spare

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


@dataclass
class _Move:
    """A lost host's ranks on their way to a spare host (``TorchrunStage._move_to_spare``)."""

    index: int  # the node's place in the stage's agents
    lost: tuple[NodeSlot, Transport, subprocess.Popen]  # the lost host's node and agent
    before: StagePlan  # the plan with the lost host: back to it if the move does not recover
    why: str  # how the host was lost


class TorchrunStage(StageHandle):
    """One stage's agents, one per node, each through its node's transport."""

    def __init__(self, plan: StagePlan, logs: LogRouter, transport: Callable[[NodeSlot], Transport]) -> None:
        super().__init__(plan, logs)
        self._transport = transport
        self._agents: list[tuple[NodeSlot, Transport, subprocess.Popen]] = []
        self._lost: dict[str, str] = {}  # host -> why, once its loss was emitted
        # a lost host's ranks moved to a spare in place (``host_inplace``): where the plan has spares
        self._keeper = HostKeeper(plan.worker.attempt, (plan.rendezvous.addr, plan.rendezvous.port)) if plan.standby else None
        self._moved: _Move | None = None  # a lost host's ranks on their way to a spare
        self._left: list[subprocess.Popen] = []  # lost hosts' agents, replaced: still stopped at the end

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
        if self._keeper is not None:
            lost = self._tend_moves(lost)
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

    # --- a lost host's ranks moved to a spare in place ------------------------------------------
    def _tend_moves(self, lost: list[tuple[NodeSlot, str]]) -> list[tuple[NodeSlot, str]]:
        """The losses left to the restart path, once a move under way is settled and a new loss
        moved to a spare where it can be (``launcher.backends.host_inplace``)."""
        keeper = self._keeper
        assert keeper is not None
        if self._moved is not None:
            spare, _, proc = self._agents[self._moved.index]
            why = ""
            if any(node.host == spare.host for node, _ in lost):
                lost = [(node, w) for node, w in lost if node.host != spare.host]
                why = f"the spare host {spare.host} was lost during the recovery"
            elif lost:
                why = "another host was lost during the recovery"
            elif proc.poll() not in (None, 0):
                why = f"the spare host's agent ended with {proc.poll()} before the recovery was over"
            elif (done := keeper.settled()) is False:
                why = f"no recovery within wait_s={keeper.recovery.wait_s:g}s" if keeper.recovery else "no recovery within wait_s"
            elif done:
                self._moved = None
                self.logs.route(f"gpulaunch: the ranks of the lost host now run on {spare.host}: recovered in place", spare.host)
            if why:
                lost = [*lost, self._move_back(why)]
        if not lost or keeper.given_up or self._moved is not None:
            return lost
        node, why = lost[0]
        return lost[1:] if self._move_to_spare(node, why) else lost

    def _move_to_spare(self, node: NodeSlot, why: str) -> bool:
        """Host ``node`` lost: its ranks started on the first spare, joining the survivors' next
        generation of the group. False where the restart path takes the loss."""
        keeper = self._keeper
        if keeper is None or node.node_rank == 0 or not self.plan.standby:
            return False  # node 0's agent served the stage's store: it went with it
        plan = on_spare(self.plan, node.node_rank)
        spare = plan.nodes[node.node_rank]
        ranks = tuple(r.rank for r in self.plan.ranks if r.node_rank == node.node_rank)
        claimed = keeper.claim(node.node_rank, node.host, spare.host, ranks)
        if isinstance(claimed, str):
            self.logs.route(f"gpulaunch: host {node.host} lost ({why}); not recovered in place ({claimed}): the restart path", node.host)
            return False
        index = next(i for i, (n, _, _) in enumerate(self._agents) if n.node_rank == node.node_rank)
        transport = self._transport(spare)
        try:
            transport.prepare(plan, [spare])
            proc = transport.spawn(spare, plan, agent_argv(plan, spare), {**agent_env(spare), ENV_GEN: str(claimed.gen)})
        except (OSError, BackendError) as exc:
            keeper.give_up(f"the spare host {spare.host} could not start: {exc}")
            self.logs.route(f"gpulaunch: host {node.host} lost; the spare host {spare.host} could not start ({exc}): the restart path", node.host)
            return False
        assert proc.stdout is not None
        self.logs.follow(proc.stdout, spare.host)
        self._moved = _Move(index, self._agents[index], self.plan, why)
        self._left.append(self._agents[index][2])
        self._agents[index] = (spare, transport, proc)
        self.plan = plan
        self.logs.route(f"gpulaunch: host {node.host} lost ({why}); its ranks {list(ranks)} start on the spare host {spare.host} "
                        f"and join the others in place (generation {claimed.gen})", spare.host)  # fmt: skip
        return True

    def _move_back(self, why: str) -> tuple[NodeSlot, str]:
        """The move under way did not recover: its spare's agent stopped, the plan as before (the
        restart's spare is the same host), and the lost host's loss handed to the restart path."""
        assert self._moved is not None and self._keeper is not None
        move, self._moved = self._moved, None
        _, transport, proc = self._agents[move.index]
        if proc.poll() is None:
            transport.stop([proc], 2.0)
            stop_groups([proc], 2.0)
        self._agents[move.index] = move.lost
        self.plan = move.before
        record = self._keeper.give_up(why)
        if record is not None:
            write_json_atomic(fallback_path(folder(self.plan.stage_dir, self.plan.worker.attempt), record["gen"]), record, durable=False)
        node = move.lost[0]
        self.logs.route(f"gpulaunch: the ranks of {node.host} were not recovered in place ({why}): the restart path", node.host)
        return node, move.why

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
        stop_groups([proc for proc in self._left if proc.poll() is None], grace_s)  # lost hosts' sessions
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
