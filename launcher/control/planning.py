"""Spec x nodes -> one engine-neutral ``StagePlan`` per world size (``launcher.stage.plan``).

A plan says, for every rank, its node, local rank and device; for every node, how many ranks it
runs, their threads and the environment they start with; and for the stage, the rendezvous, the
worker config (with the resolved params) and the run directory's layout. This is the one place
that decides the device type and the ranks per node: engines and submitters turn a plan into their
own launch request (torchrun commands, Ray actors, an sbatch script) and never derive any of it
again. Pure: no processes, no sockets (the rendezvous port is passed in), so ``--dry-run`` prints
exactly what a run would do, and impossible requests fail here, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from launcher.checkpoint_store import job_identity
from launcher.errors import PlanError
from launcher.protocol import StagePaths, WorkerConfig, rank_device
from launcher.policies import HangPolicy, RestartPolicy, StragglerPolicy
from launcher.records import SkippedWorld
from launcher.stage.plan import LOOPBACK_ADDR, auto_world_sizes, NodeSlot, NodeTarget, RankSlot, Rendezvous, StagePlan, node_env, user_threads

if TYPE_CHECKING:  # pydantic and yaml: the planner itself needs neither
    from launcher.spec.model import LoadedJob


# --- what the spec asks for, against what the nodes have ------------------------------------------


def choose_device(job: LoadedJob, nodes: Sequence[NodeTarget]) -> str:
    """"cuda" when GPUs are present (or demanded), else "cpu"."""
    wanted = job.spec.resources.device
    fewest = min(n.inventory.gpu_count for n in nodes)
    if wanted == "cuda" and fewest == 0:
        lacking = next(n.name for n in nodes if n.inventory.gpu_count == 0)
        raise PlanError(f"{job.path}: resources.device: 'cuda' requested but {lacking} has no visible GPU")
    if wanted == "cpu" or fewest == 0:
        return "cpu"
    return "cuda"


def device_notes(job: LoadedJob, nodes: Sequence[NodeTarget], device_type: str, per_node: int) -> list[str]:
    """What the plan decided that the spec did not say outright. A spec written for a GPU box
    (``gpus_per_node: 8``) still runs on a laptop's CPU under ``device: auto``, but says so."""
    res = job.spec.resources
    notes = slot_notes(job, per_node * len(nodes), device_type)
    if device_type == "cuda" and res.ranks_per_gpu > 1:
        notes.append(
            f"resources.ranks_per_gpu: {res.ranks_per_gpu} ranks share each GPU (each rank on cuda:<local_rank // "
            f"{res.ranks_per_gpu}>); the process group is gloo over CUDA tensors, as NCCL refuses two ranks on one GPU"
        )
    if device_type != "cpu" or res.device != "auto" or res.gpus_per_node in ("auto", 0):
        return notes
    bare = next(n.name for n in nodes if n.inventory.gpu_count == 0)
    return [
        f"resources.gpus_per_node is {res.gpus_per_node}, but {bare} has no visible GPU: running on the CPU "
        f"with resources.cpu_workers instead (resources.device: cuda makes this an error)",
        *notes,
    ]


def slot_notes(job: LoadedJob, capacity: int, device_type: str) -> list[str]:
    """When ``scaling.workers`` leaves worker slots unused (``--set resources.cpu_workers=4`` on a
    job that scales over [1, 2]), say which setting decides, instead of changing nothing silently."""
    sizes = job.spec.world_sizes
    if not sizes:
        return []
    if max(sizes) >= capacity:
        return []
    what = "resources.cpu_workers" if device_type == "cpu" else "the GPUs"
    return [
        f"{what} give {capacity} worker slot(s), but scaling.workers {list(sizes)} decides the world sizes: "
        f"at most {max(sizes)} are used (--set scaling.workers=auto to use them all)"
    ]


