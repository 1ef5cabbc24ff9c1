"""Several "servers" on one machine: network namespaces joined by a bridge, each with a real sshd.

Layout (one set per test session, names carry this pytest's pid so parallel runs never clash):

    glt-<pid>-cli   the launching host: bridge br0 10.231.7.1/24; the launcher and ssh run here
    glt-<pid>-h1    10.231.7.11/24 on eth0 (a veth to br0), sshd on port 22
    glt-<pid>-h2    10.231.7.12/24 ...
    glt-<pid>-h3    10.231.7.13/24 ...

The subnet exists only inside these namespaces. Every sshd uses a host key and a client key made
for the session, and a known_hosts file the tests control (StrictHostKeyChecking=yes). The
namespaces share the filesystem and pid space, so the venv's python works in every "host" and
tests can kill a rank by pid. Finalizers kill every process left in these namespaces (by pid,
found with `ip netns pids`) and delete the namespaces, even when a test fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from launcher.procutil import cmdline
from tests.conftest import REPO

SUBNET = "10.231.7"
PREFIX = f"glt-{os.getpid()}"


def _missing_tools() -> str | None:
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    for tool, pkg in (("ip", "iproute2"), ("sshd", "openssh-server"), ("ssh", "openssh-client"), ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"needs `{tool}` (apt-get install {pkg})"
    probe = f"{PREFIX}-probe"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def netns_pids(ns: str) -> set[int]:
    done = sh("ip", "netns", "pids", ns, check=False)
    return {int(p) for p in done.stdout.split() if p.strip().isdigit()} if done.returncode == 0 else set()


def _kill_all_in(ns: str) -> None:
    for _ in range(3):
        pids = netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _delete_ns(ns: str) -> None:
    _kill_all_in(ns)
    sh("ip", "netns", "del", ns, check=False)


def _remove_stale_sets() -> None:
    """Namespaces left by an earlier session of these tests whose pytest died (pid gone)."""
    done = sh("ip", "netns", "list", check=False)
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == "glt" and parts[1].isdigit() and int(parts[1]) != os.getpid():
            if not psutil.pid_exists(int(parts[1])):
                _delete_ns(name)


@dataclass
class Host:
    name: str
    ns: str
    address: str
    sshd: subprocess.Popen | None = None


@dataclass
class NetnsCluster:
    """Hosts in namespaces with sshd; the launcher runs in ``cli_ns``."""

    cli_ns: str
    hosts: list[Host]
    key: Path
    known_hosts: Path
    workdir: Path
    created: list[str] = field(default_factory=list)

    def cluster_yaml(self, path: Path, entries: list[dict] | None = None, **defaults: object) -> Path:
        """A cluster file for these hosts (or for ``entries``), with the test's key and known_hosts."""
        import yaml

        data = {
            "defaults": {
                "user": "root",
                "key": str(self.key),
                "known_hosts": str(self.known_hosts),
                "strict_host_key_checking": "yes",
                "ssh_config": "none",
                "python": sys.executable,
                "ifname": "eth0",
                "connect_timeout_s": 3,
                **defaults,
            },
            "hosts": entries if entries is not None else [{"name": h.name, "address": h.address} for h in self.hosts],
        }
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def ns_cmd(self, *argv: str, ns: str | None = None) -> list[str]:
        return ["ip", "netns", "exec", ns or self.cli_ns, *argv]

    def launch(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """`launch ARGS` in the launching host's namespace, as a user would type it."""
        return subprocess.run(
            self.ns_cmd(sys.executable, "-m", "launcher", *args), cwd=REPO, capture_output=True, text=True, timeout=timeout
        )

    def popen_launch(self, *args: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.ns_cmd(sys.executable, "-m", "launcher", *args), cwd=REPO, text=True, **kwargs)

    def sshd_pids(self) -> set[int]:
        return {h.sshd.pid for h in self.hosts if h.sshd is not None}

    def leftovers(self) -> dict[str, set[int]]:
        """Processes in any of our namespaces other than the sshd listeners themselves."""
        found = {}
        for ns in [self.cli_ns, *(h.ns for h in self.hosts)]:
            pids = netns_pids(ns) - self.sshd_pids()
            if pids:
                found[ns] = pids
        return found

    def wait_clean(self, timeout_s: float = 15.0) -> dict[str, set[int]]:
        deadline = time.monotonic() + timeout_s
        left = self.leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.leftovers()
        return left

    def describe(self, pids: dict[str, set[int]]) -> str:
        out = []
        for ns, ps in pids.items():
            for pid in sorted(ps):
                cmd = " ".join(cmdline(pid)) or "?"
                out.append(f"{ns}: {pid} {cmd[:200]}")
        return "\n".join(out)

    def kill_leftovers(self) -> None:
        for ns in [self.cli_ns, *(h.ns for h in self.hosts)]:
            for pid in netns_pids(ns) - self.sshd_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _make_keys(workdir: Path) -> tuple[Path, Path, Path]:
    key, host_key = workdir / "client_key", workdir / "host_key"
    for path in (key, host_key):
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpulaunch-test", "-f", str(path))
    authorized = workdir / "authorized_keys"
    authorized.write_text(Path(f"{key}.pub").read_text())
    authorized.chmod(0o600)
    return key, host_key, authorized


def _start_sshd(host: Host, workdir: Path, host_key: Path, authorized: Path) -> None:
    config = workdir / f"sshd_{host.name}.conf"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress {host.address}",
                "Port 22",
                f"HostKey {host_key}",
                "PidFile none",
                f"AuthorizedKeysFile {authorized}",
                "StrictModes no",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "MaxStartups 100:30:200",
                "MaxSessions 100",
                "LogLevel INFO",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    log = open(workdir / f"sshd_{host.name}.log", "ab")  # noqa: SIM115 - lives as long as sshd
    host.sshd = subprocess.Popen(["ip", "netns", "exec", host.ns, sshd, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)


@pytest.fixture(scope="session")
def netns_cluster(tmp_path_factory) -> NetnsCluster:
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    _remove_stale_sets()
    workdir = tmp_path_factory.mktemp("netns")
    cluster = NetnsCluster(cli_ns=f"{PREFIX}-cli", hosts=[], key=workdir / "client_key", known_hosts=workdir / "known_hosts", workdir=workdir)
    try:
        _build(cluster, workdir, count=3)
        yield cluster
    finally:
        for host in cluster.hosts:
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.kill()
                host.sshd.wait(10)
        for ns in reversed(cluster.created):
            _delete_ns(ns)


def _build(cluster: NetnsCluster, workdir: Path, count: int) -> None:
    cli = cluster.cli_ns
    sh("ip", "netns", "add", cli)
    cluster.created.append(cli)
    sh("ip", "-n", cli, "link", "set", "lo", "up")
    sh("ip", "-n", cli, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", cli, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
    sh("ip", "-n", cli, "link", "set", "br0", "up")
    key, host_key, authorized = _make_keys(workdir)
    host_pub = Path(f"{host_key}.pub").read_text().split()
    known = []
    for k in range(1, count + 1):
        host = Host(name=f"h{k}", ns=f"{PREFIX}-h{k}", address=f"{SUBNET}.{10 + k}")
        sh("ip", "netns", "add", host.ns)
        cluster.created.append(host.ns)
        sh("ip", "-n", host.ns, "link", "set", "lo", "up")
        # Both ends are created inside our namespaces: nothing appears in the root namespace.
        sh("ip", "link", "add", "name", "eth0", "netns", host.ns, "type", "veth", "peer", "name", f"vh{k}", "netns", cli)
        sh("ip", "-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
        sh("ip", "-n", cli, "link", "set", f"vh{k}", "master", "br0")
        sh("ip", "-n", cli, "link", "set", f"vh{k}", "up")
        known.append(f"{host.address} {host_pub[0]} {host_pub[1]}")
        cluster.hosts.append(host)
    cluster.known_hosts.write_text("\n".join(known) + "\n")
    for host in cluster.hosts:
        _start_sshd(host, workdir, host_key, authorized)
    for host in cluster.hosts:
        _wait_ssh(cluster, host)


def ssh_to(cluster: NetnsCluster, host: Host, *remote: str) -> list[str]:
    return cluster.ns_cmd(
        "ssh", "-F", "none", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "ConnectTimeout=3", "-i", str(cluster.key),
        "-l", "root", host.address, *remote,
    )


def _wait_ssh(cluster: NetnsCluster, host: Host, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run(ssh_to(cluster, host, "true"), capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline or (host.sshd is not None and host.sshd.poll() is not None):
            log = (cluster.workdir / f"sshd_{host.name}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"sshd on {host.name} not reachable: {done.stderr.strip()}\n{log}")
        time.sleep(0.2)


@pytest.fixture
def clean_after(netns_cluster: NetnsCluster):
    """Every test leaves no process in any namespace (checked by the test); this enforces it."""
    yield netns_cluster
    netns_cluster.kill_leftovers()
