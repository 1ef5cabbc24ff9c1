"""The torchrun backend: one PyTorch elastic agent (torch.distributed.run) per node.

On this machine the agent is a child process in its own session; on other hosts it runs
through the OpenSSH client (see ``launcher.backends.ssh``). Either way its merged output comes
back through a pipe to the LogRouter, and stopping it is: SIGTERM to the agent (which stops its
workers), SIGKILL after a grace period, then SIGKILL to any worker still alive, by pid.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

from launcher.agent import PORT_IN_USE_EXIT
from launcher.backends.base import Backend, BackendStatus, RankExit
from launcher.errors import BackendError
from launcher.plan import LaunchPlan, NodeLaunch
from launcher.procutil import kill_now, stage_worker_pids


# How long a failed agent's pipe may stay silent before its remaining output is given up on
# (a stray child can hold the pipe open)
AGENT_DRAIN_IDLE_S = 2.0


class TorchrunBackend(Backend):
    name = "torchrun"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._agents: list[tuple[NodeLaunch, subprocess.Popen]] = []

    @staticmethod
    def describe_plan(plan: LaunchPlan) -> list[str]:
        """Per node: the exact command (plain ``torchrun`` form; over SSH, the ssh command)."""
        lines = []
        for node in plan.nodes:
            if node.target.ssh is not None:
                from launcher.backends.ssh import remote_agent_command

                lines.append(f"[{node.host}] $ {shlex.join(remote_agent_command(node, plan))}")
            else:
                lines.append(f"[{node.host}] $ {node.torchrun_command()}")
        lines.append("(each node runs its command via `python -m launcher.agent`: torchrun with a parent-death signal)")
        if "--start-method=forkserver" in plan.nodes[0].argv:
            lines.append("(--start-method=forkserver: ranks are forked from a server that has imported torch once per node)")
        return lines

    def _command(self, node: NodeLaunch) -> tuple[list[str], dict[str, str]]:
        if node.target.ssh is not None:
            from launcher.backends.ssh import remote_agent_command

            return remote_agent_command(node, self.plan), dict(os.environ)
        env = {**os.environ, **node.env, "LAUNCHER_PARENT_PID": str(os.getpid())}
        return list(node.argv), env

    def start(self) -> None:
        self.plan.stage_dir.mkdir(parents=True, exist_ok=True)
        if any(n.target.ssh is not None for n in self.plan.nodes):  # several servers (issue 4)
            from launcher.backends import ssh

            ssh.prepare_remote_stages(self.plan)  # stage dir + worker.json on every host
        for node in self.plan.nodes:
            argv, env = self._command(node)
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    # over ssh, stdin is the remote agent's lifeline: closing it stops that host
                    stdin=subprocess.PIPE if node.target.ssh is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C reaches the launcher only; it decides teardown
                )
            except OSError as exc:
                self.stop()
                raise BackendError(f"cannot start the torchrun agent for {node.host}: {exc}") from None
            assert proc.stdout is not None
            if node.target.ssh is not None:
                ssh.send_agent_env(proc, node)
            self.logs.follow(proc.stdout, node.host)
            self._agents.append((node, proc))

    def poll(self) -> BackendStatus:
        codes = [(node, proc.poll()) for node, proc in self._agents]
        failed = [(node, code) for node, code in codes if code not in (None, 0)]
        if failed:
            # One failed agent ends the job: the supervisor stops the rest at once. Its failure
            # records are its last lines; route them before reading which ranks failed.
            for node, _ in failed:
                self.logs.drain(node.host, idle_s=AGENT_DRAIN_IDLE_S)
            port_lost = any(code == PORT_IN_USE_EXIT for _, code in failed)
            return BackendStatus(
                done=True,
                ok=False,
                rank_exits=self._rank_exits(),
                detail=self._detail(failed),
                extra={"rendezvous_port_in_use": port_lost},
            )
        if any(code is None for _, code in codes):
            return BackendStatus(done=False)
        return BackendStatus(done=True, ok=True)

    def _detail(self, failed: list[tuple[NodeLaunch, int]]) -> str:
        return "; ".join(
            f"rendezvous port {self.plan.master_port} on {node.host} was already in use"
            if code == PORT_IN_USE_EXIT
            else f"agent on {node.host} exited with {code}"
            for node, code in failed
        )

    def _rank_exits(self) -> tuple[RankExit, ...]:
        return tuple(
            RankExit(
                rank=int(rec["rank"]),
                exitcode=rec.get("exitcode"),
                signal=rec.get("signal"),
                oom_suspected=bool(rec.get("oom_suspected")),
                host=rec.get("host"),
            )
            # the ranks that failed on their own first; those their agent stopped, after
            for rec in sorted(self.logs.agent_failures, key=lambda r: bool(r.get("collateral")))
        )

    def stop(self, grace_s: float = 5.0) -> None:
        remote = [proc for node, proc in self._agents if node.target.ssh is not None and proc.poll() is None]
        if remote:  # cut every lifeline at once; returns when those hosts have stopped (issue 4)
            from launcher.backends.ssh import stop_remote_agents

            stop_remote_agents(remote, grace_s)
        running = [proc for _, proc in self._agents if proc.poll() is None]
        for proc in running:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self._kill_stray_workers()

    def _kill_stray_workers(self) -> None:
        # Belt and braces: workers also die with their agent (parent-death signal), but a rank
        # that outlived both is found by the pid and start time in its progress file.
        kill_now(list(stage_worker_pids(self.plan.stage_dir).values()))

    def collect(self) -> None:
        if any(n.target.ssh is not None for n in self.plan.nodes):  # reports back over ssh (issue 4)
            from launcher.backends.ssh import fetch_reports

            fetch_reports(self.plan, self.logs)

    def agent_pids(self) -> list[int]:
        return [proc.pid for _, proc in self._agents]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