def procs_per_node(job: LoadedJob, nodes: Sequence[NodeTarget], device_type: str) -> int:
    """The ranks a node runs at most: its GPUs (times ``ranks_per_gpu``), or its CPU workers."""
    res = job.spec.resources
    if device_type == "cuda":
        return gpus_per_node(job, nodes) * res.ranks_per_gpu
    if res.cpu_workers == "auto":
        return max(1, min(n.inventory.cpu_count for n in nodes))
    return res.cpu_workers


def gpus_per_node(job: LoadedJob, nodes: Sequence[NodeTarget]) -> int:
    """The GPUs each node's ranks use: every visible one (``auto``, the fewest any node has), or the spec's count."""
    res = job.spec.resources
    fewest = min(n.inventory.gpu_count for n in nodes)
    if res.gpus_per_node == "auto":
        return fewest
    if res.gpus_per_node > fewest:
        node = next(n for n in nodes if n.inventory.gpu_count == fewest)
        raise PlanError(
            f"{job.path}: resources.gpus_per_node: {res.gpus_per_node} GPUs requested per node, "
            f"but {node.name} has {fewest} visible"
        )
    if res.gpus_per_node == 0:
        raise PlanError(f"{job.path}: resources.gpus_per_node: 0 GPUs requested; use resources.device: cpu")
    return res.gpus_per_node


def check_node_split(job: LoadedJob) -> None:
    """Listed world sizes none of which splits evenly over ``resources.nodes`` are refused from
    the spec alone, before any host is contacted (some fitting: the others are skipped, said)."""
    nodes = job.spec.resources.nodes
    sizes = job.spec.world_sizes or ()
    if nodes > 1 and sizes and all(size % nodes for size in sizes):
        raise PlanError(
            f"{job.path}: scaling.workers: no world size of {list(sizes)} divides over {nodes} nodes "
            f"(resources.nodes); use multiples of {nodes}, or --set scaling.workers=auto"
        )


def world_sizes(job: LoadedJob, capacity: int, node_count: int, device_type: str = "cpu") -> tuple[list[int], list[SkippedWorld]]:
    """The stages' world sizes, and the listed ones that do not fit these nodes (skipped: why, and
    what would run them). A PlanError when none fits."""
    spec = job.spec
    if spec.world_sizes is None:
        every_slot = spec.scaling is None or spec.resources.elastic  # an elastic world: one stage, its hosts' size
        return ([capacity] if every_slot else auto_world_sizes(capacity, node_count)), []
    fits, skipped = [], []
    for size in spec.world_sizes:
        why = _misfit(job, size, capacity, node_count, device_type)
        if why is None:
            fits.append(size)
        else:
            skipped.append(SkippedWorld(size, *why))
    if not fits:
        first = skipped[0]
        raise PlanError(
            f"{job.path}: scaling.workers: no world size of {list(spec.world_sizes)} fits: "
            f"world size {first.world_size} {first.reason}; {first.remedy}"
        )
    return fits, skipped


def _misfit(job: LoadedJob, size: int, capacity: int, node_count: int, device_type: str) -> tuple[str, str] | None:
    """Why a world size cannot run on these nodes, and what would run it; None when it fits."""
    if size % node_count:
        return f"does not divide over {node_count} nodes", f"a multiple of {node_count} would"
    if size <= capacity:
        return None
    per_node = size // node_count
    where = "this node has" if node_count == 1 else f"each of {node_count} nodes has"
    if device_type == "cuda":
        k = job.spec.resources.ranks_per_gpu
        gpus = capacity // node_count // k
        slots = f"{gpus} GPU(s)" + (f" x {k} ranks each" if k > 1 else "")
        return (
            f"needs {per_node} worker slot(s) per node but {slots} give {capacity // node_count}",
            f"it runs where {where} {-(-per_node // k)} GPUs, or here with resources.ranks_per_gpu: "
            f"{-(-per_node // gpus)} (ranks sharing a GPU, over gloo)",
        )
    return (
        f"needs {per_node} worker slot(s) per node but resources.cpu_workers gives {capacity // node_count}",
        f"--set resources.cpu_workers={per_node} runs it on the CPU",
    )


