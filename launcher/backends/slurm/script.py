"""What the launcher asks Slurm for: the allocation, the sbatch script, each node's srun line.

Pure functions of the spec and what ``sinfo`` reported: nothing here runs a command, so the dry
run prints exactly what a run submits, and a request the partition can never hold is refused
(with what the partition has) before anything is submitted.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from launcher.backends.slurm.commands import Partition, time_limit
from launcher.errors import EXIT_INTERRUPTED, PlanError
from launcher.protocol import ENV_SLURM_INSIDE
from launcher.runtime.devices import GpuInfo, NodeInventory
from launcher.stage.plan import NodeTarget

if TYPE_CHECKING:
    from launcher.spec.model import LoadedJob
    from launcher.stage.plan import NodeSlot

SUBMITTED_MODULE = "launcher.control.submitted"
SCRIPT_FILE = "job.sbatch"
SPEC_FILE = "slurm-spec.yaml"  # the effective spec the job runs, secrets included: readable by the user only
RECORD_FILE = "slurm.json"  # the job id and what a result written without the job needs
OUTPUT_PATTERN = "slurm-%j.out"
MARGIN_S = 60  # added to the stages' timeouts for Slurm's time limit: start-up and teardown
# What ``launch`` (Ctrl-C, ``launch stop``) sends the batch script alone (``scancel --batch
# --signal=USR2``) to stop a running job: the script hands the launcher inside a SIGTERM and, once
# it has written its result, cancels the job itself, so that Slurm records CANCELLED (batch_body).
# Not SIGTERM: Slurm's own (time limit, a plain scancel) reaches every process of the batch step,
# the launcher included; a SIGTERM handed on as well would be its second: "stop at once".
STOP_SIGNAL = "USR2"


@dataclass(frozen=True)
class Allocation:
    """One node-wide task per node, sized for the largest stage."""

    partition: str | None  # None: Slurm's default partition, not known here (a dry run with no controller)
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    time: str

    def describe(self) -> str:
        gpus = f", {self.gpus_per_node} GPU(s)" if self.gpus_per_node else ""
        where = f"partition {self.partition}" if self.partition else "the default partition"
        return f"{self.nodes} node(s) x {self.cpus_per_task} CPU(s){gpus} in {where}, time limit {self.time}"


def allocation_for(job: LoadedJob, partition: Partition | None) -> Allocation:
    """The allocation the spec asks for, or a PlanError (exit 2) saying what the partition has
    when it can never hold it (a job that would pend forever is never submitted). ``partition``
    None: it is not known (a dry run with no controller to ask); the spec alone decides: GPUs only
    where it asks for them (``gpus_per_node: N``, or ``device: cuda``: then one where ``auto``),
    otherwise ``cpu_workers`` ranks (one where ``auto``)."""
    spec, res = job.spec, job.spec.resources
    if partition is None:
        asked = res.gpus_per_node if isinstance(res.gpus_per_node, int) else (1 if res.device == "cuda" else 0)
        gpus = 0 if res.device == "cpu" else asked
        ranks = gpus or (res.cpu_workers if isinstance(res.cpu_workers, int) else 1)
        stages = len(spec.world_sizes or (1,))
        limit = spec.slurm.time or time_limit(stages * (spec.timeouts.rendezvous_s + spec.timeouts.run_s) + MARGIN_S)
        return Allocation(spec.slurm.partition, res.nodes, gpus, spec.slurm.cpus_per_task or ranks, limit)
    fewest_gpus = min((n.gpus for n in partition.nodes), default=0)
    if res.device == "cpu":
        gpus = 0
    elif res.gpus_per_node == "auto":
        gpus = fewest_gpus  # every GPU each node has: the fewest any node of the partition has
    else:
        gpus = res.gpus_per_node
    where = f"partition {partition.name} has {partition.describe()}"
    if res.device == "cuda" and gpus == 0:
        raise PlanError(f"{job.path}: resources.device: 'cuda' requested but {where}; nothing was submitted")
    if gpus:
        ranks = gpus
    elif res.cpu_workers == "auto":
        ranks = min((n.cpus for n in partition.nodes), default=1)
    else:
        ranks = res.cpu_workers
    cpus = spec.slurm.cpus_per_task or ranks
    problem = None
    if len(partition.nodes) < res.nodes:
        problem = f"resources.nodes: {res.nodes} node(s) requested"
    elif sum(n.gpus >= gpus for n in partition.nodes) < res.nodes:
        problem = f"resources.gpus_per_node: {gpus} GPU(s) per node on {res.nodes} node(s) requested"
    elif sum(n.gpus >= gpus and n.cpus >= cpus for n in partition.nodes) < res.nodes:
        field = "slurm.cpus_per_task" if spec.slurm.cpus_per_task else "resources.cpu_workers (one CPU per rank)"
        problem = f"{field}: {cpus} CPU(s) per node on {res.nodes} node(s) requested"
    if problem:
        raise PlanError(f"{job.path}: {problem}, but {where}; nothing was submitted")
    stages = len(spec.world_sizes or (1,))
    limit = spec.slurm.time or time_limit(stages * (spec.timeouts.rendezvous_s + spec.timeouts.run_s) + MARGIN_S)
    return Allocation(partition.name, res.nodes, gpus, cpus, limit)


def fitting_nodes(alloc: Allocation, partition: Partition) -> list[str]:
    """The partition's first nodes that can hold the allocation's share of one node."""
    fit = [n.name for n in partition.nodes if n.gpus >= alloc.gpus_per_node and n.cpus >= alloc.cpus_per_task]
    return fit[: alloc.nodes]


def planned_nodes(alloc: Allocation, names: Sequence[str], addresses: Mapping[str, str]) -> list[NodeTarget]:
    """The nodes a plan is made on before the job runs, with what the allocation grants on each
    (inside the job, the plan is made again on the nodes Slurm granted)."""
    gpus = tuple(GpuInfo(i, i, "GPU (Slurm GRES)", 0, None, None, f"gres-gpu-{i}") for i in range(alloc.gpus_per_node))
    return [
        NodeTarget(name, addresses.get(name, name), NodeInventory(name, alloc.cpus_per_task, gpus, "slurm request"), python=sys.executable)
        for name in names
    ]


def check_paths(*paths: Path) -> None:
    """#SBATCH lines are split at blanks and expand ``%``: refuse such paths (exit 2)."""
    for path in paths:
        if any(c.isspace() or c in "%\"'\\" for c in str(path)):
            raise PlanError(f"{path}: an #SBATCH line cannot hold a path with blanks, quotes or '%' (--output, --chdir); choose another --out or working directory")


