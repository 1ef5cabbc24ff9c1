"""The nodes a run starts on: this machine, a cluster file's hosts (checked by the preflight, a
failed host replaced by a spare), a recorded node or a cluster file's hosts as written (dry runs),
and the pool of hosts and spares a run's stages use. What the console says of the preflight."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from launcher import backends
from launcher.control.planning import check_node_split
from launcher.errors import EXIT_BAD_INPUT, LauncherError, PlanError
from launcher.hardware.devices import NodeInventory, discover
from launcher.procutil import free_port
from launcher.records import PreflightRecord
from launcher.spec.model import LoadedJob
from launcher.stage.plan import NodeTarget


def local_node(visible_override: str | None = None) -> NodeTarget:
    inventory = discover(visible_override=visible_override)
    return NodeTarget(name=socket.gethostname(), address="127.0.0.1", inventory=inventory, python=sys.executable)

def cluster_path(job: LoadedJob, cluster: str | None) -> Path | None:
    """The cluster file: ``--cluster`` as given, or the spec's ``cluster`` relative to the spec."""
    if cluster:
        return Path(cluster)
    return None if job.spec.cluster is None else job.base_dir / job.spec.cluster

def resolve_nodes(job: LoadedJob, cluster: str | None) -> list[NodeTarget]:
    """The nodes to plan on, for ``validate`` and ``--dry-run``: no link check, and this
    machine's GPU health is not judged (``preflight_nodes`` does both for a run)."""
    return preflight_nodes(job, cluster, for_run=False)[0]

def preflight_nodes(job: LoadedJob, cluster: str | None, *, for_run: bool = True) -> tuple[list[NodeTarget], PreflightRecord | None]:
    """The hosts a run starts on, checked: this machine, its GPUs refused (exit 2) when one the
    job would use is unhealthy; or every host of a cluster file, its GPUs and the links between
    them, a failed host replaced by a spare (``launcher.backends.preflight_hosts``). A
    ``CUDA_VISIBLE_DEVICES`` in the job's env is what its ranks will see, so it is what counts."""
    path = cluster_path(job, cluster)
    if path is None:
        node = local_node(job.spec.env.get("CUDA_VISIBLE_DEVICES"))
        if for_run:
            check_local_gpus(job, node)
        return [node], None
    check_node_split(job)  # decided by the spec alone: no host is contacted for it
    from launcher.spec.cluster import load_cluster

    hosts = load_cluster(path)
    check_cluster_size(job, len(hosts.hosts), path)
    outcome = backends.preflight_hosts(hosts, job, network=for_run)
    return outcome.targets, outcome.record

def check_cluster_size(job: LoadedJob, hosts: int, path: Path) -> None:
    """More hosts asked for (``nodes``, or an elastic world's ``min``) than the cluster file lists:
    refused before any host is contacted."""
    res = job.spec.resources
    if res.fewest_nodes > hosts:
        asked = f"at least {res.fewest_nodes} (min)" if res.elastic else str(res.nodes)
        raise PlanError(f"{job.path}: resources.nodes: {asked} node(s) requested but {path} lists {hosts} host(s)")

def check_local_gpus(job: LoadedJob, node: NodeTarget) -> None:
    """This machine's GPUs the job would use, as NVML sees them: every problem, or nothing."""
    settings, wanted = job.spec.preflight, job.spec.resources.gpus_used()
    if not settings.gpu_health or wanted == 0:
        return
    problems = node.inventory.unfit_gpus(wanted, min_free_fraction=settings.min_free_gpu_memory)
    if problems:
        hint = "preflight.gpu_health: false (or CUDA_VISIBLE_DEVICES without that GPU) to run anyway"
        raise LauncherError("\n".join([*problems, f"preflight: nothing was started; {hint}"]), exit_code=EXIT_BAD_INPUT)

@dataclass
class HostPool:
    """The hosts a run's stages use (``resources.nodes`` of them, in the cluster file's order) and
    the spares after them: a host lost in an attempt is replaced by the next spare for the restart
    (and for every later stage)."""

    active: list[NodeTarget]
    spares: list[NodeTarget]
    fewest: int = 0  # an elastic world goes on without a lost host while this many are left (0: not elastic)

    @classmethod
    def of(cls, job: LoadedJob, nodes: Sequence[NodeTarget]) -> "HostPool":
        wanted, res = job.spec.resources.nodes, job.spec.resources
        fewest = res.fewest_nodes if res.elastic else 0
        return cls(list(nodes[:wanted]), list(nodes[wanted:]), fewest) if len(nodes) > wanted else cls(list(nodes), [], fewest)

    def replace_lost(self, hosts: set[str]) -> str:
        """Put a spare where each lost host was (its node rank: the plan keeps its shape), or, in an
        elastic world with no spare left, go on without it while ``fewest`` hosts remain; what
        happened, in one line. In a fixed world the lost host stands by last, as after a move in
        place (``adopt``): a node that rebooted is a spare again for a later loss, in place or by
        restart (without it, that loss found no spare; and with none, the restart tries the lost
        host anyway). An elastic world shrinks rather than count on it."""
        said = []
        for name in sorted(hosts):
            index = next((i for i, n in enumerate(self.active) if n.name == name), None)
            if index is None:
                continue
            if self.spares:
                spare, lost = self.spares.pop(0), self.active[index]
                self.active[index] = spare
                if not self.fewest:
                    self.spares.append(lost)
                said.append(f"{name} lost: its ranks go to the spare host {spare.name}")
            elif self.fewest and len(self.active) - 1 >= self.fewest:
                del self.active[index]
                said.append(f"{name} lost and no spare host is left: the job goes on with {len(self.active)} host(s) (elastic, at least {self.fewest})")
            else:
                said.append(f"{name} lost and no spare host is left: the restart tries it again")
        return "; ".join(said)

    def adopt(self, hosts: Sequence[str]) -> str:
        """The hosts an attempt ended on, where its engine moved a lost host's ranks to a spare in
        place (node by node, in node-rank order): they are the active ones from now on, for the
        restarts and stages that follow, and the hosts they replaced the last spares (a node that
        rebooted is back by the time every other spare is taken; one that is not fails its start
        at once, and that loss takes the restart path). What moved, in one line."""
        known = {n.name: n for n in (*self.active, *self.spares)}
        if len(hosts) != len(self.active) or any(h not in known for h in hosts):
            return ""
        now = [known[h] for h in hosts]
        said = [f"{old.name} lost: its ranks run on the spare host {new.name} from now on" for old, new in zip(self.active, now) if old.name != new.name]
        dropped = [n for n in self.active if n.name not in hosts]
        self.active, self.spares = now, [n for n in self.spares if n.name not in hosts] + dropped
        return "; ".join(said)