@dataclass(frozen=True)
class RunSizing:
    """How big a run's stages are, decided once from the spec and the nodes: the device type, the
    ranks a node runs at most, every stage's world size, and what the spec did not say outright."""

    device_type: str  # "cuda" | "cpu"
    per_node: int  # ranks per node at most: GPUs x ranks_per_gpu (or CPU workers)
    world_sizes: tuple[int, ...]
    notes: tuple[str, ...] = ()
    skipped: tuple[SkippedWorld, ...] = ()  # listed world sizes these nodes cannot run


def size_run(job: LoadedJob, nodes: Sequence[NodeTarget]) -> RunSizing:
    """The run's sizing; raises PlanError for impossible asks (before anything is spawned)."""
    spec = job.spec
    res = spec.resources
    if not res.fewest_nodes <= len(nodes) <= res.nodes:
        asked = f"{res.fewest_nodes} to {res.nodes}" if res.elastic else str(res.nodes)
        raise PlanError(
            f"{job.path}: resources.nodes: {asked} node(s) requested but "
            f"{len(nodes)} available; several nodes need a cluster file (--cluster configs/cluster.yaml)"
        )
    device_type = choose_device(job, nodes)
    per_node = procs_per_node(job, nodes, device_type)
    sizes, skipped = world_sizes(job, per_node * len(nodes), len(nodes), device_type)
    return RunSizing(device_type, per_node, tuple(sizes), tuple(device_notes(job, nodes, device_type, per_node)), tuple(skipped))


# --- one stage -------------------------------------------------------------------------------------


def make_plans(
    job: LoadedJob, nodes: Sequence[NodeTarget], sizing: RunSizing, *, run_dir: Path, master_port: int, backend: str | None = None
) -> list[StagePlan]:
    """One StagePlan per world size (one in all unless ``scaling.workers`` lists several)."""
    return [
        plan_stage(job, nodes, size, sizing.device_type, run_dir=run_dir, master_port=master_port, backend=backend)
        for size in sizing.world_sizes
    ]


