"""Spec x inventory -> LaunchPlan: every rank's node, local rank, device, command, env and log.

Pure: no processes, no sockets (the rendezvous port is passed in), so ``--dry-run`` prints
exactly what a run would do and impossible requests fail here, before anything is spawned.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from launcher.devices import NodeInventory
from launcher.errors import PlanError

if TYPE_CHECKING:  # launcher.spec pulls in pydantic and yaml: ~0.2 s the worker does not need
    from launcher.spec import LoadedJob

LOG_PREFIX_SEPARATOR = "| "


@dataclass(frozen=True)
class NodeTarget:
    """A machine the job may use: where it is, what it has, how to run Python there."""

    name: str  # how logs and results name the host
    address: str  # where other nodes reach it (rendezvous)
    inventory: NodeInventory
    python: str
    ifname: str | None = None
    ssh: Any = None  # launcher.cluster.HostConfig for remote hosts; None for this machine


@dataclass(frozen=True)
class WorkerConfig:
    """What every rank's runtime needs; written once per stage as ``worker.json``."""

    job: str
    stage_dir: str
    device_type: str  # "cuda" or "cpu"
    pg_backend: str  # "nccl" or "gloo"
    # torch's intra-op threads per rank: the plan's share of the cores, or the spec's own
    # OMP_NUM_THREADS (the user's setting wins); None where that value is not a plain count, so
    # torch reads OMP_NUM_THREADS itself and the worker leaves it alone
    threads_per_worker: int | None
    entrypoint: str | None
    script: str | None
    args: tuple[str, ...]
    params: Mapping[str, Any]
    rendezvous_timeout_s: float  # bounds the ranks' rendezvous (store connect, every rank arrived)
    # bounds each collective (the process group's timeout); None: torch's default for pg_backend
    collective_timeout_s: float | None = None

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["params"] = dict(self.params)
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "WorkerConfig":
        data = json.loads(text)
        data["args"] = tuple(data["args"])
        return cls(**data)


@dataclass(frozen=True)
class RankAssignment:
    rank: int
    local_rank: int
    node_rank: int
    host: str
    device: str
    pg_backend: str
    log_path: str
    report_path: str


@dataclass(frozen=True)
class NodeLaunch:
    """One elastic agent: the torchrun command for one node and the env it starts with."""

    node_rank: int
    target: NodeTarget
    nproc: int
    argv: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def host(self) -> str:
        return self.target.name

    def torchrun_command(self) -> str:
        """The same launch written as the plain ``torchrun`` command a user would type."""
        args = list(self.argv[self.argv.index("launcher.agent") + 1 :])
        return shlex.join(["torchrun", *args])


