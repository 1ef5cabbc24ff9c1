"""Before anything starts on a cluster file's hosts: every host checked in parallel, over the
connection the run keeps (``link``): SSH login, the GPUs (the same discovery code, run there),
torch's version, the named interface, a free rendezvous port on the first host. Each problem
names its host; nothing is started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher.backends.ssh.link import HostLinks, _parallel, current_links
from launcher.backends.ssh.command import SshError
from launcher.errors import EXIT_JOB_FAILED, LauncherError
from launcher.runtime.devices import NodeInventory
from launcher.stage.plan import NodeTarget

if TYPE_CHECKING:
    from launcher.spec.cluster import ClusterConfig, HostConfig

PREFLIGHT_TIMEOUT_S = 60.0  # a first `import torch`-free check; covers slow NFS home dirs


class PreflightError(LauncherError):
    """One or more hosts failed their checks; one line per problem, each naming its host."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class HostReport:
    """What one host told the preflight (or why it could not)."""

    host: HostConfig
    problems: tuple[str, ...]
    inventory: NodeInventory | None = None
    torch_version: str | None = None
    seconds: float = 0.0  # from the start of the login to the answer


def local_torch_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def _public(version: str | None) -> str | None:
    return version.split("+", 1)[0] if version else version


def check_host(
    host: HostConfig,
    *,
    torch_version: str | None,
    first: bool,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    visible_devices: str | None = None,
    links: HostLinks | None = None,
) -> HostReport:
    """Log in (or reuse the run's connection), ask the host's helper, judge its answer here.
    ``visible_devices``: the job's own ``CUDA_VISIBLE_DEVICES``, applied to the host's GPUs."""
    link = (links or current_links()).get(host)
    try:
        data = link.call(
            "preflight", timeout_s=timeout_s, ifname=host.ifname, bind=host.address if first else None, visible_devices=visible_devices
        )
    except SshError as exc:
        return HostReport(host, (f"{host.name}: {exc}",), seconds=time.monotonic() - link.opened_at)
    inventory, problems = _judge_inventory(host, NodeInventory.from_dict(data["inventory"]))
    remote_torch = data.get("torch")
    if remote_torch is None:
        problems.append(f"{host.name}: torch is not installed for {host.python} (install torch {torch_version} there)")
    elif torch_version and _public(remote_torch) != _public(torch_version):
        problems.append(f"{host.name}: torch {remote_torch} does not match torch {torch_version} on this host")
    if host.ifname and not data.get("ifname_present"):
        present = ", ".join(data.get("interfaces", [])) or "none"
        problems.append(f"{host.name}: ifname: network interface '{host.ifname}' not found (present: {present})")
    if first and data.get("bind_error"):
        problems.append(
            f"{host.name}: cannot open a rendezvous port on {host.address} there ({data['bind_error']}); "
            "address must be one of the host's own addresses"
        )
    return HostReport(host, tuple(problems), inventory, remote_torch, time.monotonic() - link.opened_at)


def _judge_inventory(host: HostConfig, inventory: NodeInventory) -> tuple[NodeInventory, list[str]]:
    """The host's GPUs as the cluster file limits them (``gpus: N``), and what does not fit."""
    if host.gpus == "auto":
        return inventory, []
    if host.gpus > inventory.gpu_count:
        seen = ", ".join(inventory.notes) or inventory.source
        return inventory, [f"{host.name}: gpus: {host.gpus} configured but {inventory.gpu_count} visible ({seen})"]
    limited = NodeInventory(
        inventory.hostname, inventory.cpu_count, inventory.gpus[: host.gpus], inventory.source,
        inventory.cuda_visible_devices, (*inventory.notes, f"cluster file: gpus={host.gpus}"),
    )
    return limited, []


def preflight_reports(cluster: ClusterConfig, job: Any = None, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[HostReport]:
    """Every host's login started at once from this thread, then every answer judged."""
    torch_version = local_torch_version()
    visible = job.spec.env.get("CUDA_VISIBLE_DEVICES") if job is not None else None
    hosts, links = cluster.hosts, current_links()
    for host in hosts:
        links.get(host)

    def check(index: int) -> HostReport:
        return check_host(hosts[index], torch_version=torch_version, first=index == 0, timeout_s=timeout_s, visible_devices=visible, links=links)

    return _parallel(check, range(len(hosts)))


def preflight(cluster: ClusterConfig, job: Any = None, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[NodeTarget]:
    """Check every host in parallel; return them as NodeTargets (first host: the rendezvous).
    The connections stay open for the run (``connection_scope``)."""
    reports = preflight_reports(cluster, job, timeout_s=timeout_s)
    problems = [p for r in reports for p in r.problems]
    if problems:
        raise PreflightError([*problems, f"preflight ({cluster.source}): nothing was started"])
    return [
        NodeTarget(name=r.host.name, address=r.host.address, inventory=r.inventory, python=r.host.python, ifname=r.host.ifname, ssh=r.host)
        for r in reports
        if r.inventory is not None
    ]


def remote_free_port(target: NodeTarget) -> int:
    """A TCP port free right now on the target host (its helper binds port 0 on its address)."""
    assert target.ssh is not None
    try:
        data = current_links().get(target.ssh).call("free-port", timeout_s=PREFLIGHT_TIMEOUT_S, bind=target.address)
    except SshError as exc:
        raise PreflightError([f"{target.name}: cannot pick a rendezvous port: {exc}"]) from None
    if data.get("bind_error"):
        raise PreflightError([f"{target.name}: cannot pick a rendezvous port on {target.address}: {data['bind_error']}"])
    return int(data["port"])
