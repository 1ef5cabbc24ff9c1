"""Spec x nodes -> one backend-neutral ``StagePlan`` per world size.

A plan says, for every rank, its node, local rank and device; for every node, how many ranks it
runs, their threads and the environment they start with; and for the stage, the rendezvous, the
worker config (with the resolved params) and the run directory's layout. Backends turn a plan into
their own launch request (torchrun commands, Ray actors, an sbatch script) and never derive any
of this again. Pure: no processes, no sockets (the rendezvous port is passed in), so ``--dry-run``
prints exactly what a run would do, and impossible requests fail here, before anything starts.

A backend that places ranks itself (Ray's placement group) plans on its pool first and, once the
ranks are placed, asks ``place_ranks`` for the plan of the layout it got.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from launcher.errors import PlanError
from launcher.masking import mask_env
from launcher.records import StragglerPolicy
from launcher.protocol import ENV_GRANTED_GPU, ENV_HOST, ENV_STAGE_DIR, StagePaths, WorkerConfig
from launcher.runtime.devices import GpuInfo, NodeInventory

if TYPE_CHECKING:  # pydantic and yaml: the planner itself needs neither
    from launcher.spec.cluster import HostConfig
    from launcher.spec.model import LoadedJob


@dataclass(frozen=True)
class NodeTarget:
    """A machine the job may use: where it is, what it has, how to run Python there."""

    name: str  # how logs and results name the host
    address: str  # where other nodes reach it (rendezvous)
    inventory: NodeInventory
    python: str
    ifname: str | None = None
    ssh: HostConfig | None = None  # how to reach a remote host; None for this machine


@dataclass(frozen=True)
class RankSlot:
    rank: int
    local_rank: int
    node_rank: int
    host: str
    device: str  # "cuda:<local_rank>" or "cpu"
    env: Mapping[str, str] = field(default_factory=dict)  # what this rank alone gets (Ray: its granted GPU)


@dataclass(frozen=True)
class NodeSlot:
    """One node of a stage: its ranks' count, threads and starting environment."""

    node_rank: int
    target: NodeTarget
    nproc: int
    threads: int | None  # torch threads per rank; None: the spec's OMP_NUM_THREADS decides
    env: Mapping[str, str]

    @property
    def host(self) -> str:
        return self.target.name


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int

    def __str__(self) -> str:
        return f"{self.addr}:{self.port}"


@dataclass(frozen=True)
class StagePlan:
    job: str
    backend: str
    paths: StagePaths
    world_size: int
    device_type: str  # "cuda" | "cpu"
    start_method: str  # how an agent starts entrypoint ranks: forkserver | spawn
    rendezvous: Rendezvous
    nodes: tuple[NodeSlot, ...]
    ranks: tuple[RankSlot, ...]
    worker: WorkerConfig
    run_timeout_s: float
    max_restarts: int
    spec_env: Mapping[str, str] = field(default_factory=dict)
    # how a backend that places ranks itself (Ray) spreads them: pack | spread | strict_pack | strict_spread
    placement: str = "pack"
    stragglers: StragglerPolicy = StragglerPolicy()

    @property
    def stage_dir(self) -> Path:
        return self.paths.root

    @property
    def pg_backend(self) -> str:
        return self.worker.pg_backend

    @property
    def script_mode(self) -> bool:
        return self.worker.script is not None

    def worker_for(self, node: NodeSlot) -> WorkerConfig:
        """The worker config of one node's ranks (threads differ where nodes differ)."""
        if node.threads == self.worker.threads_per_worker:
            return self.worker
        return replace(self.worker, threads_per_worker=node.threads)

    def rank_env(self, rank: RankSlot) -> dict[str, str]:
        """The env torchrun gives a rank, plus its node's env: what ``script:`` mode sees."""
        node = self.nodes[rank.node_rank]
        return {
            **node.env,
            **rank.env,
            "RANK": str(rank.rank),
            "LOCAL_RANK": str(rank.local_rank),
            "GROUP_RANK": str(rank.node_rank),
            "ROLE_RANK": str(rank.rank),
            "ROLE_NAME": "default",
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(node.nproc),
            "GROUP_WORLD_SIZE": str(len(self.nodes)),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.rendezvous.addr,
            "MASTER_PORT": str(self.rendezvous.port),
        }

    def masked(self) -> dict[str, Any]:
        """The plan as data for display and dry runs; secret-looking env values masked."""
        return {
            "job": self.job,
            "backend": self.backend,
            "world_size": self.world_size,
            "device_type": self.device_type,
            "rendezvous": str(self.rendezvous),
            "stage_dir": str(self.stage_dir),
            "params": dict(self.worker.params),
            "ranks": [{**asdict(r), "env": mask_env(r.env)} for r in self.ranks],
            "nodes": [
                {"host": n.host, "nproc": n.nproc, "threads": n.threads, "env": mask_env(n.env)} for n in self.nodes
            ],
        }


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


