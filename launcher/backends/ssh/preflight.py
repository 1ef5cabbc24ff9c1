"""Before anything starts on a cluster file's hosts: every host checked in parallel, over the
connection the run keeps (``link``): SSH login, the GPUs (the same discovery code, run there, NVML's
health of each GPU the job will use), torch's version, the named interface, a free rendezvous port
on the first host; then the links between the hosts that passed (``netcheck``). A host that fails
is left out and a spare (a host beyond ``resources.nodes``) takes its place; with too few good
hosts every problem is said, each naming its host, and nothing is started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher.backends.ssh.link import HostLinks, _parallel, current_links
from launcher.backends.ssh.command import SshError
from launcher.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, LauncherError
from launcher.records import HostSwap, NetworkCheck, PreflightRecord
from launcher.hardware.devices import NodeInventory
from launcher.stage.plan import NodeTarget

if TYPE_CHECKING:
    from launcher.spec.cluster import ClusterConfig, HostConfig

PREFLIGHT_TIMEOUT_S = 60.0  # a first `import torch`-free check; covers slow NFS home dirs


class PreflightError(LauncherError):
    """Too few hosts passed their checks; one line per problem, each naming its host. Exit 2 when
    every problem is the hosts' GPUs or links (the cluster cannot run the job as asked), 1 when a
    host could not be reached or set up."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, problems: list[str], *, unfit_only: bool = False) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems), exit_code=EXIT_BAD_INPUT if unfit_only else EXIT_JOB_FAILED)


@dataclass(frozen=True)
class PreflightOutcome:
    """The hosts to run on (the first ``resources.nodes`` of them; the rest are spares) and what
    the checks decided, for the console and ``result.json``."""

    targets: list[NodeTarget]
    record: PreflightRecord


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
    """Every host's login started at once (each from its own thread: ``HostLinks.get``), then
    every answer judged."""
    torch_version = local_torch_version()
    visible = job.spec.env.get("CUDA_VISIBLE_DEVICES") if job is not None else None
    hosts, links = cluster.hosts, current_links()

    def check(index: int) -> HostReport:
        return check_host(hosts[index], torch_version=torch_version, first=index == 0, timeout_s=timeout_s, visible_devices=visible, links=links)

    return _parallel(check, range(len(hosts)))


def preflight(cluster: ClusterConfig, job: Any = None, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[NodeTarget]:
    """Check every host in parallel; return the usable ones as NodeTargets (first host: the
    rendezvous). The connections stay open for the run (``connection_scope``)."""
    return preflight_hosts(cluster, job, timeout_s=timeout_s).targets


def preflight_hosts(cluster: ClusterConfig, job: Any = None, *, timeout_s: float = PREFLIGHT_TIMEOUT_S, network: bool = True) -> PreflightOutcome:
    """Every host checked in parallel (login, torch, interface, the GPUs the job will use), then
    the links between those that passed (``preflight.network``). A host that fails is left out and
    the next spare (a host beyond ``resources.nodes``) takes its place; too few usable hosts: every
    problem, one line each, and nothing is started. ``network=False``: no link check (a dry run)."""
    started = time.monotonic()
    reports = preflight_reports(cluster, job, timeout_s=timeout_s)
    wanted = min(job.spec.resources.nodes, len(reports)) if job is not None else len(reports)
    needed = min(job.spec.resources.fewest_nodes, wanted) if job is not None else wanted  # an elastic world starts on fewer
    faults = {r.host.name: [*r.problems, *_unfit_gpus(r, job)] for r in reports}
    unfit_only = not any(r.problems for r in reports)
    usable = [r for r in reports if not faults[r.host.name]]
    links, undecided = _check_network(usable, job, faults) if network else (None, [])
    usable = [r for r in usable if not faults[r.host.name]]
    if len(usable) < needed or undecided:
        lines = [p for r in reports for p in faults[r.host.name]] + undecided
        asked = f"at least {needed}" if needed < wanted else f"the {wanted}"
        raise PreflightError(
            [*lines, f"preflight ({cluster.source}): {len(usable)} of {asked} host(s) the job needs passed; nothing was started"],
            unfit_only=unfit_only,
        )
    record = PreflightRecord(
        hosts=tuple(r.host.name for r in usable[:wanted]), spares=tuple(r.host.name for r in usable[wanted:]),
        left_out=_swaps(reports, usable, wanted, faults), network=links, seconds=round(time.monotonic() - started, 3),
    )  # fmt: skip
    targets = [  # the hosts to use first, then the spares
        NodeTarget(name=r.host.name, address=r.host.address, inventory=r.inventory, python=r.host.python, ifname=r.host.ifname, ssh=r.host)
        for r in usable
        if r.inventory is not None
    ]
    return PreflightOutcome(targets, record)


def _unfit_gpus(report: HostReport, job: Any) -> list[str]:
    """The GPU problems of the host's GPUs that the job will use (``preflight.gpu_health``)."""
    if job is None or report.inventory is None or not job.spec.preflight.gpu_health:
        return []
    wanted = job.spec.resources.gpus_used()
    if wanted == 0:
        return []
    problems = report.inventory.unfit_gpus(wanted, min_free_fraction=job.spec.preflight.min_free_gpu_memory)
    return [p.replace(f"{report.inventory.hostname}: ", f"{report.host.name}: ", 1) for p in problems]


def _check_network(usable: list[HostReport], job: Any, faults: dict[str, list[str]]) -> tuple[NetworkCheck | None, list[str]]:
    """The links between the usable hosts; the hosts they blame get the lines as faults. Slow or
    missing links that name no blamed host (two hosts: either end) cannot be worked around: they
    come back, and stop the start."""
    if job is None or not job.spec.preflight.network or len(usable) < 2:
        return None, []
    from launcher.backends.ssh.netcheck import network_check

    settings = job.spec.preflight
    check = network_check([r.host for r in usable], current_links(), budget_s=settings.network_budget_s, min_fraction=settings.min_link_fraction)
    for name in check.bad_hosts:
        faults[name].extend(f"{name}: {line}" for line in (*check.slow, *check.unreachable) if _names(line, name))
    unexplained = [line for line in (*check.slow, *check.unreachable) if not any(_names(line, name) for name in check.bad_hosts)]
    if not unexplained:
        return check, []
    hint = "set preflight.min_link_fraction lower (or preflight.network: false) to start anyway"
    return check, [*unexplained, f"the network check cannot tell which host is at fault: {hint}"]


def _names(line: str, host: str) -> bool:
    """Does a network line name this host (as a word: node-1 is not node-10)?"""
    import re

    return re.search(rf"(?<![\w.-]){re.escape(host)}(?![\w.-])", line) is not None


def _swaps(reports: list[HostReport], usable: list[HostReport], wanted: int, faults: dict[str, list[str]]) -> tuple[HostSwap, ...]:
    """Each host left out, with the spare that took its place (in the cluster file's order)."""
    first = [r.host.name for r in reports[:wanted]]
    newcomers = iter(r.host.name for r in usable[:wanted] if r.host.name not in first)
    return tuple(
        HostSwap(r.host.name, tuple(faults[r.host.name]), next(newcomers, None) if r.host.name in first else None)
        for r in reports
        if faults[r.host.name]
    )


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
