"""Several "servers" on one machine: network namespaces joined by a bridge, each with a real sshd.

Layout (one set per test session, names carry this pytest's pid so parallel runs never clash):

    glt-<pid>-cli   the launching host: bridge br0 10.231.7.1/24; the launcher and ssh run here
    glt-<pid>-h1    10.231.7.11/24 on eth0 (a veth to br0), sshd on port 22
    glt-<pid>-h2    10.231.7.12/24 ...
    glt-<pid>-h3    10.231.7.13/24 ...

The subnet exists only inside these namespaces. Every sshd uses a host key and a client key made
for the session, and a known_hosts file the tests control (StrictHostKeyChecking=yes). The
namespaces share the pid space (tests can kill a rank by pid) and the filesystem, except the run
root (``NetnsCluster.run_root``): each host's sshd runs in a mount namespace of its own with a
tmpfs over that directory, so a host's run directories are private to it, as on real servers,
and the launcher must bring every report back itself. sshd logs every login ("Accepted
publickey"), so tests can count them per host. Finalizers kill every process left in these
namespaces (by pid, found with `ip netns pids`) and delete the namespaces, even when a test fails.

``netns_rig`` builds such a set outside pytest too (``benchmarks/multihost.py`` uses it).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from launcher.procutil import cmdline
from tests.netns import netns_pids, sh
from tests.waiting import wait_empty

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.231.7"
PREFIX = f"glt-{os.getpid()}"


def missing_tools() -> str | None:
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


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_all_in(ns: str) -> None:
    for _ in range(3):
        pids = netns_pids(ns)
        if not pids:
            return
        _kill(pids)
        time.sleep(0.2)


def _delete_ns(ns: str) -> None:
    _kill_all_in(ns)
    sh("ip", "netns", "del", ns, check=False)


def remove_stale_sets() -> None:
    """Namespaces left by an earlier session of these tests whose pytest died (pid gone)."""
    done = sh("ip", "netns", "list", check=False)
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == "glt" and parts[1].isdigit() and int(parts[1]) != os.getpid():
            if not psutil.pid_exists(int(parts[1])):
                _delete_ns(name)
    for group in CPUACCT.glob("glt-*") if CPUACCT.is_dir() else ():
        parts = group.name.split("-")
        if len(parts) >= 3 and parts[1].isdigit() and int(parts[1]) != os.getpid() and not psutil.pid_exists(int(parts[1])):
            with contextlib.suppress(OSError):
                group.rmdir()


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
    run_root: Path  # private to each host (a tmpfs in its own mount namespace); shared by nobody
    created: list[str] = field(default_factory=list)
    host_key: Path | None = None
    authorized: Path | None = None

    def cluster_yaml(self, path: Path, entries: list[dict] | None = None, hosts: list[Host] | None = None, **defaults: object) -> Path:
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
            "hosts": entries if entries is not None else [{"name": h.name, "address": h.address} for h in (hosts or self.hosts)],
        }
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def out_dir(self, name: str) -> Path:
        """A ``--out`` for one test: under the run root, so each host's copy is its own."""
        path = self.run_root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def ns_cmd(self, *argv: str, ns: str | None = None) -> list[str]:
        return ["ip", "netns", "exec", ns or self.cli_ns, *argv]

    def launch(self, *args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`launch ARGS` in the launching host's namespace, as a user would type it."""
        return subprocess.run(
            self.ns_cmd(sys.executable, "-m", "launcher", *args), cwd=REPO, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, **env} if env else None,
        )

    def popen_launch(self, *args: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.ns_cmd(sys.executable, "-m", "launcher", *args), cwd=REPO, text=True, **kwargs)

    def sshd_pids(self) -> set[int]:
        return {h.sshd.pid for h in self.hosts if h.sshd is not None and h.sshd.poll() is None}

    def leftovers(self) -> dict[str, set[int]]:
        """Processes in any of our namespaces other than the sshd listeners themselves."""
        found = {}
        for ns in [self.cli_ns, *(h.ns for h in self.hosts)]:
            pids = netns_pids(ns) - self.sshd_pids()
            if pids:
                found[ns] = pids
        return found

    def wait_clean(self, timeout_s: float = 60.0) -> dict[str, set[int]]:
        """What is left in the hosts' namespaces once it is empty, or after ``timeout_s``: a hang
        guard far above what a loaded machine needs to see processes that were stopped go."""
        return wait_empty(self.leftovers, timeout_s)

    def describe(self, pids: dict[str, set[int]]) -> str:
        out = []
        for ns, ps in pids.items():
            for pid in sorted(ps):
                cmd = " ".join(cmdline(pid)) or "?"
                out.append(f"{ns}: {pid} {cmd[:200]}")
        return "\n".join(out)

    def kill_leftovers(self) -> None:
        for ns in [self.cli_ns, *(h.ns for h in self.hosts)]:
            _kill(netns_pids(ns) - self.sshd_pids())

    # --- what a test does to a host -------------------------------------------------------------

    def sshd_log(self, host: Host) -> Path:
        return self.workdir / f"sshd_{host.name}.log"

    def logins(self, host: Host) -> int:
        """How many SSH logins ``host`` has accepted since its sshd started."""
        try:
            return self.sshd_log(host).read_text(errors="replace").count("Accepted publickey for ")
        except OSError:
            return 0

    def power_off(self, host: Host) -> None:
        """Every process of ``host`` dies at once, its sshd listener included (its private run
        directory goes with its mount namespace): what a power cut leaves, bar the network."""
        _kill_all_in(host.ns)
        if host.sshd is not None:
            host.sshd.wait(10)

    def power_on(self, host: Host) -> None:
        """A fresh sshd (and an empty run root) on a host that was powered off."""
        if host.sshd is None or host.sshd.poll() is not None:
            assert self.host_key is not None and self.authorized is not None
            _start_sshd(host, self.workdir, self.host_key, self.authorized, self.run_root)
            wait_ssh(self, host)

    def cpu_seconds(self, host: Host) -> float | None:
        """CPU time used so far by everything ``host`` ran (None where it cannot be counted)."""
        try:
            return int((_host_cgroup(host) / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def link(self, host: Host, up: bool) -> None:
        """Take ``host``'s only network link down (packets vanish, nothing is closed) or up."""
        sh("ip", "-n", host.ns, "link", "set", "eth0", "up" if up else "down")

    def on_host(self, host: Host, *argv: str) -> subprocess.CompletedProcess:
        """Run a command in ``host``'s own view of the filesystem (its private run root)."""
        assert host.sshd is not None
        return sh("nsenter", "-t", str(host.sshd.pid), "-m", "-n", *argv, check=False)


CPUACCT = Path("/sys/fs/cgroup/cpuacct")  # cgroup v1's CPU accounting, where this machine has it


def _host_cgroup(host: Host) -> Path:
    return CPUACCT / host.ns


def _account(host: Host) -> None:
    """Count the CPU time of everything ``host`` runs (its sshd and all it starts), if we can."""
    group = _host_cgroup(host)
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(host.sshd.pid) if host.sshd is not None else "")
    except OSError:
        pass


def _drop_cgroup(host: Host) -> None:
    for _ in range(20):
        try:
            _host_cgroup(host).rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)  # its last processes are still exiting


