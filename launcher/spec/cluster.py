"""Several servers: the cluster file that lists them.

``load_cluster(path)`` reads ``configs/<name>.yaml`` (safe YAML, validated by pydantic; every
problem reported at once as ``file:line: field.path: expected ...``, exit 2). Checking the hosts
themselves is the SSH transport's preflight (``launcher.backends.ssh.preflight``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from launcher.errors import SpecError
from launcher.spec.validation import did_you_mean, located_problems
from launcher.spec.yamlsource import SourcedData, load_yaml

HOST_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
SSH_OPTION_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")


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
    # silence after which a host (or, to a host, the launcher) is lost: a cut link, a power loss
    heartbeat_timeout_s: float = Field(5.0, ge=1, le=600)

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
    # where a detached run's run loop lives (``launch JOB --cluster FILE --detach``): one of the
    # hosts (``controller: NAME``) or a host of its own (a mapping, like a host: a login node that
    # runs no rank); None: the first host
    controller: HostConfig | None = None

    @property
    def controller_host(self) -> HostConfig:
        return self.controller or self.hosts[0]

    @model_validator(mode="after")
    def _unique(self) -> "ClusterConfig":
        names = [h.name for h in self.hosts]
        dupes = sorted({v for v in names if names.count(v) > 1})
        if dupes:
            raise ValueError(f"host names must be unique (logs and results use them); repeated: {', '.join(dupes)}")
        return self


_TOP_KEYS = ("defaults", "hosts", "controller")


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

            def from_defaults(loc: tuple[Any, ...], known: set[str] = inherited) -> bool:
                return bool(loc) and loc[0] in known

            problems += located_problems(exc, sourced, HostConfig, ("hosts", i), skip=from_defaults)
    controller = _controller(data.get("controller"), defaults, valid, sourced, path, problems)
    if problems:
        raise SpecError(problems)
    try:
        return ClusterConfig(hosts=tuple(valid), source=str(path), controller=controller)
    except ValidationError as exc:
        raise SpecError([f"{sourced.locate(('hosts',))}: hosts: {e['msg'].replace('Value error, ', '')}" for e in exc.errors()]) from None


def _controller(
    value: Any, defaults: dict[str, Any], hosts: list[HostConfig], sourced: SourcedData, path: Path, problems: list[str]
) -> HostConfig | None:
    """``controller:``: the name of one of the hosts, or a host of its own (a mapping that
    inherits ``defaults`` like any host); None when the file names none."""
    if value is None:
        return None
    where = sourced.locate(("controller",))
    if isinstance(value, str):
        names = [h.name for h in hosts]
        if value not in names:
            problems.append(f"{where}: controller: {value!r} is not one of the hosts{did_you_mean(value, names)}; expected a host's name or a mapping (name, address, ...)")
            return None
        return hosts[names.index(value)]
    if not isinstance(value, dict):
        problems.append(f"{where}: controller: expected a host's name or a mapping (name, address, ...)")
        return None
    if "name" not in value and isinstance(value.get("address"), str):
        value = {**value, "name": value["address"]}
    try:
        return HostConfig.model_validate(_resolve_paths({**defaults, **value}, path.resolve().parent))
    except ValidationError as exc:
        inherited = set(defaults) - set(value)  # reported once, at `defaults`
        problems += located_problems(exc, sourced, HostConfig, ("controller",), skip=lambda loc: bool(loc) and loc[0] in inherited)
        return None


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


__all__ = ["ClusterConfig", "HostConfig", "HostDefaults", "load_cluster"]
