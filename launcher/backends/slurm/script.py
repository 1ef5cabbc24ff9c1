"""What the launcher asks Slurm for: the allocation, the sbatch script, each node's srun line.

Pure functions of the spec and what ``sinfo`` reported: nothing here runs a command, so the dry
run prints exactly what a run submits, and a request the partition can never hold is refused
(with what the partition has) before anything is submitted.
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from launcher.backends.slurm.commands import Partition, limit_seconds, time_limit
from launcher.errors import EXIT_INTERRUPTED, PlanError
from launcher.protocol import ENV_SLURM_INSIDE
from launcher.hardware.devices import GpuInfo, NodeInventory
from launcher.stage.plan import NodeTarget, auto_world_sizes

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
# Slurm's warning before the time limit (``--signal=B:USR1@N``, also what a preemption sends with
# PreemptParameters=send_user_signal): the batch script hands the launcher inside a SIGTERM (its
# ranks get the stop notice, save and return within preemption.grace_s), then requeues the job
# once progress was saved: the next allocation resumes the run in the same run directory.
WARNING_SIGNAL = "USR1"
# The warning comes this long after preemption.grace_s before the time limit: for the launcher to
# stop the steps, write its result and requeue the job. Slurm sends it up to 60 s sooner, never later.
RESULT_MARGIN_S = 30
SIGNAL_EARLY_S = 60  # how much sooner Slurm may send it (its timer's resolution)
# What the launcher inside exits with when the run was interrupted with progress saved since this
# allocation began (a newer checkpoint, another stage done): resumable, so a warned job is
# requeued. The batch script turns it into 130 (EXIT_INTERRUPTED) for Slurm's record.
EXIT_RESUMABLE = 75  # sysexits' EX_TEMPFAIL


@dataclass(frozen=True)
class Allocation:
    """One node-wide task per node, sized for the largest stage."""

    partition: str | None  # None: Slurm's default partition, not known here (a dry run with no controller)
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    time: str
    ranks_per_gpu: int = 1  # resources.ranks_per_gpu: Slurm is asked for the GPUs, the CPUs are one per rank

    def describe(self) -> str:
        gpus = f", {self.gpus_per_node} GPU(s)" if self.gpus_per_node else ""
        if self.gpus_per_node and self.ranks_per_gpu > 1:
            gpus += f" shared by {self.ranks_per_gpu} ranks each ({self.gpus_per_node * self.ranks_per_gpu} ranks per node)"
        where = f"partition {self.partition}" if self.partition else "the default partition"
        return f"{self.nodes} node(s) x {self.cpus_per_task} CPU(s){gpus} in {where}, time limit {self.time}"


def warning_s(job: LoadedJob) -> int:
    """How long before the time limit Slurm warns the job (``--signal=B:USR1@N``): the spec's
    preemption.grace_s for the ranks to save and return, and RESULT_MARGIN_S for the launcher."""
    return math.ceil(job.spec.preemption.grace_s) + RESULT_MARGIN_S


def _time_limit(job: LoadedJob, ranks_per_node: int) -> str:
    """slurm.time, or every stage's rendezvous_s + run_s, MARGIN_S and the warning's lead: a run
    that keeps to its timeouts never gets the warning (timeouts.run_s ends a run that does not).
    ``scaling.workers: auto`` counts the stages of the ranks the allocation gives each node."""
    spec = job.spec
    if spec.slurm.time:
        return spec.slurm.time
    listed = spec.world_sizes
    if listed is not None:
        stages = len(listed)
    elif spec.scales_auto and not spec.resources.elastic:
        stages = len(auto_world_sizes(max(1, ranks_per_node) * spec.resources.nodes, spec.resources.nodes))
    else:
        stages = 1
    return time_limit(stages * (spec.timeouts.rendezvous_s + spec.timeouts.run_s) + MARGIN_S + warning_s(job))


def _check_warning_fits(job: LoadedJob) -> None:
    """A time limit within the warning's reach would warn (and requeue) the job as it starts."""
    limit = limit_seconds(job.spec.slurm.time or "")
    warn = warning_s(job)
    if limit is not None and limit <= warn + SIGNAL_EARLY_S:
        raise PlanError(
            f"{job.path}: slurm.time: {job.spec.slurm.time} leaves no time to run: Slurm's warning to save and be requeued comes "
            f"preemption.grace_s + {RESULT_MARGIN_S} s = {warn} s before the time limit (up to {SIGNAL_EARLY_S} s sooner); "
            f"set slurm.time to {time_limit(warn + SIGNAL_EARLY_S + 1)} or more, or a shorter preemption.grace_s; nothing was submitted"
        )