def plan_stage(
    job: LoadedJob,
    nodes: Sequence[NodeTarget],
    world_size: int,
    device_type: str,
    *,
    run_dir: Path,
    master_port: int,
    backend: str | None,
    attempt: int = 0,
    stage_size: int | None = None,
    spares: Sequence[NodeTarget] = (),
) -> StagePlan:
    """The plan of one world size, its ranks spread evenly over ``nodes`` in order; ``attempt``:
    how many times the stage's group was started before (its restarts). ``stage_size``: the
    stage's own world size when this attempt runs smaller (an elastic world that lost a host):
    its directory, and so its checkpoints, stay the stage's. ``spares``: hosts standing by, where
    a lost host's ranks may go in place (``StagePlan.standby``)."""
    spec = job.spec
    nproc = world_size // len(nodes)
    paths = StagePaths.of(run_dir, stage_size or world_size)
    threads = user_threads(spec.env, max(1, min(n.inventory.cpu_count for n in nodes) // nproc))
    slots = tuple(
        NodeSlot(i, target, nproc, threads, node_env(spec.env, target, threads, paths, multi_node=len(nodes) > 1))
        for i, target in enumerate(nodes)
    )
    standby = tuple(NodeSlot(-1, target, nproc, threads, node_env(spec.env, target, threads, paths, multi_node=True)) for target in spares)
    return StagePlan(
        job=spec.name,
        backend=backend or spec.backend,
        paths=paths,
        world_size=world_size,
        device_type=device_type,
        # only an entrypoint can be forked as a function; a script runs as __main__ of its own process
        start_method=spec.start_method if spec.entrypoint else "spawn",
        # one node on this machine (a local run, a one-node Slurm stage): the group meets on loopback
        rendezvous=Rendezvous(LOOPBACK_ADDR if len(nodes) == 1 and nodes[0].ssh is None else nodes[0].address, master_port),
        nodes=slots,
        ranks=_rank_slots(slots, device_type, shared_gpu_ranks(job, device_type)),
        worker=_worker_config(job, paths, device_type, threads, attempt),
        run_timeout_s=spec.timeouts.run_s,
        restart=RestartPolicy.of(spec.max_restarts, spec.restart_on, spec.timeouts.on_hang, spec.preemption.grace_s),
        spec_env=spec.env,
        engine_settings=spec.engine_settings(backend or spec.backend),
        stragglers=StragglerPolicy(spec.monitoring.straggler_factor, spec.monitoring.straggler_hold_s),
        hang=HangPolicy(spec.timeouts.hang_s, spec.timeouts.on_hang),
        standby=standby,
    )


def _rank_slots(nodes: Sequence[NodeSlot], device_type: str, ranks_per_gpu: int) -> tuple[RankSlot, ...]:
    """Ranks numbered node by node; each on ``cuda:<local_rank // ranks_per_gpu>`` of its node, or the CPU."""
    slots, rank = [], 0
    for node in nodes:
        for local_rank in range(node.nproc):
            device = rank_device(device_type, local_rank, ranks_per_gpu)
            slots.append(RankSlot(rank, local_rank, node.node_rank, node.host, device))
            rank += 1
    return tuple(slots)


def job_identity_of(job: LoadedJob) -> str:
    """What the job's checkpoints carry to be its own (``launcher.checkpoint_store.job_identity``)."""
    return job_identity(job.spec.name, job.spec.entrypoint or job.spec.script or "", job.spec.args)


def _worker_config(job: LoadedJob, paths: StagePaths, device_type: str, threads: int | None, attempt: int) -> WorkerConfig:
    spec = job.spec
    return WorkerConfig(
        job=spec.name,
        stage_dir=str(paths.root),
        device_type=device_type,
        pg_backend=pg_backend(job, device_type),
        threads_per_worker=threads,
        entrypoint=spec.entrypoint,
        prepare=spec.prepare,
        script=str(job.script_path()) if spec.script else None,
        args=spec.args,
        params=dict(job.params),  # resolved once by the launcher: what the dry run shows is what ranks get
        rendezvous_timeout_s=spec.timeouts.rendezvous_s,
        collective_timeout_s=spec.timeouts.collective_s,
        run_id=paths.root.parent.name,
        time_ddp=spec.monitoring.stragglers,
        checkpoint_dir=str(checkpoint_root(job, paths)),
        checkpoint_keep=spec.checkpoint.keep,
        checkpoint_async_save=spec.checkpoint.async_save,
        warm_spares=spec.checkpoint.warm_spares,
        job_identity=job_identity_of(job),
        attempt=attempt,
        stop_grace_s=float(spec.preemption.grace_s),
        gpu_health=spec.preflight.gpu_health,
        ranks_per_gpu=shared_gpu_ranks(job, device_type),
    )


def shared_gpu_ranks(job: LoadedJob, device_type: str) -> int:
    """Ranks per GPU: the spec's ``ranks_per_gpu`` on GPUs; 1 on the CPU, where it means nothing."""
    return job.spec.resources.ranks_per_gpu if device_type == "cuda" else 1


def pg_backend(job: LoadedJob, device_type: str) -> str:
    """NCCL on GPUs; gloo on the CPU, and on GPUs that ranks share (NCCL refuses two ranks on one
    device: "Duplicate GPU detected"), where gloo runs the collectives on the CUDA tensors."""
    return "nccl" if device_type == "cuda" and shared_gpu_ranks(job, device_type) == 1 else "gloo"


def checkpoint_root(job: LoadedJob, paths: StagePaths) -> Path:
    """Where a stage's checkpoints go: ``checkpoint.dir/world<N>`` (relative to the spec), or the
    stage directory's ``checkpoints`` (on every host, at the same path)."""
    setting = job.spec.checkpoint.dir
    if setting is None:
        return paths.checkpoints
    base = Path(setting).expanduser()
    return (base if base.is_absolute() else job.base_dir / base) / paths.root.name
