"""How the torchrun backend reaches a node: this machine directly, or another over SSH.

A transport prepares a stage on its nodes, starts one agent process per node whose merged output
comes back through a pipe, stops those agents, and brings rank reports back. The torchrun backend
picks one per node (``torchrun.transport_for``) and otherwise never asks where a node is.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

from launcher.protocol import ENV_PARENT_PID

if TYPE_CHECKING:
    from launcher.control.logrouting import LogRouter
    from launcher.control.planning import NodeSlot, StagePlan


class Transport(ABC):
    remote = False  # whether the node's files live elsewhere (reports must be fetched)

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
        """Ask these agents to end; the backend signals whatever is still running afterwards."""

    def lost(self, proc: subprocess.Popen) -> str | None:
        """Why the host of this agent is gone (``connection closed``, ``no answer for 5 s``), or
        None while it answers (or where, as on this machine, a host cannot be lost)."""
        return None

    def collect(self, plan: StagePlan, nodes: Sequence[NodeSlot], logs: LogRouter) -> None:
        """Bring the nodes' rank reports and progress files into the local stage directory."""


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