def allocation_for(job: LoadedJob, partition: Partition | None) -> Allocation:
    """The allocation the spec asks for, or a PlanError (exit 2) saying what the partition has
    when it can never hold it (a job that would pend forever is never submitted). ``partition``
    None: it is not known (a dry run with no controller to ask); the spec alone decides: GPUs only
    where it asks for them (``gpus_per_node: N``, or ``device: cuda``: then one where ``auto``),
    otherwise ``cpu_workers`` ranks (one where ``auto``). On GPUs, Slurm is asked for the GPUs
    (``--gpus-per-node``) and, by default, one CPU per rank: ``resources.ranks_per_gpu`` ranks
    share each GPU."""
    spec, res = job.spec, job.spec.resources
    _check_warning_fits(job)
    share = res.ranks_per_gpu
    if partition is None:
        asked = res.gpus_per_node if isinstance(res.gpus_per_node, int) else (1 if res.device == "cuda" else 0)
        gpus = 0 if res.device == "cpu" else asked
        ranks = gpus * share or (res.cpu_workers if isinstance(res.cpu_workers, int) else 1)
        return Allocation(spec.slurm.partition, res.nodes, gpus, spec.slurm.cpus_per_task or ranks, _time_limit(job, ranks), share if gpus else 1)
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
        ranks = gpus * share  # ranks_per_gpu ranks on each GPU, a CPU each
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
        if spec.slurm.cpus_per_task:
            field = "slurm.cpus_per_task"
        elif gpus and share > 1:
            field = f"resources.ranks_per_gpu: {share} ranks on each of {gpus} GPU(s), one CPU per rank"
        elif gpus:
            field = "resources.gpus_per_node (a rank per GPU, one CPU per rank)"
        else:
            field = "resources.cpu_workers (one CPU per rank)"
        problem = f"{field}: {cpus} CPU(s) per node on {res.nodes} node(s) requested"
    if problem:
        raise PlanError(f"{job.path}: {problem}, but {where}; nothing was submitted")
    return Allocation(partition.name, res.nodes, gpus, cpus, _time_limit(job, ranks), share if gpus else 1)


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
    body that runs the launcher again inside the job, into ``run_dir``. The job's name carries the
    run's id, as the run directory does (``<job>/<run id>``): ``<job>-<run id>`` in squeue and sacct."""
    s = job.spec.slurm
    options = [
        f"--job-name={job_name(job.spec.name, run_dir)}",
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
        # Requeued (preemption, a lost node, scontrol requeue, the warning below), the job runs the
        # launcher again into the same run directory, which resumes the run from its checkpoints.
        # A job that fails is not requeued: Slurm requeues on those events alone (and RequeueExit).
        "--requeue",
        f"--signal=B:{WARNING_SIGNAL}@{warning_s(job)}",  # the batch shell alone: batch_body
        "--open-mode=append",  # a requeued job's output follows the last allocation's (else truncated)
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
            *batch_body([python, "-m", SUBMITTED_MODULE, "slurm", str(run_dir)], warning_s(job)),
            "",
        ]
    )


def job_name(job: str, run_dir: Path) -> str:
    """The Slurm job's name: the job's and the run's id (the run directory's name)."""
    return f"{job}-{run_dir.name}"