def _make_keys(workdir: Path) -> tuple[Path, Path, Path]:
    key, host_key = workdir / "client_key", workdir / "host_key"
    for path in (key, host_key):
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpulaunch-test", "-f", str(path))
    authorized = workdir / "authorized_keys"
    authorized.write_text(Path(f"{key}.pub").read_text())
    authorized.chmod(0o600)
    return key, host_key, authorized


def _start_sshd(host: Host, workdir: Path, host_key: Path, authorized: Path, run_root: Path) -> None:
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
                "LogLevel VERBOSE",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    log = open(workdir / f"sshd_{host.name}.log", "ab")  # noqa: SIM115 - lives as long as sshd
    # `ip netns exec` gives the command a mount namespace of its own (mounts there do not
    # propagate back): the tmpfs over the run root is seen by this sshd and its sessions only.
    # A server's stock ~/.bashrc (Debian's /etc/skel), not this machine's: bash runs it for every
    # command sshd starts, and this machine's runs `pyenv init` (0.11 s of CPU a login), which
    # would be measured as the launcher's cost per host.
    stock_bashrc = "{ [ -f /etc/skel/.bashrc ] && [ -f /root/.bashrc ] && mount --bind /etc/skel/.bashrc /root/.bashrc || true; }"
    script = (f"mount -t tmpfs -o mode=0755,size=256m gl-{host.name} {shlex.quote(str(run_root))} && {stock_bashrc} && "
              f"exec {sshd} -D -e -f {shlex.quote(str(config))}")  # fmt: skip
    host.sshd = subprocess.Popen(["ip", "netns", "exec", host.ns, "sh", "-c", script], stdout=log, stderr=log)
    _account(host)


def ssh_to(cluster: NetnsCluster, host: Host, *remote: str) -> list[str]:
    return cluster.ns_cmd(
        "ssh", "-F", "none", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "ConnectTimeout=3", "-i", str(cluster.key),
        "-l", "root", host.address, *remote,
    )


