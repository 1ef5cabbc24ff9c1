"""A stage's plan: what every rank and node of one world size runs, decided before anything starts.

The records both sides of the stage seam read: the control side makes them (``control.planning``:
spec x nodes -> ``StagePlan``) and the engines turn them into processes (``backends/``) without
deriving any of it again. ``place_ranks`` is the one transformation an engine may ask for: the
plan of the layout its own scheduler chose (Ray's placement group). Pure: no processes, no sockets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from launcher.masking import mask_env
from launcher.protocol import ENV_GRANTED_GPU, ENV_HOST, ENV_RANK_DEVICE, ENV_STAGE_DIR, StagePaths, WorkerConfig, rank_device
from launcher.policies import HangPolicy, RestartPolicy, StragglerPolicy
from launcher.hardware.devices import GpuInfo, NodeInventory

if TYPE_CHECKING:  # pydantic: the plan itself needs none of it
    from pydantic import BaseModel

    from launcher.spec.cluster import HostConfig


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
    """One stage's plan. The spec's settings it carries (``spec_env``, ``engine_settings``, the
    policies) are values the plan was given: their defaults are the spec model's alone."""

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
    restart: RestartPolicy
    spec_env: Mapping[str, str]
    # the engine's own settings block from the spec (``spec.engine_settings(backend)``), carried
    # unread: only the engine reads it (None: an engine without one)
    engine_settings: BaseModel | None
    stragglers: StragglerPolicy
    hang: HangPolicy
    # the spare hosts' slots (the cluster file's hosts beyond ``resources.nodes``), planned as a
    # node would be but with no node rank (-1): where a lost host's ranks go in place (``on_spare``)
    standby: tuple[NodeSlot, ...] = ()

    @property
    def max_restarts(self) -> int:
        return self.restart.max_restarts

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


def auto_world_sizes(capacity: int, node_count: int) -> list[int]:
    """``scaling.workers: auto``: every node with 1, 2, 4, ... ranks up to the ranks a node runs,
    and all of them where that is not a power of two (one node of 6 GPUs: 1, 2, 4, 6)."""
    per_node = capacity // node_count
    ladder, k = [], 1
    while k < per_node:
        ladder.append(k * node_count)
        k *= 2
    return [*ladder, capacity]



# --- the environment a node's ranks start with ----------------------------------------------------


def user_threads(spec_env: Mapping[str, str], share: int) -> int | None:
    """The ranks' torch thread count: the spec's OMP_NUM_THREADS when it sets one (None when that
    is not a plain positive count, e.g. OpenMP's nested "4,2": torch then reads it unchanged),
    else the plan's share of the node's cores."""
    if "OMP_NUM_THREADS" not in spec_env:
        return share
    value = spec_env["OMP_NUM_THREADS"].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


LOOPBACK_IFNAME = "lo"  # Linux's loopback interface: 127.0.0.1 and ::1
LOOPBACK_ADDR = "127.0.0.1"


