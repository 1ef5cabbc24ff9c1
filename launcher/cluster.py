"""Several servers: the cluster file, and the preflight that checks every host before a start.

``load_cluster(path)`` reads ``configs/<name>.yaml`` (safe YAML, validated by pydantic; every
problem reported at once as ``file:line: field.path: expected ...``). ``preflight(cluster, job)``
then asks every host, in parallel and over SSH, for what the plan needs: its GPU inventory (the
same discovery code, run there), its torch version (must match this host's), the network
interface named for NCCL/gloo, and a port it can bind. Any failure names the host and the
problem, and nothing is started. Exit codes: 2 for a bad cluster file, 1 for hosts that fail
their checks (unreachable, missing Python/torch/gpulaunch, version mismatch, ...).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from launcher.devices import NodeInventory
from launcher.errors import EXIT_JOB_FAILED, LauncherError, SpecError
from launcher.plan import NodeTarget
from launcher.validation import did_you_mean, located_problems
from launcher.yamlsource import load_yaml

HOST_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
SSH_OPTION_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")
PREFLIGHT_TIMEOUT_S = 60.0  # a first `import torch`-free check; covers slow NFS home dirs


class PreflightError(LauncherError):
    """One or more hosts failed their checks; one line per problem, each naming its host."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostDefaults(_Frozen):
    """Settings every host inherits unless it sets its own."""

    user: str | None = Field(None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    port: int = Field(22, ge=1, le=65535)
    key: str | None = None  # private key file (-i); default: ssh's own choice (agent, ~/.ssh/id_*)
    python: str = "python3"
    gpus: Literal["auto"] | Annotated[int, Field(ge=0, le=1024)] = "auto"
    ifname: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:@-]{1,15}$")
    known_hosts: str | None = None  # UserKnownHostsFile; default: ~/.ssh/known_hosts
    strict_host_key_checking: Literal["yes", "accept-new"] = "accept-new"
    ssh_config: str | None = None  # -F FILE ("none": read no ssh config file)
    ssh_options: dict[str, str] = Field(default_factory=dict)  # extra -o Key=Value, e.g. ProxyJump
    connect_timeout_s: int = Field(10, ge=1, le=300)

    @field_validator("ssh_options", mode="before")
    @classmethod
    def _options(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str) or not SSH_OPTION_NAME.match(key):
                    raise ValueError(f"expected ssh option names like ProxyJump, got {key!r}")
            return {k: str(v) for k, v in value.items()}
        return value


class HostConfig(HostDefaults):
    """One server: where it is, how to log in, what to run there."""

    name: str = Field(pattern=HOST_NAME)
    address: str = Field(pattern=r"^[A-Za-z0-9_.:%-]+$", min_length=1, max_length=253)

    @property
    def destination(self) -> str:
        return self.address


class ClusterConfig(_Frozen):
    hosts: tuple[HostConfig, ...] = Field(min_length=1, max_length=4096)
    source: str = "<memory>"

    @model_validator(mode="after")
    def _unique(self) -> "ClusterConfig":
        names = [h.name for h in self.hosts]
        dupes = sorted({v for v in names if names.count(v) > 1})
        if dupes:
            raise ValueError(f"host names must be unique (logs and results use them); repeated: {', '.join(dupes)}")
        return self


