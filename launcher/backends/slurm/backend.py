"""The srun engine: the torchrun engine with an ``srun`` step per node, inside a Slurm batch job.

From the user's ``launch``, the run is handed to Slurm as one batch job (the Slurm submitter,
``launcher.backends.slurm.submit``). Inside that job the same ``run_job`` runs with this engine: the
nodes are the allocation's, planned as usual, and each node's torchrun agent is started by
``SrunTransport`` as a one-task step on that node; its output (rank lines and the ranks' forwarded
beacons and reports) comes back through srun. Everything else (agent argv, log routing, rank
failures, restarts, teardown) is the torchrun engine's, unchanged. Slurm adds one failure of its
own: a node lost mid-run (its ranks fell silent and its slurmd does not answer), its ranks lost with it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

from launcher.backends.slurm import commands
from launcher.backends.slurm.script import srun_argv
from launcher.backends.torchrun import TorchrunEngine, TorchrunStage, agent_argv
from launcher.backends.transports import Transport, node_ranks
from launcher.errors import BackendError, PlanError
from launcher.evidence import RankEvidence
from launcher.procutil import signal_group, stop_groups
from launcher.protocol import ENV_PARENT_PID, NODE_LOST
from launcher.hardware.devices import NodeInventory, discover
from launcher.stage.engine import HandleStatus, LaunchRequest, StageHandle
from launcher.stage.events import RanksLost
from launcher.stage.plan import NodeTarget

if TYPE_CHECKING:
    from launcher.spec.model import LoadedJob
    from launcher.stage.logrouting import LogRouter
    from launcher.stage.plan import NodeSlot, StagePlan

SRUN_STOP_S = 2.0  # after SIGTERM, how long an srun may take to cancel its step before SIGKILL
PROBE_S = 2.0  # how long a node's slurmd may take to accept a connection before it counts as lost
REPORT_GRACE_S = 3.0  # a step that ended 0 has this long for its ranks' reports to appear (NFS)
# A node whose ranks' beacons (rewritten twice a second) have not changed for this long is probed;
# its slurmd's answer decides (a busy filesystem delays beacons, it does not lose a node).
SILENT_S = 4.0
CHECK_EVERY_S = 1.0
EVIDENCE_TIMEOUT_S = 30.0  # an evidence step: srun's start, py-spy per rank, the ranks' accounts (3 s)


class SrunTransport(Transport):
    """A node of the allocation: its agent is ``srun --nodes=1 --nodelist=NODE ... agent``. The
    run directory is on the cluster's shared filesystem: nothing to copy either way, and what the
    live channel missed is read from there (``Transport.collect``)."""

    def describe(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str]) -> str:
        return shlex.join(srun_argv(node, plan.job, agent_argv))

    def prepare(self, plan: StagePlan, nodes: Sequence[NodeSlot]) -> None:
        """Nothing: every node reads ``worker.json`` where the run loop wrote it."""

    def spawn(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        step_env = {**os.environ, **env}  # srun --export=ALL hands it to the agent: no secret on a command line
        step_env.pop(ENV_PARENT_PID, None)  # the agent's parent is its node's slurmstepd
        return subprocess.Popen(
            srun_argv(node, plan.job, agent_argv),
            env=step_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C and scancel reach the launcher, which decides teardown
        )

    def evidence(self, plan: StagePlan, node: NodeSlot) -> list[RankEvidence]:
        """The node's evidence, gathered there by one more step of the job (``--overlap``: it
        shares the CPUs the stage's step holds), printed as one JSON line."""
        ranks = node_ranks(plan, node)
        argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node.host}", "--cpus-per-task=1", "--overlap", "--export=ALL",
                f"--job-name={plan.job}-evidence", node.target.python, "-m", "launcher.runtime.hangdump", str(plan.stage_dir),
                "--host", node.host, "--ranks", ",".join(map(str, ranks))]  # fmt: skip
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=EVIDENCE_TIMEOUT_S, env={**os.environ})
            found = json.loads(done.stdout.strip().splitlines()[-1])["evidence"]
            return [RankEvidence.from_dict(e) for e in found]
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, KeyError, TypeError) as exc:
            return [RankEvidence(rank, node.host, None, "unknown", "none", note=f"not gathered (srun): {type(exc).__name__}") for rank in ranks]

    def stop(self, procs: Sequence[subprocess.Popen], grace_s: float) -> None:
        """SIGTERM makes each srun cancel its step (Slurm kills the agent and its ranks). An srun
        whose node is lost waits for an answer that never comes: SIGKILL it after SRUN_STOP_S."""
        stop_groups(list(procs), min(grace_s, SRUN_STOP_S))