def wait_ssh(cluster: NetnsCluster, host: Host, timeout_s: float = 20.0) -> None:
    """sshd answers on ``host`` (probed by a connect to its port: no login is logged)."""
    deadline = time.monotonic() + timeout_s
    probe = "import socket,sys; socket.create_connection((sys.argv[1], 22), timeout=1).close()"
    while True:
        done = subprocess.run(cluster.ns_cmd(sys.executable, "-c", probe, host.address), capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline or (host.sshd is not None and host.sshd.poll() is not None):
            log = cluster.sshd_log(host).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"sshd on {host.name} not reachable: {done.stderr.strip()[-500:]}\n{log}")
        time.sleep(0.1)


@contextlib.contextmanager
def netns_rig(workdir: Path, count: int = 3, *, prefix: str = PREFIX) -> Iterator[NetnsCluster]:
    """``count`` hosts with sshd behind one bridge, torn down (every process killed by pid, every
    namespace deleted) when the block ends, however it ends."""
    run_root = workdir / "runs"
    run_root.mkdir(parents=True, exist_ok=True)
    cluster = NetnsCluster(
        cli_ns=f"{prefix}-cli", hosts=[], key=workdir / "client_key", known_hosts=workdir / "known_hosts", workdir=workdir, run_root=run_root
    )
    try:
        _build(cluster, workdir, count, prefix)
        yield cluster
    finally:
        for host in cluster.hosts:
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.kill()
                host.sshd.wait(10)
        for ns in reversed(cluster.created):
            _delete_ns(ns)
        for host in cluster.hosts:
            _drop_cgroup(host)


STATIC_NEIGHBOURS_FROM = 8  # rigs larger than this resolve no address by ARP (see _static_neighbours)


def _mac(ns: str, dev: str) -> str:
    return sh("ip", "-n", ns, "-o", "link", "show", dev).stdout.split("link/ether", 1)[1].split()[0]


def _static_neighbours(cluster: NetnsCluster) -> None:
    """Every address of the rig in every namespace's neighbour table, permanent. With 16 or 32
    hosts on a busy 2-core machine, gloo's full mesh (N x (N-1) connects at once) floods ARP
    broadcasts through the bridge faster than the softirq backlog drains them, and a connect
    fails with "No route to host"; real hosts on a switch do not drop their ARP that way."""
    entries = [(f"{SUBNET}.1", _mac(cluster.cli_ns, "br0"))] + [(h.address, _mac(h.ns, "eth0")) for h in cluster.hosts]
    for ns, dev, own in [(cluster.cli_ns, "br0", f"{SUBNET}.1"), *((h.ns, "eth0", h.address) for h in cluster.hosts)]:
        batch = "".join(f"neigh replace {addr} lladdr {mac} dev {dev} nud permanent\n" for addr, mac in entries if addr != own)
        done = subprocess.run(["ip", "-n", ns, "-batch", "-"], input=batch, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"ip -n {ns} -batch: {done.stderr.strip()}")


def _build(cluster: NetnsCluster, workdir: Path, count: int, prefix: str) -> None:
    cli = cluster.cli_ns
    sh("ip", "netns", "add", cli)
    cluster.created.append(cli)
    sh("ip", "-n", cli, "link", "set", "lo", "up")
    sh("ip", "-n", cli, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", cli, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
    sh("ip", "-n", cli, "link", "set", "br0", "up")
    key, host_key, authorized = _make_keys(workdir)
    cluster.host_key, cluster.authorized = host_key, authorized
    host_pub = Path(f"{host_key}.pub").read_text().split()
    known = []
    for k in range(1, count + 1):
        host = Host(name=f"h{k}", ns=f"{prefix}-h{k}", address=f"{SUBNET}.{10 + k}")
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
    if count > STATIC_NEIGHBOURS_FROM:
        _static_neighbours(cluster)
    for host in cluster.hosts:
        _start_sshd(host, workdir, host_key, authorized, cluster.run_root)
    for host in cluster.hosts:
        wait_ssh(cluster, host)


@pytest.fixture(scope="session")
def netns_cluster(tmp_path_factory) -> Iterator[NetnsCluster]:
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    remove_stale_sets()
    with netns_rig(tmp_path_factory.mktemp("netns"), count=3) as cluster:
        yield cluster


@pytest.fixture
def clean_after(netns_cluster: NetnsCluster):
    """Every test leaves no process in any namespace (checked by the test); this enforces it."""
    yield netns_cluster
    netns_cluster.kill_leftovers()
