"""The SSH transport: the torchrun backend's way to a remote host, through the OpenSSH client.

Every remote action is ``ssh [safe options] -- HOST 'PYTHON -m launcher.runtime.hostagent
SUBCOMMAND ...'``, the remote command built with ``shlex.join`` so that no spec value is ever
parsed by a shell (spec values travel in ``worker.json`` and on stdin). The agent's ssh session
keeps its stdin open for the whole stage: that pipe is the remote agent's lifeline (see
``launcher.runtime.hostagent``). ``preflight`` checks every host of a cluster file in parallel
before anything starts.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from launcher.backends.transports import Transport
from launcher.control.planning import NodeTarget
from launcher.errors import EXIT_JOB_FAILED, BackendError, LauncherError
from launcher.procutil import write_json_atomic
from launcher.protocol import HOST_ANSWER_TAG
from launcher.runtime.devices import NodeInventory
from launcher.runtime.hostagent import REMOTE_GRACE_S

if TYPE_CHECKING:
    from launcher.control.logrouting import LogRouter
    from launcher.control.planning import NodeSlot, StagePlan
    from launcher.spec.cluster import ClusterConfig, HostConfig

HOST_MODULE = "launcher.runtime.hostagent"
SERVER_ALIVE_INTERVAL_S = 5
SERVER_ALIVE_COUNT_MAX = 3
EXIT_SSH_ERROR = 255  # what ssh exits with when it cannot connect or authenticate


class SshError(Exception):
    """A remote action failed; the message says what, without the host (callers add it)."""


# ------------------------------------------------------------------------------ launcher side


def _local_path(path: str | None) -> str | None:
    return None if path is None or path == "none" else os.path.expanduser(path)


def ssh_base_argv(host: Any) -> list[str]:
    """``ssh`` with the options every launcher connection uses, up to the destination."""
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
        argv += ["-F", host.ssh_config if host.ssh_config == "none" else _local_path(host.ssh_config)]
    if host.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={_local_path(host.known_hosts)}"]
    if host.key:
        argv += ["-i", _local_path(host.key), "-o", "IdentitiesOnly=yes"]
    for key, value in host.ssh_options.items():
        argv += ["-o", f"{key}={value}"]
    argv += ["-p", str(host.port)]
    if host.user:
        argv += ["-l", host.user]
    return [*argv, "--", host.destination]


def ssh_argv(host: Any, remote_argv: Sequence[str]) -> list[str]:
    """The full ssh argv running ``remote_argv`` on ``host``; the remote shell sees one quoted string."""
    return [*ssh_base_argv(host), shlex.join(["exec", *(str(a) for a in remote_argv)])]


def remote_module_argv(host: Any, args: Sequence[str]) -> list[str]:
    return ssh_argv(host, [host.python, "-m", HOST_MODULE, *args])


def remote_agent_command(host: HostConfig, stage_dir: Path, agent_argv: Sequence[str]) -> list[str]:
    """The ssh argv that runs one node's torchrun agent under the lifeline wrapper."""
    args = ["agent", "--stage", str(stage_dir), "--cwd", os.getcwd(), "--grace-s", str(REMOTE_GRACE_S), "--"]
    return remote_module_argv(host, [*args, *agent_argv])