@dataclass(frozen=True)
class LaunchPlan:
    job: str
    backend: str
    stage_dir: Path
    world_size: int
    master_addr: str
    master_port: int
    nodes: tuple[NodeLaunch, ...]
    ranks: tuple[RankAssignment, ...]
    worker: WorkerConfig
    run_timeout_s: float
    max_restarts: int
    spec_env: Mapping[str, str] = field(default_factory=dict)
    # how a backend that places ranks itself (Ray) spreads them: pack | spread | strict_pack | strict_spread
    placement: str = "pack"

    def rank_env(self, rank: RankAssignment) -> dict[str, str]:
        """The env torchrun gives a rank, plus the node's env: what ``script:`` mode sees."""
        node = self.nodes[rank.node_rank]
        return {
            **node.env,
            "RANK": str(rank.rank),
            "LOCAL_RANK": str(rank.local_rank),
            "GROUP_RANK": str(rank.node_rank),
            "ROLE_RANK": str(rank.rank),
            "ROLE_NAME": "default",
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(node.nproc),
            "GROUP_WORLD_SIZE": str(len(self.nodes)),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none",
        }

    def masked(self) -> dict[str, Any]:
        """The plan as data for display and dry runs; secret-looking env values masked."""
        from launcher.spec import mask_env

        return {
            "job": self.job,
            "backend": self.backend,
            "world_size": self.world_size,
            "rendezvous": f"{self.master_addr}:{self.master_port}",
            "stage_dir": str(self.stage_dir),
            "ranks": [asdict(r) for r in self.ranks],
            "nodes": [
                {"host": n.host, "nproc": n.nproc, "argv": list(n.argv), "env": mask_env(n.env)} for n in self.nodes
            ],
        }


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
    if device_type != "cpu" or res.device != "auto" or res.gpus_per_node in ("auto", 0):
        return []
    bare = next(n.name for n in nodes if n.inventory.gpu_count == 0)
    return [
        f"resources.gpus_per_node is {res.gpus_per_node}, but {bare} has no visible GPU: running on the CPU "
        f"with resources.cpu_workers instead (resources.device: cuda makes this an error)"
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


def make_plans(
    job: LoadedJob,
    nodes: Sequence[NodeTarget],
    *,
    run_dir: Path,
    master_port: int,
    backend: str | None = None,
) -> list[LaunchPlan]:
    """One LaunchPlan per world size (one in all unless ``scaling.workers`` lists several)."""
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
) -> LaunchPlan:
    spec = job.spec
    nproc = world_size // len(nodes)
    stage_dir = run_dir / f"world{world_size}"
    pg_backend = "nccl" if device_type == "cuda" else "gloo"
    threads = max(1, min(n.inventory.cpu_count for n in nodes) // nproc)
    worker = WorkerConfig(
        job=spec.name,
        stage_dir=str(stage_dir),
        device_type=device_type,
        pg_backend=pg_backend,
        threads_per_worker=_user_threads(spec.env, threads),
        entrypoint=spec.entrypoint,
        script=str(job.script_path()) if spec.script else None,
        args=spec.args,
        params=spec.params,
        rendezvous_timeout_s=spec.timeouts.rendezvous_s,
        collective_timeout_s=spec.timeouts.collective_s,
    )
    master = nodes[0].address
    launches, ranks = [], []
    # only an entrypoint can be forked as a function; a script is run as __main__ of its own process
    start_method = spec.start_method if spec.entrypoint else "spawn"
    for node_rank, target in enumerate(nodes):
        env = _node_env(job, target, threads, stage_dir)
        argv = _agent_argv(target.python, len(nodes), nproc, node_rank, master, master_port, stage_dir, start_method)
        launches.append(NodeLaunch(node_rank, target, nproc, argv, env))
        for local_rank in range(nproc):
            rank = node_rank * nproc + local_rank
            ranks.append(
                RankAssignment(
                    rank=rank,
                    local_rank=local_rank,
                    node_rank=node_rank,
                    host=target.name,
                    device=f"cuda:{local_rank}" if device_type == "cuda" else "cpu",
                    pg_backend=pg_backend,
                    log_path=str(stage_dir / "logs" / f"rank{rank}.log"),
                    report_path=str(stage_dir / "reports" / f"rank{rank}.json"),
                )
            )
    return LaunchPlan(
        job=spec.name,
        backend=backend or spec.backend,
        stage_dir=stage_dir,
        world_size=world_size,
        master_addr=master,
        master_port=master_port,
        nodes=tuple(launches),
        ranks=tuple(ranks),
        worker=worker,
        run_timeout_s=spec.timeouts.run_s,
        max_restarts=spec.max_restarts,
        spec_env=spec.env,
        placement=spec.ray.placement,
    )


def _user_threads(spec_env: Mapping[str, str], share: int) -> int | None:
    """The ranks' torch thread count: the spec's OMP_NUM_THREADS when it sets one (None when that
    is not a plain positive count, e.g. OpenMP's nested "4,2": torch then reads it unchanged),
    else this plan's share of the cores."""
    if "OMP_NUM_THREADS" not in spec_env:
        return share
    value = spec_env["OMP_NUM_THREADS"].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _node_env(job: LoadedJob, target: NodeTarget, threads: int, stage_dir: Path) -> dict[str, str]:
    env = {
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "LAUNCHER_HOST": target.name,
        # every process of the stage carries it, forked ranks included (whose command line is
        # their server's): `grep -l` over /proc/*/environ finds a run's processes
        "GPULAUNCH_STAGE_DIR": str(stage_dir),
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"{target.name}:${{rank}}{LOG_PREFIX_SEPARATOR}",
    }
    if target.ifname:
        env["GLOO_SOCKET_IFNAME"] = target.ifname
        env["NCCL_SOCKET_IFNAME"] = target.ifname
    env.update(job.spec.env)  # the user's settings win
    return env


def _agent_argv(
    python: str, nnodes: int, nproc: int, node_rank: int, master: str, port: int, stage_dir: Path, start_method: str
) -> tuple[str, ...]:
    # launcher.agent is torchrun (same parser, same elastic agent) plus a parent-death signal and
    # a machine-readable failure file; static rendezvous on a port we chose, never the fixed 29500.
    # With --start-method=forkserver the agent runs launcher.worker as a function in ranks forked
    # from a forkserver (torchrun's own start methods for function entrypoints; launcher.agent).
    return (
        python,
        "-m",
        "launcher.agent",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=static",
        f"--master-addr={master}",
        f"--master-port={port}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        f"--start-method={start_method}",
        f"--log-dir={stage_dir / 'torchelastic' / f'node{node_rank}'}",
        "--tee=3",
        "-m",
        "launcher.worker",
        str(stage_dir / "worker.json"),
    )