def batch_body(argv: Sequence[str], warn_s: int) -> list[str]:
    """The script's lines that run the launcher inside (``argv``) and end the job as its result
    says: COMPLETED (exit 0), FAILED (any other), CANCELLED once stopped, requeued once warned.

    Stopped: a batch script that merely exits 130 leaves a FAILED job in Slurm's records however
    it was stopped, and ``scancel`` from ``launch`` comes only after STOP_GRACE_S: so the script
    cancels the job itself once the launcher has stopped and written its result (a cancel asked
    before the script ends makes the job CANCELLED). ``launch`` sends SIG``STOP_SIGNAL`` to this
    shell alone, which hands the launcher one SIGTERM.

    Warned: Slurm sends SIG``WARNING_SIGNAL`` to this shell alone ``warn_s`` seconds before the
    time limit (``--signal=B:...``; a preemption may too); the launcher gets one SIGTERM, its ranks
    the stop notice (they save and return within preemption.grace_s), and once it exits with
    EXIT_RESUMABLE (progress saved) the script requeues the job: the launcher of the next
    allocation resumes the run. A run that saved nothing is not requeued (it would start over, and
    over): the script leaves its end to Slurm (TIMEOUT at the time limit, or as preemption decides),
    holding the allocation at most ``warn_s`` + SIGNAL_EARLY_S, then cancels it. A stop wins over a
    warning.

    Slurm's own SIGTERM (time limit, a plain scancel, ``scontrol requeue``, preemption) reaches
    every process of the batch step: the launcher gets it directly and the shell, which ignores
    it, stays to report, and never cancels or requeues: Slurm has decided the job's fate already
    (a cancel then would cancel a requeued job). The launcher runs in the background (a shell runs
    its traps only between commands) with both signals ignored (its own subshell ignores them
    before it becomes the launcher), so ``wait`` ends with 128+one of them only when a trap cut it
    short. The shell's traps (SIGTERM ignored too) are set before the launcher starts, never after:
    a signal that comes while it starts (the shell's next line may run only much later on a busy
    node) is not lost, nor does Slurm's SIGTERM then end the shell; a stop or warning that comes
    before the shell knows the launcher's pid is handed on as soon as it does."""
    stop, warn = STOP_SIGNAL, WARNING_SIGNAL
    job = '"$SLURM_JOB_ID"'
    return [
        f"# launch stops the run with SIG{stop} to this shell: the launcher gets SIGTERM, stops its steps and",
        "# writes its result, then the job cancels itself (Slurm records CANCELLED; ending 130 it would be FAILED).",
        f"# Slurm warns with SIG{warn} {warn_s} s before the time limit (or on preemption): the launcher gets SIGTERM,",
        "# its ranks save and return, and a run that saved progress is requeued: the next allocation resumes it.",
        "stopped= warned= launcher= early=",
        f"cut_stop=$((128 + $(kill -l {stop}))) cut_warn=$((128 + $(kill -l {warn})))  # what wait returns when a trap cut it short",
        "# SIGTERM to the launcher; one that comes before its pid is known is handed on as soon as it is",
        'hand_on() { if [ -n "$launcher" ]; then kill -TERM "$launcher" 2>/dev/null; else early=1; fi; }',
        "# the traps come first: a signal while the launcher starts is not lost",
        f"trap '[ -n \"$stopped\" ] || {{ stopped=1; [ -n \"$warned\" ] || hand_on; }}' {stop}  # once",
        f"trap '[ -n \"$stopped$warned\" ] || {{ warned=1; echo \"gpulaunch: SIG{warn} from Slurm (time limit in {warn_s} s, or preemption):"
        f" stopping the run to save it and requeue the job\"; hand_on; }}' {warn}  # once",
        "trap '' TERM  # Slurm's own SIGTERM (time limit, scancel, requeue, preemption) reaches the launcher itself",
        f"( trap - TERM; trap '' {stop} {warn}; exec {shlex.join(argv)} ) &  # the launcher: SIGTERM its own, {stop} and {warn} the shell's",
        "launcher=$!",
        '[ -z "$early" ] || kill -TERM "$launcher" 2>/dev/null  # stopped or warned as it started',
        "code=$cut_stop",
        'while [ "$code" -eq "$cut_stop" ] || [ "$code" -eq "$cut_warn" ]; do wait "$launcher"; code=$?; done',
        f'launcher= resumable=; [ "$code" -ne {EXIT_RESUMABLE} ] || {{ resumable=1; code={EXIT_INTERRUPTED}; }}  # interrupted, progress saved',
        'if [ -n "$stopped" ] && [ "$code" -gt 128 ]; then',
        f"    scancel --quiet {job}  # stopped: the job ends CANCELLED, its result written",
        'elif [ -n "$warned" ] && [ -n "$resumable" ]; then',
        f"    if scontrol requeue {job}; then  # back to the queue, same job id: its launcher resumes the run",
        '        echo "gpulaunch: Slurm job $SLURM_JOB_ID requeued: the next allocation resumes the run from its last checkpoint"',
        "    else",
        f'        echo "gpulaunch: Slurm job $SLURM_JOB_ID could not be requeued: cancelled, its result written"; scancel --quiet {job}',
        "    fi",
        'elif [ -n "$warned" ] && [ "$code" -gt 128 ]; then  # warned, nothing saved: requeued it would start over',
        '    echo "gpulaunch: the run saved no progress since this allocation began: not requeued; Slurm ends the job"',
        "    trap - TERM  # the launcher has ended: Slurm's SIGTERM (time limit, preemption) may end this shell now",
        f"    sleep {warn_s + SIGNAL_EARLY_S} & nap=$! slept=$cut_stop",
        '    while [ -z "$stopped" ] && { [ "$slept" -eq "$cut_stop" ] || [ "$slept" -eq "$cut_warn" ]; }; do wait "$nap"; slept=$?; done',
        f'    if [ -n "$stopped" ] || [ "$slept" -eq 0 ]; then kill "$nap" 2>/dev/null; scancel --quiet {job}; fi  # not Slurm\'s end: cancelled',
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