def _explain_failure(host: Any, code: int, stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit code {code}"
    if code == EXIT_SSH_ERROR:
        return f"unreachable over SSH ({host.user + '@' if host.user else ''}{host.address}:{host.port}): {last}"
    if code == 127 or "No such file or directory" in last and host.python in last:
        return f"python: {host.python} not found there ({last})"
    if "No module named" in stderr and "launcher" in stderr:
        return f"gpulaunch is not installed for {host.python} there (pip install gpulaunch in that environment)"
    return f"remote command failed with exit code {code}: {last}"


def run_remote_module(host: Any, args: Sequence[str], *, timeout_s: float, stdin: bytes | None = None) -> dict[str, Any]:
    """Run ``python -m launcher.runtime.hostagent ARGS`` on ``host``; return its JSON answer."""
    argv = remote_module_argv(host, args)
    try:
        # its own session: a Ctrl-C at the terminal is the launcher's to handle, not this helper's
        done = subprocess.run(
            argv, input=stdin or b"", capture_output=True, timeout=timeout_s, check=False, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        raise SshError(f"no answer over SSH within {timeout_s:g}s ({host.address}:{host.port})") from None
    except OSError as exc:
        raise SshError(f"cannot run the ssh client: {exc}") from None
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    answer = next((ln[len(HOST_ANSWER_TAG) :] for ln in reversed(out.splitlines()) if ln.startswith(HOST_ANSWER_TAG)), None)
    if done.returncode != 0 or answer is None:
        raise SshError(_explain_failure(host, done.returncode, err or out))
    data = json.loads(answer)
    if data.get("error"):
        raise SshError(data["error"])
    return data


def _parallel(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    items = list(items)
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
        return list(pool.map(fn, items))


class SshTransport(Transport):
    """Remote nodes: each agent runs under the host helper's lifeline wrapper, over ssh."""

    remote = True

    def describe(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str]) -> str:
        return shlex.join(remote_agent_command(_host(node), plan.stage_dir, agent_argv))

    def prepare(self, plan: StagePlan, nodes: Sequence[NodeSlot], timeout_s: float = 60.0) -> None:
        """Create the stage directory on every remote host and put ``worker.json`` there."""

        def prepare(node: NodeSlot) -> str | None:
            payload = plan.worker_for(node).to_json().encode()
            try:
                run_remote_module(_host(node), ["prepare", "--stage", str(plan.stage_dir)], timeout_s=timeout_s, stdin=payload)
            except SshError as exc:
                return f"{node.host}: cannot prepare the run directory {plan.stage_dir}: {exc}"
            return None

        problems = [p for p in _parallel(prepare, nodes) if p]
        if problems:
            raise BackendError("; ".join(problems))

    def spawn(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            remote_agent_command(_host(node), plan.stage_dir, agent_argv),
            env=dict(os.environ),
            stdin=subprocess.PIPE,  # the remote agent's lifeline: closing it stops that host
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it decides teardown
        )
        _send_agent_env(proc, env)
        return proc

    def stop(self, procs: Sequence[subprocess.Popen], grace_s: float) -> None:
        """Close every lifeline at once, then wait for the ssh clients, which exit when their
        remote wrapper has stopped the agent and its ranks (it uses the same grace period)."""
        for proc in procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + grace_s + 5.0  # remote grace + SIGKILL + the way back
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # the caller's SIGTERM/SIGKILL path takes over

    def collect(self, plan: StagePlan, nodes: Sequence[NodeSlot], logs: LogRouter, timeout_s: float = 60.0) -> None:
        """Copy each remote host's rank reports and progress files into the local stage directory."""
        _parallel(lambda node: _fetch(plan, node, logs, timeout_s), nodes)


def _host(node: NodeSlot) -> HostConfig:
    assert node.target.ssh is not None, f"{node.host} is not reached over SSH"
    return node.target.ssh


def _send_agent_env(proc: subprocess.Popen, env: dict[str, str]) -> None:
    """Hand the remote wrapper its env (one JSON line); the pipe then stays open as the lifeline."""
    assert proc.stdin is not None
    try:
        proc.stdin.write((json.dumps({"env": env}) + "\n").encode())
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        pass  # ssh already exited; poll() reports it


def _fetch(plan: StagePlan, node: NodeSlot, logs: LogRouter, timeout_s: float) -> None:
    ranks = [r.rank for r in plan.ranks if r.node_rank == node.node_rank]
    args = ["fetch", "--stage", str(plan.stage_dir), "--ranks", ",".join(map(str, ranks))]
    try:
        data = run_remote_module(_host(node), args, timeout_s=timeout_s)
    except SshError as exc:
        logs.route(f"gpulaunch: could not fetch rank reports from {node.host}: {exc}", node.host)
        return
    for rel, text in data.get("files", {}).items():
        target = plan.stage_dir / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            continue
        try:
            if target.exists() and target.read_text() == text:
                continue  # a shared filesystem: the host wrote it here already
            write_json_atomic(target, json.loads(text))
        except (OSError, ValueError):
            continue


# --------------------------------------------------------------------------------------- preflight

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
    return HostReport(host, tuple(problems), inventory, remote_torch, time.monotonic() - t0)


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


def preflight(cluster: ClusterConfig, job: Any = None, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[NodeTarget]:
    """Check every host in parallel; return them as NodeTargets (first host: the rendezvous)."""
    torch_version = local_torch_version()
    visible = job.spec.env.get("CUDA_VISIBLE_DEVICES") if job is not None else None
    hosts = cluster.hosts

    def check(index: int) -> HostReport:
        return check_host(hosts[index], torch_version=torch_version, first=index == 0, timeout_s=timeout_s, visible_devices=visible)

    reports = _parallel(check, range(len(hosts)))
    problems = [p for r in reports for p in r.problems]
    if problems:
        raise PreflightError([*problems, f"preflight ({cluster.source}): nothing was started"])
    return [
        NodeTarget(name=r.host.name, address=r.host.address, inventory=r.inventory, python=r.host.python, ifname=r.host.ifname, ssh=r.host)
        for r in reports
        if r.inventory is not None
    ]


def remote_free_port(target: NodeTarget) -> int:
    """A TCP port free right now on the target host (it binds port 0 on its own address)."""
    assert target.ssh is not None
    try:
        data = run_remote_module(target.ssh, ["free-port", "--bind", target.address], timeout_s=PREFLIGHT_TIMEOUT_S)
    except SshError as exc:
        raise PreflightError([f"{target.name}: cannot pick a rendezvous port: {exc}"]) from None
    if data.get("bind_error"):
        raise PreflightError([f"{target.name}: cannot pick a rendezvous port on {target.address}: {data['bind_error']}"])
    return int(data["port"])


def ssh_command_preview(host: HostConfig) -> str:
    """How to log in by hand the way the launcher does (for error messages and docs)."""
    return shlex.join(ssh_base_argv(host))