def device_notes(job: LoadedJob, nodes: Sequence[NodeTarget], device_type: str) -> list[str]:
    """What the plan decided that the spec did not say outright. A spec written for a GPU box
    (``gpus_per_node: 8``) still runs on a laptop's CPU under ``device: auto``, but says so."""
    res = job.spec.resources
    notes = slot_notes(job, nodes, device_type)
    if device_type != "cpu" or res.device != "auto" or res.gpus_per_node in ("auto", 0):
        return notes
    bare = next(n.name for n in nodes if n.inventory.gpu_count == 0)
    return [
        f"resources.gpus_per_node is {res.gpus_per_node}, but {bare} has no visible GPU: running on the CPU "
        f"with resources.cpu_workers instead (resources.device: cuda makes this an error)",
        *notes,
    ]


def slot_notes(job: LoadedJob, nodes: Sequence[NodeTarget], device_type: str) -> list[str]:
    """When ``scaling.workers`` leaves worker slots unused (``--set resources.cpu_workers=4`` on a
    job that scales over [1, 2]), say which setting decides, instead of changing nothing silently."""
    sizes = job.spec.world_sizes
    if not sizes:
        return []
    capacity = procs_per_node(job, nodes, device_type) * len(nodes)
    if max(sizes) >= capacity:
        return []
    what = "resources.cpu_workers" if device_type == "cpu" else "the GPUs"
    more = sorted({*sizes, capacity})
    return [
        f"{what} give {capacity} worker slot(s), but scaling.workers {list(sizes)} decides the world sizes: "
        f"at most {max(sizes)} are used (--set scaling.workers=[{','.join(map(str, more))}] to use them all)"
    ]


def procs_per_node(job: LoadedJob, nodes: Sequence[NodeTarget], device_type: str) -> int:
    res = job.spec.resources
    if device_type == "cuda":
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
    if res.cpu_workers == "auto":
        return max(1, min(n.inventory.cpu_count for n in nodes))
    return res.cpu_workers


def check_node_split(job: LoadedJob) -> None:
    """World sizes that cannot be split evenly over ``resources.nodes`` are refused from the spec
    alone, before any host is contacted."""
    nodes = job.spec.resources.nodes
    uneven = [size for size in job.spec.world_sizes or () if size % nodes]
    if nodes > 1 and uneven:
        fitting = [nodes * k for k in range(1, 3)]
        raise PlanError(
            f"{job.path}: scaling.workers: world size {uneven[0]} does not divide over {nodes} nodes "
            f"(resources.nodes); use multiples of {nodes}, e.g. --set scaling.workers=[{','.join(map(str, fitting))}]"
        )


def world_sizes(job: LoadedJob, capacity: int, node_count: int) -> list[int]:
    sizes = list(job.spec.world_sizes or [capacity])
    for size in sizes:
        if size > capacity:
            raise PlanError(
                f"{job.path}: scaling.workers: world size {size} requested, but only {capacity} "
                f"worker slots exist ({node_count} node(s))"
            )
        if size % node_count:
            raise PlanError(f"{job.path}: scaling.workers: world size {size} does not divide over {node_count} nodes")
    return sizes