def rendezvous_port(nodes: Sequence[NodeTarget]) -> int:
    first = nodes[0]
    if first.ssh is None:
        return free_port("127.0.0.1")
    return backends.host_free_port(first)

def recorded_nodes(job: LoadedJob, cluster: str | None, inventory: str | Path) -> list[NodeTarget]:
    """The nodes a dry run plans on from a recorded inventory: this machine's place taken by the
    recorded node, or every host of the cluster file given the recorded node's GPUs and CPUs."""
    from launcher.hardware.devices import InventoryFileError, load_inventory

    try:
        recorded = load_inventory(inventory, visible_override=job.spec.env.get("CUDA_VISIBLE_DEVICES"))
    except InventoryFileError as exc:
        raise LauncherError(str(exc), exit_code=EXIT_BAD_INPUT) from None
    if cluster_path(job, cluster) is None:
        return [NodeTarget(name=recorded.hostname, address="127.0.0.1", inventory=recorded, python=sys.executable)]
    return cluster_hosts_as(job, cluster, recorded)

def assumed_nodes(job: LoadedJob, cluster: str | None) -> list[NodeTarget]:
    """A cluster file's hosts as written, for a dry run that logs in to none: the GPUs the spec
    names (``gpus_per_node: N``; with ``auto``, none known: CPU workers, or one GPU where the spec
    demands ``device: cuda``) and this machine's CPU count stand in for what a login would tell."""
    from launcher.hardware.devices import GpuInfo, usable_cpu_count

    res = job.spec.resources
    counted = isinstance(res.gpus_per_node, int)
    gpus = 0 if res.device == "cpu" else res.gpus_per_node if isinstance(res.gpus_per_node, int) else (1 if res.device == "cuda" else 0)
    what = f"{gpus} GPU(s) per host as resources.gpus_per_node says" if counted else (
        f"{gpus} GPU per host" if gpus else "no GPU (resources.cpu_workers ranks per host)")  # fmt: skip
    cpus = usable_cpu_count()
    note = (
        f"hosts not logged in to: planned as written with {what} and this machine's {cpus} CPU(s) assumed, "
        f"the rendezvous port picked at the start; --preflight logs in and checks them, --inventory FILE plans them as a recorded node"
    )
    placeholder = tuple(GpuInfo(i, i, "GPU (assumed)", 0, None, None, f"assumed-{i}") for i in range(gpus))
    return cluster_hosts_as(job, cluster, NodeInventory("", cpus, placeholder, "assumed", None, (note,)))

def cluster_hosts_as(job: LoadedJob, cluster: str | None, inventory: NodeInventory) -> list[NodeTarget]:
    """Every host of the cluster file, each given ``inventory`` (under its own name): no login."""
    from launcher.spec.cluster import load_cluster

    path = cluster_path(job, cluster)
    assert path is not None
    check_node_split(job)
    hosts = load_cluster(path).hosts
    check_cluster_size(job, len(hosts), path)
    return [
        NodeTarget(name=h.name, address=h.address, inventory=replace(inventory, hostname=h.name), python=h.python, ifname=h.ifname, ssh=h)
        for h in hosts
    ]

def preflight_lines(record: PreflightRecord | None) -> list[str]:
    """What the console says of the preflight: each host left out (and its spare), the links."""
    if record is None:
        return []
    lines = [swap.describe() for swap in record.left_out]
    net = record.network
    if net is not None and net.median_gbit_s is not None:
        slowest = min((link for link in net.links if link.gbit_s is not None), key=lambda link: link.gbit_s or 0.0)
        hosts = len({link.src for link in net.links} | {link.dst for link in net.links})
        lines.append(f"network: {len(net.links)} links between {hosts} hosts in {net.seconds:.1f} s, "
                     f"median {net.median_gbit_s:.3g} Gbit/s, slowest {slowest.describe()}")
    return lines
