"""How the torchrun engine reaches a node: this machine directly, or another over SSH.

A transport prepares a stage on its nodes, starts one agent process per node whose merged output
(rank lines, and the agent's forwarded rank events: the stage's live channel) comes back through a
pipe, stops those agents, signals their ranks, and brings back what the live channel could not
(files left on a host, a report the stream missed). The torchrun engine picks one per node
(``torchrun.transport_for``) and otherwise never asks where a node is.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

from launcher.evidence import RankEvidence
from launcher.procutil import read_json, stage_worker_pids
from launcher.protocol import ENV_PARENT_PID, RankProgress, RankReport
from launcher.stage.events import RankBeacon, RankReported, StageEvent

if TYPE_CHECKING:
    from launcher.stage.logrouting import LogRouter
    from launcher.stage.plan import NodeSlot, StagePlan


class Transport(ABC):
    remote = False  # whether the node's files live elsewhere (they must be fetched)

    @abstractmethod
    def describe(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str]) -> str:
        """The command that starts the node's agent, as a user could type it."""

    @abstractmethod
    def prepare(self, plan: StagePlan, nodes: Sequence[NodeSlot]) -> None:
        """The stage directory and each node's ``worker.json`` where its ranks will read them."""

    @abstractmethod
    def spawn(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        """Start the node's agent (stdout and stderr merged into one pipe); do not wait."""

    def stop(self, procs: Sequence[subprocess.Popen], grace_s: float) -> None:
        """Ask these agents to end; the engine signals whatever is still running afterwards."""

    def lost(self, proc: subprocess.Popen) -> str | None:
        """Why the host of this agent is gone (``connection closed``, ``no answer for 5 s``), or
        None while it answers (or where, as on this machine, a host cannot be lost)."""
        return None

    def signal(self, plan: StagePlan, nodes: Sequence[NodeSlot], signum: int) -> None:
        """``signum`` to every live rank of these nodes: here, by the pids in their beacons."""
        for pid in stage_worker_pids(plan.stage_dir).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def evidence(self, plan: StagePlan, node: NodeSlot) -> list[RankEvidence]:
        """A stalled stage's evidence from this node's ranks (``launcher.runtime.hangdump``): here,
        gathered in this process."""
        from launcher.runtime.hangdump import gather

        return gather(plan.stage_dir, node.host, node_ranks(plan, node))

    def collect(self, plan: StagePlan, nodes: Sequence[NodeSlot], logs: LogRouter) -> None:
        """What the live channel may have missed (an agent killed before its last forward): the
        nodes' beacons and reports, read where the ranks wrote them (this machine's disk)."""
        logs.emit(*local_rank_events(plan, [r.rank for r in plan.ranks if r.node_rank in {n.node_rank for n in nodes}]))


def node_ranks(plan: StagePlan, node: NodeSlot) -> list[int]:
    return [r.rank for r in plan.ranks if r.node_rank == node.node_rank]


def local_rank_events(plan: StagePlan, ranks: Sequence[int]) -> list[StageEvent]:
    """The beacons and reports of ``ranks`` as this machine's disk has them, each gone rank's beacon
    settled first to its exact step count (an agent killed before it could settle them)."""
    from launcher.runtime.stepcount import settle

    settle(plan.paths, ranks)
    events: list[StageEvent] = []
    for rank in ranks:
        beacon = read_json(plan.paths.progress(rank))
        if isinstance(beacon, dict):
            events.append(RankBeacon(rank, RankProgress.from_dict(beacon)))
        report = read_json(plan.paths.report(rank))
        if isinstance(report, dict):
            events.append(RankReported(RankReport.from_dict(report)))
    return events


class LocalTransport(Transport):
    """This machine: the agent is a child process in its own session."""

    def describe(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str]) -> str:
        # the same launch written as the plain torchrun command (launcher.runtime.agent is torchrun)
        args = list(agent_argv[list(agent_argv).index("launcher.runtime.agent") + 1 :])
        return shlex.join(["torchrun", *args])

    def prepare(self, plan: StagePlan, nodes: Sequence[NodeSlot]) -> None:
        """Nothing to do: the run loop wrote ``worker.json`` into this machine's stage directory."""

    def spawn(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            list(agent_argv),
            env={**os.environ, **env, ENV_PARENT_PID: str(os.getpid())},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it decides teardown
        )


LOCAL = LocalTransport()