def stage_sizes(job: LoadedJob, nodes: Sequence[NodeTarget]) -> tuple[str, list[int]]:
    """The device type and the world size of every stage; raises PlanError for impossible asks."""
    spec = job.spec
    if spec.resources.nodes != len(nodes):
        raise PlanError(
            f"{job.path}: resources.nodes: {spec.resources.nodes} node(s) requested but "
            f"{len(nodes)} available; several nodes need a cluster file (--cluster configs/cluster.yaml)"
        )
    device_type = choose_device(job, nodes)
    per_node = procs_per_node(job, nodes, device_type)
    return device_type, world_sizes(job, per_node * len(nodes), len(nodes))


# --- one stage -------------------------------------------------------------------------------------


def make_plans(
    job: LoadedJob, nodes: Sequence[NodeTarget], *, run_dir: Path, master_port: int, backend: str | None = None
) -> list[StagePlan]:
    """One StagePlan per world size (one in all unless ``scaling.workers`` lists several)."""
    device_type, sizes = stage_sizes(job, nodes)
    return [
        plan_stage(job, nodes, size, device_type, run_dir=run_dir, master_port=master_port, backend=backend)
        for size in sizes
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
) -> StagePlan:
    """The plan of one world size, its ranks spread evenly over ``nodes`` in order."""
    spec = job.spec
    nproc = world_size // len(nodes)
    paths = StagePaths.of(run_dir, world_size)
    threads = user_threads(spec.env, max(1, min(n.inventory.cpu_count for n in nodes) // nproc))
    slots = tuple(
        NodeSlot(i, target, nproc, threads, node_env(spec.env, target, threads, paths, multi_node=len(nodes) > 1))
        for i, target in enumerate(nodes)
    )
    return StagePlan(
        job=spec.name,
        backend=backend or spec.backend,
        paths=paths,
        world_size=world_size,
        device_type=device_type,
        # only an entrypoint can be forked as a function; a script runs as __main__ of its own process
        start_method=spec.start_method if spec.entrypoint else "spawn",
        rendezvous=Rendezvous(nodes[0].address, master_port),
        nodes=slots,
        ranks=_rank_slots(slots, device_type),
        worker=_worker_config(job, paths, device_type, threads),
        run_timeout_s=spec.timeouts.run_s,
        max_restarts=spec.max_restarts,
        spec_env=spec.env,
        placement=spec.ray.placement,
        stragglers=StragglerPolicy(spec.monitoring.straggler_factor, spec.monitoring.straggler_hold_s),
    )


def _rank_slots(nodes: Sequence[NodeSlot], device_type: str) -> tuple[RankSlot, ...]:
    """Ranks numbered node by node; each on ``cuda:<local_rank>`` of its node, or the CPU."""
    slots, rank = [], 0
    for node in nodes:
        for local_rank in range(node.nproc):
            device = f"cuda:{local_rank}" if device_type == "cuda" else "cpu"
            slots.append(RankSlot(rank, local_rank, node.node_rank, node.host, device))
            rank += 1
    return tuple(slots)


def _worker_config(job: LoadedJob, paths: StagePaths, device_type: str, threads: int | None) -> WorkerConfig:
    spec = job.spec
    return WorkerConfig(
        job=spec.name,
        stage_dir=str(paths.root),
        device_type=device_type,
        pg_backend="nccl" if device_type == "cuda" else "gloo",
        threads_per_worker=threads,
        entrypoint=spec.entrypoint,
        script=str(job.script_path()) if spec.script else None,
        args=spec.args,
        params=dict(job.params),  # resolved once by the launcher: what the dry run shows is what ranks get
        rendezvous_timeout_s=spec.timeouts.rendezvous_s,
        collective_timeout_s=spec.timeouts.collective_s,
        run_id=paths.root.parent.name,
        time_ddp=spec.monitoring.stragglers,
    )


def user_threads(spec_env: Mapping[str, str], share: int) -> int | None:
    """The ranks' torch thread count: the spec's OMP_NUM_THREADS when it sets one (None when that
    is not a plain positive count, e.g. OpenMP's nested "4,2": torch then reads it unchanged),
    else the plan's share of the node's cores."""
    if "OMP_NUM_THREADS" not in spec_env:
        return share
    value = spec_env["OMP_NUM_THREADS"].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def node_env(
    spec_env: Mapping[str, str], target: NodeTarget, threads: int | None, paths: StagePaths, *, multi_node: bool
) -> dict[str, str]:
    """The environment every rank of a node starts with; the spec's own settings win."""
    env = {
        "PYTHONUNBUFFERED": "1",
        ENV_HOST: target.name,
        # every process of the stage carries it, forked ranks included (whose command line is
        # their server's): it finds a run's processes
        ENV_STAGE_DIR: str(paths.root),
    }
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if target.ifname and (multi_node or target.ssh is not None):
        # across nodes, talk over the interface that reaches the others (unless the spec chose one)
        env["GLOO_SOCKET_IFNAME"] = target.ifname
        env["NCCL_SOCKET_IFNAME"] = target.ifname
    env.update(spec_env)
    return env


# --- a backend that placed the ranks itself ------------------------------------------------------


@dataclass(frozen=True)
class RankPlacement:
    """Where a backend's scheduler put one rank (Ray: what the rank's actor saw on its node)."""

    rank: int
    node_id: str  # the scheduler's id of the node
    host: str
    address: str
    cpus: int  # the CPUs the rank may use on that node
    ifname: str | None = None
    gpu_ids: tuple[str, ...] = ()  # the GPUs granted to this rank
    port: int | None = None  # rank 0: a free port on its node for the rendezvous


def place_ranks(plan: StagePlan, placements: Sequence[RankPlacement]) -> StagePlan:
    """The plan of the layout a scheduler chose: nodes in the order of their first rank, ranks
    numbered as placed, local ranks and threads per node, and on GPUs each node's granted devices
    visible with every rank on ``cuda:<its index there>``."""
    by_rank = sorted(placements, key=lambda p: p.rank)
    node_ids = list(dict.fromkeys(p.node_id for p in by_rank))
    nodes, ranks = [], []
    for node_rank, node_id in enumerate(node_ids):
        peers = [p for p in by_rank if p.node_id == node_id]
        granted = sorted({g for p in peers for g in p.gpu_ids}, key=_gpu_key)
        first = peers[0]
        target = NodeTarget(first.host, first.address, _placed_inventory(first, granted), python="", ifname=first.ifname)
        threads = user_threads(plan.spec_env, max(1, min(p.cpus for p in peers) // len(peers)))
        env = node_env(plan.spec_env, target, threads, plan.paths, multi_node=len(node_ids) > 1)
        if plan.device_type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(granted)  # what Ray granted this node's ranks
        nodes.append(NodeSlot(node_rank, target, len(peers), threads, env))
        for local_rank, p in enumerate(peers):
            mine = p.gpu_ids[0] if p.gpu_ids else ""
            if plan.device_type == "cuda" and mine in granted:
                local_rank = granted.index(mine)
            device = f"cuda:{local_rank}" if plan.device_type == "cuda" else "cpu"
            extra = {ENV_GRANTED_GPU: mine} if plan.device_type == "cuda" else {}
            ranks.append(RankSlot(p.rank, local_rank, node_rank, p.host, device, extra))
    rendezvous = Rendezvous(by_rank[0].address, by_rank[0].port or plan.rendezvous.port)
    return replace(plan, nodes=tuple(nodes), ranks=tuple(sorted(ranks, key=lambda r: r.rank)), rendezvous=rendezvous)


def _placed_inventory(placement: RankPlacement, granted: Sequence[str]) -> NodeInventory:
    gpus = tuple(GpuInfo(i, i, "GPU (granted)", 0, None, None, f"granted-{g}") for i, g in enumerate(granted))
    return NodeInventory(hostname=placement.host, cpu_count=placement.cpus, gpus=gpus, source="placement")


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)