def node_env(
    spec_env: Mapping[str, str], target: NodeTarget, threads: int | None, paths: StagePaths, *, multi_node: bool
) -> dict[str, str]:
    """The environment every rank of a node starts with; the spec's own settings win.

    A stage whose ranks are all on this machine (one node, no SSH: torchrun here, an embedded or
    one-node Ray) keeps torch.distributed's sockets on loopback; a stage across nodes uses the
    node's ``ifname`` where one is known."""
    env = {
        "PYTHONUNBUFFERED": "1",
        ENV_HOST: target.name,
        # every process of the stage carries it, forked ranks included (whose command line is
        # their server's): it finds a run's processes
        ENV_STAGE_DIR: str(paths.root),
        # CUDA numbers GPUs fastest first unless told otherwise; NVML, nvidia-smi and the plan
        # (CUDA_VISIBLE_DEVICES indices, cuda:<local_rank>) number them by PCI bus: one order for all
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if not multi_node and target.ssh is None:
        # every rank on this machine: gloo's pair listeners and NCCL's bootstrap listen on loopback
        # alone (gloo would take whatever the hostname resolves to; NCCL the first non-loopback
        # interface), as the store does (runtime.rendezvous_store.serve_store, on a rendezvous at 127.0.0.1)
        env["GLOO_SOCKET_IFNAME"] = LOOPBACK_IFNAME
        env["NCCL_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    elif target.ifname:
        # across nodes, talk over the interface that reaches the others (unless the spec chose one)
        env["GLOO_SOCKET_IFNAME"] = target.ifname
        env["NCCL_SOCKET_IFNAME"] = target.ifname
    env.update(spec_env)
    return env


# --- an engine that placed the ranks itself -------------------------------------------------------


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


def on_spare(plan: StagePlan, node_rank: int) -> StagePlan:
    """The plan with node ``node_rank`` moved to the first spare host (``plan.standby``): the same
    node rank, ranks and shape, that host's target and environment; the spare no longer standing
    by, and the host it replaces the last to (a node that rebooted may be back when it is needed)."""
    spare, *rest = plan.standby
    lost = plan.nodes[node_rank]
    moved = replace(spare, node_rank=node_rank, nproc=lost.nproc, threads=lost.threads)
    nodes = tuple(moved if n.node_rank == node_rank else n for n in plan.nodes)
    ranks = tuple(replace(r, host=moved.host) if r.node_rank == node_rank else r for r in plan.ranks)
    return replace(plan, nodes=nodes, ranks=ranks, standby=(*rest, replace(lost, node_rank=-1)))


def place_ranks(plan: StagePlan, placements: Sequence[RankPlacement]) -> StagePlan:
    """The plan of the layout a scheduler chose: nodes in the order of their first rank, ranks
    numbered as placed, local ranks and threads per node, and on GPUs each node's granted devices
    visible with every rank on ``cuda:<its index there>``; ranks all on one node meet on its
    loopback (127.0.0.1, rank 0's port), else at rank 0's address. A node is named by its hostname, or by
    its address where two nodes share one (containers, namespaces), so that logs and metrics
    still tell them apart."""
    by_rank = sorted(placements, key=lambda p: p.rank)
    node_ids = list(dict.fromkeys(p.node_id for p in by_rank))
    names = _node_names(by_rank)
    nodes, ranks = [], []
    for node_rank, node_id in enumerate(node_ids):
        peers = [p for p in by_rank if p.node_id == node_id]
        granted = sorted({g for p in peers for g in p.gpu_ids}, key=_gpu_key)
        first = peers[0]
        name = names[node_id]
        target = NodeTarget(name, first.address, _placed_inventory(first, granted), python="", ifname=first.ifname)
        threads = user_threads(plan.spec_env, max(1, min(p.cpus for p in peers) // len(peers)))
        env = node_env(plan.spec_env, target, threads, plan.paths, multi_node=len(node_ids) > 1)
        if plan.device_type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(granted)  # what Ray granted this node's ranks
        nodes.append(NodeSlot(node_rank, target, len(peers), threads, env))
        ranks += _placed_ranks(plan, peers, granted, node_rank, name)
    # every rank on one node: they meet on its loopback (the port is rank 0's free one), as gloo and NCCL do (node_env)
    address = LOOPBACK_ADDR if len(node_ids) == 1 else by_rank[0].address
    rendezvous = Rendezvous(address, by_rank[0].port or plan.rendezvous.port)
    return replace(plan, nodes=tuple(nodes), ranks=tuple(sorted(ranks, key=lambda r: r.rank)), rendezvous=rendezvous)


def _placed_ranks(plan: StagePlan, peers: Sequence[RankPlacement], granted: Sequence[str], node_rank: int, name: str) -> list[RankSlot]:
    """A node's ranks, local ranks in the order of their granted GPUs (ranks that share one are
    neighbours), each on ``cuda:<its GPU's index among the granted>``: with fractional GPUs the
    scheduler, not the local rank, decided the GPU, so the rank's env names its device."""
    if plan.device_type != "cuda":
        return [RankSlot(p.rank, local_rank, node_rank, name, rank_device("cpu", local_rank, plan.worker.ranks_per_gpu)) for local_rank, p in enumerate(peers)]
    mine = {p.rank: (p.gpu_ids[0] if p.gpu_ids else "") for p in peers}
    ordered = sorted(peers, key=lambda p: (granted.index(mine[p.rank]) if mine[p.rank] in granted else len(granted), p.rank))
    slots = []
    for local_rank, p in enumerate(ordered):
        index = granted.index(mine[p.rank]) if mine[p.rank] in granted else local_rank
        device = f"cuda:{index}"
        slots.append(RankSlot(p.rank, local_rank, node_rank, name, device, {ENV_GRANTED_GPU: mine[p.rank], ENV_RANK_DEVICE: device}))
    return slots


def _node_names(placements: Sequence[RankPlacement]) -> dict[str, str]:
    """Node id -> its name: the hostname, unless another node has the same one (then its address)."""
    hosts: dict[str, set[str]] = {}
    for p in placements:
        hosts.setdefault(p.host, set()).add(p.node_id)
    return {p.node_id: p.host if len(hosts[p.host]) == 1 else p.address for p in placements}


def _placed_inventory(placement: RankPlacement, granted: Sequence[str]) -> NodeInventory:
    gpus = tuple(GpuInfo(i, i, "GPU (granted)", 0, None, None, f"granted-{g}") for i, g in enumerate(granted))
    return NodeInventory(hostname=placement.host, cpu_count=placement.cpus, gpus=gpus, source="placement")


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)