SRUN = SrunTransport()


class SrunEngine(TorchrunEngine):
    name = "slurm"

    def check_job(self, job: LoadedJob, cluster: str | None) -> None:
        check_no_cluster_file(job, cluster)

    @property
    def plans_on_own_cluster(self) -> bool:
        return True

    def pool_nodes(self, job: LoadedJob) -> list[NodeTarget]:
        return allocation_nodes(job)

    def after_a_notice(self, plan: StagePlan) -> str:
        return "its Slurm job requeues itself when it saved progress"

    def transport(self, node: NodeSlot) -> Transport:
        return SRUN

    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        commands_ = tuple(f"[{node.host}] $ {SRUN.describe(node, plan, agent_argv(plan, node))}" for node in plan.nodes)
        return LaunchRequest(self.name, commands_, ("inside the job, one srun step per node runs its torchrun agent",))

    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        stage = SrunStage(plan, logs, self.transport)
        stage.start()
        return stage


def check_no_cluster_file(job: LoadedJob, cluster: str | None) -> None:
    if cluster or job.spec.cluster:
        where = "--cluster" if cluster else f"{job.path}: cluster"
        raise PlanError(f"{where}: a cluster file is for the torchrun backend over SSH; on Slurm the nodes are the job's allocation")
    if job.spec.resources.elastic:
        raise PlanError(
            f"{job.path}: resources.nodes: an elastic world ({{min, max}}) runs on a cluster file's hosts (torchrun over SSH); "
            "on Slurm give one node count (Slurm's own --requeue restarts a lost allocation)"
        )


class SrunStage(TorchrunStage):
    """The torchrun stage, plus Slurm's own failure: a node lost mid-run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._started_at = time.time()
        self._ended_without_reports: dict[str, float] = {}
        self._quiet_since: dict[int, tuple[float | None, float]] = {}  # rank -> (its beacon's t, when that was new)
        self._next_check = 0.0
        self._lost_nodes: dict[str, str] = {}  # host -> why

    def poll(self) -> HandleStatus:
        """The torchrun stage's, and Slurm's own: a lost node (its ranks silent and its slurmd
        gone, found here within seconds; Slurm itself takes SlurmdTimeout), and a step that ended
        with 0 but without its ranks' reports (srun ends so after "Node failure on NODE")."""
        status = super().poll()
        if status.done and not status.ok:
            return status
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + CHECK_EVERY_S
            lost = self._check_silent_nodes()
            if lost:
                return HandleStatus(done=True, ok=False, detail="; ".join(f"lost node {h} ({why})" for h, why in lost.items()))
        for node, _, proc in self._agents:
            if proc.poll() != 0 or not self._unreported(node):
                continue
            first = self._ended_without_reports.setdefault(node.host, time.monotonic())
            if time.monotonic() - first > REPORT_GRACE_S:
                return HandleStatus(done=True, ok=False, detail=f"the srun step on {node.host} ended without its ranks' reports")
        return status

    def _check_silent_nodes(self) -> dict[str, str]:
        """Probe the running nodes whose every rank's beacon has stood still for SILENT_S (a rank
        never heard from: since the stage started); those whose slurmd is gone are lost. A probe
        whose slurmd answers costs one connection, and the silence is counted again."""
        now, silent = time.monotonic(), []
        for node, _, proc in self._agents:
            if proc.poll() is not None or node.host in self._lost_nodes:
                continue
            quiet = True
            for slot in self._ranks_of(node):
                t = self.logs.beacon_times.get(slot)
                last_t, since = self._quiet_since.setdefault(slot, (None, now))
                if t != last_t:
                    self._quiet_since[slot] = (t, now)
                    since = now
                quiet = quiet and now - since > SILENT_S
            if quiet:
                silent.append(node)
        if not silent:
            return {}
        for node in silent:  # probed once per silence: a slurmd that answered is not asked again soon
            for slot in self._ranks_of(node):
                self._quiet_since[slot] = (self._quiet_since[slot][0], now)
        lost = lost_nodes(silent)
        self._lost_nodes.update(lost)
        return lost

    def _ranks_of(self, node: NodeSlot) -> list[int]:
        return [r.rank for r in self.plan.ranks if r.node_rank == node.node_rank]

    def stop(self, grace_s: float = 5.0) -> None:
        for node, _, proc in self._agents:  # the srun of a lost node would wait for an answer in vain
            if node.host in self._lost_nodes and proc.poll() is None:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        super().stop(grace_s)

    def _unreported(self, node: NodeSlot) -> list[int]:
        return [r for r in self._ranks_of(node) if r not in self.logs.reported]

    def collect(self) -> None:
        """The files on the shared filesystem, then: a node whose ranks left no report and whose
        slurmd is gone was lost, its ranks with it, last heard of when their beacons last came
        (so the failure's root cause names the node and not a peer that lost its connection to it)."""
        super().collect()
        silent = {node.host: (node, self._unreported(node)) for node in self.plan.nodes}
        silent = {host: entry for host, entry in silent.items() if entry[1]}
        if not silent:
            return
        known = {h: why for h, why in self._lost_nodes.items() if h in silent}
        unknown = [node for host, (node, _) in silent.items() if host not in known]
        for host, reason in {**known, **lost_nodes(unknown)}.items():
            ranks = silent[host][1]
            seen = max((self.logs.beacon_times[r] for r in ranks if r in self.logs.beacon_times), default=self._started_at)
            self.emit(RanksLost(tuple(ranks), host, NODE_LOST, f"lost node {host} ({reason})", at=seen))
            self.logs.route(f"gpulaunch: lost node {host} ({reason})", host)