def sbatch_script(job: LoadedJob, alloc: Allocation, run_dir: Path, *, python: str, cwd: Path) -> str:
    """The batch script: the allocation as #SBATCH lines (the spec's extra options last), and a
    body that runs the launcher again inside the job, into ``run_dir``."""
    s = job.spec.slurm
    options = [
        f"--job-name={job.spec.name}",
        f"--nodes={alloc.nodes}",
        "--ntasks-per-node=1",  # one task per node: its torchrun agent starts the node's ranks
        f"--cpus-per-task={alloc.cpus_per_task}",
        *([f"--gpus-per-node={alloc.gpus_per_node}"] if alloc.gpus_per_node else []),
        *([f"--partition={alloc.partition}"] if alloc.partition else []),
        *([f"--account={s.account}"] if s.account else []),
        *([f"--qos={s.qos}"] if s.qos else []),
        f"--time={alloc.time}",
        *([f"--constraint={s.constraint}"] if s.constraint else []),
        f"--output={run_dir / OUTPUT_PATTERN}",
        f"--chdir={cwd}",
        "--export=ALL",  # the environment launch ran in (PATH, PYTHONPATH, the venv, SLURM_CONF)
        "--no-requeue",  # never again into the same run directory after a node failure
        *s.extra_sbatch,
    ]
    return "\n".join(
        [
            "#!/bin/bash",
            f"# gpulaunch: {job.spec.name} from {job.path}",
            *(f"#SBATCH {o}" for o in options),
            "",
            "# The launcher again, inside the allocation: one srun step per node, each a torchrun agent",
            "# with a static rendezvous on the first node; results and logs go to the run directory.",
            f"export {ENV_SLURM_INSIDE}=1",
            *batch_body([python, "-m", SUBMITTED_MODULE, "slurm", str(run_dir)]),
            "",
        ]
    )


def batch_body(argv: Sequence[str]) -> list[str]:
    """The script's lines that run the launcher inside (``argv``) and end the job as its result
    says: COMPLETED (exit 0), FAILED (any other), CANCELLED once stopped. A batch script that
    merely exits 130 leaves a FAILED job in Slurm's records however it was stopped, and ``scancel``
    from ``launch`` comes only after STOP_GRACE_S: so the script cancels the job itself once the
    launcher has stopped and written its result (a cancel asked before the script ends makes the
    job CANCELLED). ``launch`` sends SIG``STOP_SIGNAL`` to this shell alone, which hands the
    launcher one SIGTERM. The launcher runs in the background (a shell runs its traps only between
    commands) with SIG``STOP_SIGNAL`` ignored, so ``wait`` ends with 128+that signal only when the
    trap cut it short; the shell ignores SIGTERM, which Slurm sends every process of the batch
    step (time limit, a plain scancel): the launcher gets it directly, the shell stays to report."""
    stop = STOP_SIGNAL
    return [
        f"# launch stops the run with SIG{stop} to this shell: the launcher gets SIGTERM, stops its steps and",
        "# writes its result, then the job cancels itself (Slurm records CANCELLED; ending 130 it would be FAILED)",
        "stopped=",
        f"trap '' {stop}",
        shlex.join(argv) + " &",
        "launcher=$!",
        f"trap '[ -n \"$stopped\" ] || {{ stopped=1; kill -TERM \"$launcher\" 2>/dev/null; }}' {stop}  # once",
        "trap '' TERM  # Slurm's own SIGTERM (time limit, scancel) reaches the launcher itself",
        f"cut_short=$((128 + $(kill -l {stop})))  # what wait returns when the trap cut it short",
        'code=$cut_short',
        'while [ "$code" -eq "$cut_short" ]; do wait "$launcher"; code=$?; done',
        f'if [ "$code" -eq {EXIT_INTERRUPTED} ] || {{ [ -n "$stopped" ] && [ "$code" -gt 128 ]; }}; then',
        '    scancel --quiet "$SLURM_JOB_ID"  # stopped: the job ends CANCELLED, its result written',
        "fi",
        'exit "$code"',
    ]


def output_path(run_dir: Path, job_id: str) -> Path:
    return run_dir / OUTPUT_PATTERN.replace("%j", job_id)


def srun_argv(node: NodeSlot, job: str, agent_argv: Sequence[str]) -> list[str]:
    """One node's step: its torchrun agent, on all the CPUs (and GPUs) the job has there. The
    node's env travels in srun's own environment (``--export=ALL``), never on a command line."""
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node.host}",
        f"--cpus-per-task={node.target.inventory.cpu_count}",
        "--overlap",  # a stage's steps may start while the last stage's are still being reaped
        "--export=ALL",
        f"--job-name={job}-node{node.node_rank}",
        *agent_argv,
    ]