_TOP_KEYS = ("defaults", "hosts")


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file; raise SpecError (exit 2) listing every problem."""
    path = Path(path)
    sourced = load_yaml(path, what="cluster file")
    data = sourced.data
    if not isinstance(data, dict):
        raise SpecError([f"{sourced.origin}: expected a mapping with 'hosts' (and optional 'defaults')"])
    problems: list[str] = []
    for key in data:
        if key not in _TOP_KEYS:
            problems.append(f"{sourced.locate((key,))}: {key}: unknown key{did_you_mean(str(key), _TOP_KEYS)}")
    defaults = data.get("defaults") or {}
    hosts = data.get("hosts")
    if not isinstance(defaults, dict):
        problems.append(f"{sourced.locate(('defaults',))}: defaults: expected a mapping of host settings")
        defaults = {}
    if not isinstance(hosts, list) or not hosts:
        problems.append(f"{sourced.locate(('hosts',))}: hosts: expected a non-empty list of hosts (name, address, ...)")
        raise SpecError(problems)
    try:
        HostDefaults.model_validate(defaults)
    except ValidationError as exc:
        problems += located_problems(exc, sourced, HostDefaults, ("defaults",))
    merged = []
    for i, host in enumerate(hosts):
        if not isinstance(host, dict):
            problems.append(f"{sourced.locate(('hosts', i))}: hosts.{i}: expected a mapping (name, address, ...)")
            continue
        if "name" not in host and isinstance(host.get("address"), str):
            host = {**host, "name": host["address"]}
        merged.append((i, _resolve_paths({**defaults, **host}, path.resolve().parent)))
    valid: list[HostConfig] = []
    for i, host in merged:
        try:
            valid.append(HostConfig.model_validate(host))
        except ValidationError as exc:
            # a bad value a host inherited from `defaults` is reported once, at `defaults` (not per host)
            inherited = set(defaults) - set(hosts[i])
            problems += located_problems(exc, sourced, HostConfig, ("hosts", i), skip=lambda loc, known=inherited: bool(loc) and loc[0] in known)
    if problems:
        raise SpecError(problems)
    try:
        return ClusterConfig(hosts=tuple(valid), source=str(path))
    except ValidationError as exc:
        raise SpecError([f"{sourced.locate(('hosts',))}: hosts: {e['msg'].replace('Value error, ', '')}" for e in exc.errors()]) from None


_PATH_FIELDS = ("key", "known_hosts", "ssh_config")


def _resolve_paths(host: dict[str, Any], base: Path) -> dict[str, Any]:
    """Local files (key, known_hosts, ssh_config): ``~`` expanded, relative to the cluster file."""
    out = dict(host)
    for name in _PATH_FIELDS:
        value = out.get(name)
        if isinstance(value, str) and value and value != "none":
            expanded = Path(value).expanduser()
            out[name] = str(expanded if expanded.is_absolute() else base / expanded)
    return out


# --------------------------------------------------------------------------------------- preflight


@dataclass(frozen=True)
class HostReport:
    """What one host told the preflight (or why it could not)."""

    host: HostConfig
    problems: tuple[str, ...]
    inventory: NodeInventory | None = None
    torch_version: str | None = None
    seconds: float = 0.0


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
) -> HostReport:
    """One SSH round trip: the remote preflight prints one JSON line; judge it here.
    ``visible_devices``: the job's own ``CUDA_VISIBLE_DEVICES``, applied to the host's GPUs."""
    from launcher.backends.ssh import SshError, run_remote_module

    t0 = time.monotonic()
    args = ["preflight"]
    if host.ifname:
        args += ["--ifname", host.ifname]
    if visible_devices is not None:
        args += ["--visible-devices", visible_devices]
    if first:
        args += ["--bind", host.address]
    try:
        data = run_remote_module(host, args, timeout_s=timeout_s)
    except SshError as exc:
        return HostReport(host, (f"{host.name}: {exc}",), seconds=time.monotonic() - t0)
    problems = []
    inventory = NodeInventory.from_dict(data["inventory"])
    if host.gpus != "auto":
        if host.gpus > inventory.gpu_count:
            problems.append(f"{host.name}: gpus: {host.gpus} configured but {inventory.gpu_count} visible ({', '.join(inventory.notes) or inventory.source})")
        else:
            inventory = NodeInventory(
                inventory.hostname, inventory.cpu_count, inventory.gpus[: host.gpus], inventory.source,
                inventory.cuda_visible_devices, (*inventory.notes, f"cluster file: gpus={host.gpus}"),
            )
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
    return HostReport(host, tuple(problems), inventory, remote_torch, time.monotonic() - t0)


def preflight(cluster: ClusterConfig, job: Any = None, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[NodeTarget]:
    """Check every host in parallel; return them as NodeTargets (first host: the rendezvous)."""
    torch_version = local_torch_version()
    visible = job.spec.env.get("CUDA_VISIBLE_DEVICES") if job is not None else None
    hosts = cluster.hosts

    def check(index: int, host: HostConfig) -> HostReport:
        return check_host(host, torch_version=torch_version, first=index == 0, timeout_s=timeout_s, visible_devices=visible)

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        reports = list(pool.map(check, range(len(hosts)), hosts))
    problems = [p for r in reports for p in r.problems]
    if problems:
        where = f"preflight ({cluster.source}): nothing was started"
        raise PreflightError([*problems, where])
    return [
        NodeTarget(name=r.host.name, address=r.host.address, inventory=r.inventory, python=r.host.python, ifname=r.host.ifname, ssh=r.host)
        for r in reports
        if r.inventory is not None
    ]


def remote_free_port(target: NodeTarget) -> int:
    """A TCP port free right now on the target host (it binds port 0 on its own address)."""
    from launcher.backends.ssh import SshError, run_remote_module

    try:
        data = run_remote_module(target.ssh, ["free-port", "--bind", target.address], timeout_s=PREFLIGHT_TIMEOUT_S)
    except SshError as exc:
        raise PreflightError([f"{target.name}: cannot pick a rendezvous port: {exc}"]) from None
    if data.get("bind_error"):
        raise PreflightError([f"{target.name}: cannot pick a rendezvous port on {target.address}: {data['bind_error']}"])
    return int(data["port"])


def ssh_command_preview(host: HostConfig) -> str:
    """How to log in by hand the way the launcher does (for error messages and docs)."""
    import shlex

    from launcher.backends.ssh import ssh_base_argv

    return shlex.join(ssh_base_argv(host))


__all__ = ["ClusterConfig", "HostConfig", "HostDefaults", "PreflightError", "load_cluster", "preflight", "remote_free_port"]