def lost_nodes(nodes: Sequence[NodeSlot]) -> dict[str, str]:
    """host -> why, for the nodes that are gone."""
    return commands.probe_nodes([n.host for n in nodes], {n.host: n.target.address for n in nodes}, timeout_s=PROBE_S)


def allocation_nodes(job: LoadedJob) -> list[NodeTarget]:
    """The job's nodes, batch host (where this launcher runs) first: names from Slurm, each one's
    CPUs from the allocation, GPUs as the batch host sees its own (Slurm grants each node the same
    ``--gpus-per-node``), addresses from ``scontrol show node``."""
    env = os.environ
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise BackendError("the slurm backend runs its stages inside a Slurm job (no SLURM_JOB_NODELIST here)")
    names = commands.hostnames(nodelist)
    cpus = dict(zip(names, commands.parse_cpus_per_node(env.get("SLURM_JOB_CPUS_PER_NODE", ""))))
    here = env.get("SLURMD_NODENAME")
    if here in names:
        names = [here, *(n for n in names if n != here)]
    records = commands.node_records(names)
    granted = commands.gpus_per_node_env(env.get("SLURM_GPUS_PER_NODE")) or len([g for g in env.get("SLURM_JOB_GPUS", "").split(",") if g])
    seen = discover(visible_override=job.spec.env.get("CUDA_VISIBLE_DEVICES")) if granted else None
    if seen is not None and job.spec.preflight.gpu_health:  # this node's; every rank checks its own at its start
        problems = seen.unfit_gpus(granted, min_free_fraction=job.spec.preflight.min_free_gpu_memory)
        if problems:
            raise PlanError("\n".join([*problems, "preflight: nothing was started on the allocation"]))
    gpus = seen.gpus[:granted] if seen else ()
    notes = (*(seen.notes if seen else ()), f"Slurm allocation: {granted} GPU(s) per node")
    fallback = int(env.get("SLURM_CPUS_ON_NODE", "1") or 1)
    return [
        NodeTarget(
            name=name,
            address=records.get(name, {}).get("NodeAddr") or name,
            inventory=NodeInventory(name, cpus.get(name, fallback), gpus, "slurm allocation", env.get("CUDA_VISIBLE_DEVICES"), notes),
            python=sys.executable,
        )
        for name in names
    ]
