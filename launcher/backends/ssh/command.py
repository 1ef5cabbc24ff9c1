"""The ssh command the launcher runs: every option, every remote word quoted, and what its failures mean.

Every remote command is built with ``shlex.join`` so that no spec value is ever parsed by a shell
(spec values travel in ``worker.json`` and on stdin).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from launcher.runtime.hostagent import REMOTE_GRACE_S, SILENCE_S

if TYPE_CHECKING:
    from launcher.spec.cluster import HostConfig

HOST_MODULE = "launcher.runtime.hostagent"
SERVER_ALIVE_INTERVAL_S = 5
SERVER_ALIVE_COUNT_MAX = 3
EXIT_SSH_ERROR = 255  # what ssh exits with when it cannot connect or authenticate, or loses the connection
REQUEST_TIMEOUT_S = 60.0  # one request to a host's helper (a slow NFS home, a slow nvidia-smi)


class SshError(Exception):
    """A remote action failed; the message says what, without the host (callers add it)."""


def heartbeat_timeout(host: Any) -> float:
    """Silence after which a host is lost (and the launcher, to the host): the cluster file's
    ``heartbeat_timeout_s`` where it has one, else ``SILENCE_S``."""
    return float(getattr(host, "heartbeat_timeout_s", None) or SILENCE_S)


def _local_path(path: str | None) -> str | None:
    return None if path is None or path == "none" else os.path.expanduser(path)


def ssh_base_argv(host: Any, extra: Sequence[str] = ()) -> list[str]:
    """``ssh`` with the options every launcher connection uses (and ``extra``), up to the destination."""
    argv = [
        "ssh",
        "-T",  # no pseudo-terminal: teardown goes through the wrapper's stdin lifeline
        "-x",  # no X11 forwarding
        "-a",  # no agent forwarding
        "-o", "BatchMode=yes",  # never prompt for a password or passphrase
        "-o", f"StrictHostKeyChecking={host.strict_host_key_checking}",
        "-o", f"ConnectTimeout={host.connect_timeout_s}",
        "-o", f"ServerAliveInterval={SERVER_ALIVE_INTERVAL_S}",
        "-o", f"ServerAliveCountMax={SERVER_ALIVE_COUNT_MAX}",
        "-o", "LogLevel=ERROR",
    ]
    if host.ssh_config:
        argv += ["-F", host.ssh_config if host.ssh_config == "none" else str(_local_path(host.ssh_config))]
    if host.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={_local_path(host.known_hosts)}"]
    if host.key:
        argv += ["-i", str(_local_path(host.key)), "-o", "IdentitiesOnly=yes"]
    for key, value in host.ssh_options.items():
        argv += ["-o", f"{key}={value}"]
    argv += ["-p", str(host.port)]
    if host.user:
        argv += ["-l", host.user]
    return [*argv, *extra, "--", host.destination]


def _remote(remote_argv: Sequence[str]) -> str:
    """The one string the remote shell parses: ``exec`` and every word quoted."""
    return shlex.join(["exec", *(str(a) for a in remote_argv)])


def ssh_argv(host: Any, remote_argv: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The full ssh argv running ``remote_argv`` on ``host``; the remote shell sees one quoted string."""
    return [*ssh_base_argv(host, extra), _remote(remote_argv)]


def _agent_remote_argv(host: Any, stage_dir: Path, agent_argv: Sequence[str]) -> list[str]:
    return [
        host.python, "-m", HOST_MODULE, "agent", "--stage", str(stage_dir), "--cwd", os.getcwd(),
        "--grace-s", str(REMOTE_GRACE_S), "--silence-s", f"{heartbeat_timeout(host):g}", "--", *agent_argv,
    ]


def remote_agent_command(host: HostConfig, stage_dir: Path, agent_argv: Sequence[str]) -> list[str]:
    """The ssh argv that runs one node's torchrun agent under the lifeline wrapper, as a user
    could type it (the launcher runs the same command over the host's shared connection)."""
    return ssh_argv(host, _agent_remote_argv(host, stage_dir, agent_argv))


def _explain_failure(host: Any, code: int | None, stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit code {code}"
    if code == EXIT_SSH_ERROR:
        return f"unreachable over SSH ({host.user + '@' if host.user else ''}{host.address}:{host.port}): {last}"
    if code == 127 or "No such file or directory" in last and host.python in last:
        return f"python: {host.python} not found there ({last})"
    if "No module named" in stderr and "launcher" in stderr:
        return f"gpulaunch is not installed for {host.python} there (pip install gpulaunch in that environment)"
    return f"remote command failed with exit code {code}: {last}"


