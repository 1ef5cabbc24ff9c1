"""The SSH transport: the torchrun engine's way to a remote host.

Each agent runs under the host helper's lifeline wrapper (``hostagent agent``), in a session
multiplexed over the host's one connection (``link``): its stdin is the lifeline, its output the
stage's live channel (rank lines, and the beacons and reports the agent forwards).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from launcher.backends.ssh.command import EXIT_SSH_ERROR, REQUEST_TIMEOUT_S, SshError, _agent_remote_argv, remote_agent_command
from launcher.backends.ssh.link import HostLink, _parallel, current_links
from launcher.backends.transports import Transport, node_ranks
from launcher.errors import BackendError
from launcher.evidence import RankEvidence
from launcher.protocol import RankProgress, RankReport
from launcher.stage.events import RankBeacon, RankReported, StageEvent

# py-spy per rank and the ranks' own accounts (up to 3 s) on the host: well within this
EVIDENCE_TIMEOUT_S = 30.0

if TYPE_CHECKING:
    from launcher.spec.cluster import HostConfig
    from launcher.stage.logrouting import LogRouter
    from launcher.stage.plan import NodeSlot, StagePlan


class SshTransport(Transport):
    """Remote nodes: each agent runs under the host helper's lifeline wrapper, in a session over
    the host's one connection."""

    remote = True

    def __init__(self) -> None:
        self._link_of: weakref.WeakKeyDictionary[subprocess.Popen, HostLink] = weakref.WeakKeyDictionary()

    def describe(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str]) -> str:
        return shlex.join(remote_agent_command(_host(node), plan.stage_dir, agent_argv))

    def prepare(self, plan: StagePlan, nodes: Sequence[NodeSlot], timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Create the stage directory on every remote host and put ``worker.json`` there."""
        links = current_links()

        def prepare(node: NodeSlot) -> str | None:
            try:
                links.get(_host(node)).call("prepare", timeout_s=timeout_s, stage=str(plan.stage_dir), config=plan.worker_for(node).to_json())
            except SshError as exc:
                return f"{node.host}: cannot prepare the run directory {plan.stage_dir}: {exc}"
            return None

        problems = [p for p in _parallel(prepare, nodes) if p]
        if problems:
            raise BackendError("; ".join(problems))

    def spawn(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        host = _host(node)
        link = current_links().get(host)
        if link.lost():
            raise OSError(f"lost host {node.host} ({link.lost_reason})")
        proc = subprocess.Popen(
            link.session_argv(_agent_remote_argv(host, plan.stage_dir, agent_argv)),
            env=dict(os.environ),
            stdin=subprocess.PIPE,  # the remote agent's lifeline: closing it stops that host
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it decides teardown
        )
        slots = [
            {"rank": r.rank, "local_rank": r.local_rank, "node_rank": r.node_rank, "world_size": plan.world_size, "host": r.host, "device": r.device}
            for r in plan.ranks
            if r.node_rank == node.node_rank
        ]
        link.adopt(proc, json.dumps({"env": env, "ranks": slots}))
        self._link_of[proc] = link
        return proc

    def lost(self, proc: subprocess.Popen) -> str | None:
        link = self._link_of.get(proc)
        if link is None:
            return None
        if proc.poll() == EXIT_SSH_ERROR:  # the session ended with the connection, or just before
            return link.settle(wait_s=1.0)
        return link.lost()

    def stop(self, procs: Sequence[subprocess.Popen], grace_s: float) -> None:
        """Close every lifeline at once, then wait for the ssh clients, which exit when their
        remote wrapper has stopped the agent and its ranks (it uses the same grace period). A lost
        host is not waited for: its sessions and its connection are ended here, by pid."""
        waiting, lost = [], []
        for proc in procs:
            link = self._link_of.get(proc)
            if link is not None and link.lost():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                lost.append(link)
                continue
            if link is not None:
                link.cut(proc)
            elif proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            waiting.append(proc)
        _parallel(lambda link: link.finish_close(wait_s=0.0), lost)  # each may take its master's SIGTERM grace
        deadline = time.monotonic() + grace_s + 5.0  # remote grace + SIGKILL + the way back
        for proc in waiting:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # the caller's SIGTERM/SIGKILL path takes over

    def signal(self, plan: StagePlan, nodes: Sequence[NodeSlot], signum: int) -> None:
        """``signum`` to every live rank of these hosts: one request to each host's helper, in parallel."""
        links = current_links()

        def send(node: NodeSlot) -> None:
            with contextlib.suppress(SshError):
                links.get(_host(node)).call("signal", timeout_s=10.0, stage=str(plan.stage_dir), signum=int(signum))

        _parallel(send, nodes)

    def evidence(self, plan: StagePlan, node: NodeSlot) -> list[RankEvidence]:
        """The host's evidence, gathered there by its helper (one request on the run's connection)."""
        try:
            data = current_links().get(_host(node)).call("evidence", timeout_s=EVIDENCE_TIMEOUT_S, stage=str(plan.stage_dir), host=node.host, ranks=node_ranks(plan, node))
        except SshError as exc:
            return [RankEvidence(rank, node.host, None, "unknown", "none", note=f"not gathered: {exc}") for rank in node_ranks(plan, node)]
        return [RankEvidence.from_dict(e) for e in data.get("evidence") or ()]

    def collect(self, plan: StagePlan, nodes: Sequence[NodeSlot], logs: LogRouter, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Any report the live channel missed (its stream cut short), fetched from its host and
        delivered as an event: one request per host that has such a rank, none when every report
        came. A lost host is not asked: its ranks were lost with it."""
        links = current_links()
        missing = {n.node_rank: [r.rank for r in plan.ranks if r.node_rank == n.node_rank and r.rank not in logs.reported] for n in nodes}
        _parallel(lambda node: _fetch(plan, node, missing[node.node_rank], links.get(_host(node)), logs, timeout_s), [n for n in nodes if missing[n.node_rank]])
        writer = next((n for n in nodes if n.node_rank == plan.ranks[0].node_rank), None)  # rank 0's host: it writes every checkpoint
        if writer is not None and links.get(_host(writer)).lost() is None:
            copy_latest_checkpoint(plan, links.get(_host(writer)), logs, writer.host)


def copy_latest_checkpoint(plan: StagePlan, link: HostLink, logs: LogRouter, host: str) -> None:
    """The newest complete checkpoint on rank 0's host, copied to the same path here (one tar
    stream over the run's connection) unless this machine has it already (a shared filesystem):
    the run's own copy, for ``launch resume`` or another run's ``params.resume``. Published with a
    rename, as the ranks publish theirs."""
    root = Path(plan.worker.checkpoint_dir)
    have = {p.name for p in root.glob("step-*")} if root.is_dir() else set()
    probe = subprocess.run(link.session_argv(["sh", "-c", f"cd {shlex.quote(str(root))} 2>/dev/null && ls -d step-* 2>/dev/null | sort | tail -n 1"]),
                           capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S, check=False)  # fmt: skip
    newest = probe.stdout.strip()
    if probe.returncode != 0 or not newest or newest in have:
        return
    partial = root / f".partial-fetch-{os.getpid()}"
    partial.mkdir(parents=True, exist_ok=True)
    try:
        with subprocess.Popen(link.session_argv(["tar", "-C", str(root), "-cf", "-", newest]), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as remote:
            done = subprocess.run(["tar", "-xf", "-", "-C", str(partial)], stdin=remote.stdout, capture_output=True, check=False)
            remote.wait(timeout=600)
        if remote.returncode == 0 and done.returncode == 0 and (partial / newest / "manifest.json").is_file():
            os.rename(partial / newest, root / newest)
        else:
            logs.route(f"gpulaunch: could not copy checkpoint {newest} from {host}: {done.stderr.decode(errors='replace').strip()[:200]}", host)
    except (OSError, subprocess.SubprocessError) as exc:
        logs.route(f"gpulaunch: could not copy checkpoint {newest} from {host}: {exc}", host)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _host(node: NodeSlot) -> HostConfig:
    assert node.target.ssh is not None, f"{node.host} is not reached over SSH"
    return node.target.ssh


def _fetch(plan: StagePlan, node: NodeSlot, ranks: list[int], link: HostLink, logs: LogRouter, timeout_s: float) -> None:
    if link.lost() is not None:
        return
    try:
        data = link.call("fetch", timeout_s=timeout_s, stage=str(plan.stage_dir), ranks=ranks)
    except SshError as exc:
        if link.lost() is None:
            logs.route(f"gpulaunch: could not fetch rank reports from {node.host}: {exc}", node.host)
        return
    events: list[StageEvent] = []
    for rel, text in data.get("files", {}).items():
        try:
            content = json.loads(text)
        except ValueError:
            continue
        if Path(rel).parent.name == plan.paths.progress_dir.name:
            events.append(RankBeacon(int(Path(rel).stem[len("rank") :]), RankProgress.from_dict(content)))
        else:
            events.append(RankReported(RankReport.from_dict(content)))  # the run loop writes it here
    logs.emit(*events)


