"""A real, private Slurm cluster on one machine: munged, slurmctld and N slurmd "nodes".

Layout of one rig (``k`` is the rig's slot, so a session can hold several rigs at once; names
carry this pytest's pid so a rig left by a dead session is recognised and removed):

    root namespace   munged (private socket and key), slurmctld, and the client commands
                     (sbatch, srun, squeue, ...); one veth end ``sl<pid>x<k>`` holds the
                     controller's address 10.231.9.(16k+1)/28
    gls-<pid>-<k>-sw a "switch": bridge br0 joining the controller's veth and every node's veth
                     (the bridge lives here, not in the root namespace, so a host firewall that
                     filters bridged traffic, e.g. Docker's with br_netfilter, never sees it)
    gls-<pid>-<k>-n1 slurmd for node n1 on eth0 10.231.9.(16k+2)/28, with its own hostname (n1)
                     and /etc/hosts (n1, n2, ... and the controller's hostname), set up by
                     ``unshare --uts --mount`` around slurmd, so every process of a job sees them
    gls-<pid>-<k>-n2 ...                  10.231.9.(16k+3)/28

Nothing else in the root namespace changes: only the rig's veth, its address and the /28 route
that comes with it; eth0 and the default route are never touched.
slurmd is started with ``nsenter --net`` (``ip netns exec`` remounts /sys, and slurmd then fails
with "No filesystem mounted on /sys/fs/cgroup"). The nodes share this machine's filesystem and
pid space, like a site with a shared filesystem, so the project's venv works on every node.

All state (slurm.conf, StateSaveLocation, spool dirs, logs, pid files, the munge key and socket)
lives in the rig's work directory. Daemons run in the foreground as children tracked by pid;
``stop()`` kills every process in the nodes' namespaces (found with ``ip netns pids``), then
slurmctld (and its slurmscriptd) and munged by pid, and deletes the namespaces and the veth.

Slurm behaviour worth knowing when writing tests against a rig (Slurm 22.05, defaults below):
  * srun/salloc allocate at once; a batch job submitted in a rig's first ~3 s waits for
    slurmctld's first scheduling pass (~3 s after it started); later ones start within about
    1 s (``batch_sched_delay=0``).
  * A finished job's record (``scontrol show job``; there is no accounting, so no sacct) is kept
    ``MinJobAge`` (300 s, Slurm's default) after it ends, so a test can read it however late a
    loaded machine lets it ask. ``sbatch --wait`` polls every 2 s only while MinJobAge < 6 (with
    a larger one it sleeps 2, 8, 32, 32 ... s): the rig's ``sbatch_until_ended`` polls the record
    itself instead.
  * A killed node (``kill_node``) shows NOT_RESPONDING after about SlurmdTimeout + 2 s and DOWN
    (its jobs NODE_FAIL, or requeued unless ``--no-requeue``) after about 3 x SlurmdTimeout.
  * A job larger than the partition is accepted and stays pending (EnforcePartLimits=NO); a GRES
    request no node can hold is refused at submission.
  * A requeued job (``scontrol requeue``, a lost node, preemption) pends with reason BeginTime for
    cred_expire + 1 s (``cred_expire``: 120 s by default), then waits for a scheduling pass
    (``sched_interval``: 60 s by default, backfill every 30 s). Its output file is truncated
    unless the job asked for ``--open-mode=append``; ``SLURM_RESTART_COUNT`` counts the requeues.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.netns import netns_pids, sh
from tests.waiting import poll, wait_empty

SUBNET = "10.231.9"  # a /24 cut into /28 slots, one per rig: 16 rigs at once, 13 nodes per rig
SLOTS = 16
PID = os.getpid()
PREFIX = f"gls-{PID}"

# Variables a surrounding Slurm job (or a user's shell) may carry that would point the clients at
# another cluster or change what they ask for.
_CLIENT_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCANCEL_", "SCONTROL_", "SACCT_")

_TOOLS = (
    ("ip", "iproute2"),
    ("nsenter", "util-linux"),
    ("unshare", "util-linux"),
    ("mknod", "coreutils"),
    ("munged", "munge"),
    ("slurmctld", "slurmctld (or slurm-wlm)"),
    ("slurmd", "slurmd (or slurm-wlm)"),
    ("sbatch", "slurm-client (or slurm-wlm)"),
    ("srun", "slurm-client (or slurm-wlm)"),
    ("scontrol", "slurm-client (or slurm-wlm)"),
)


def which(tool: str) -> str | None:
    for cand in (shutil.which(tool), f"/usr/sbin/{tool}", f"/usr/bin/{tool}", f"/sbin/{tool}"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def missing_tools() -> str | None:
    """Why a rig cannot be built here (no Linux, not root, a tool missing), else None."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd, munged; CI runs as root)"
    for tool, pkg in _TOOLS:
        if which(tool) is None:
            return f"needs `{tool}` (apt-get install {pkg})"
    probe = f"{PREFIX}-probe-x"
    done = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_all_in(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in namespace ``ns`` until none is left (new ones may appear while
    slurmstepd is still forking)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = {p for p in netns_pids(ns) if alive(p)}
        if not pids:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes left in {ns} after SIGKILL: {sorted(pids)}")
        for pid in pids:
            _kill(pid)
        time.sleep(0.05)


def delete_ns(ns: str) -> None:
    kill_all_in(ns)
    sh("ip", "netns", "del", ns, check=False)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _pids_mentioning(marker: str) -> list[int]:
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def remove_stale_rigs() -> None:
    """Namespaces, veths and daemons left by an earlier session whose pytest died (pid gone).

    Every path a rig's daemons get holds ``/gls-<pid>-<slot>``; that marker finds them."""
    dead: set[str] = set()
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"gls-(\d+)-\d+-\w+", name)
        if m and int(m.group(1)) != PID and not Path(f"/proc/{m.group(1)}").exists():
            dead.add(m.group(1))
            delete_ns(name)
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+: (sl(\d+)x\d+)[@:]", line)
        if m and int(m.group(2)) != PID and not Path(f"/proc/{m.group(2)}").exists():
            dead.add(m.group(2))
            sh("ip", "link", "del", m.group(1), check=False)
    for pid in dead:
        daemons = _pids_mentioning(f"/gls-{pid}-")
        for proc in [*daemons, *(c for d in daemons for c in _children(d))]:  # slurmscriptd has no path
            _kill(proc)


_taken_slots: dict[int, int] = {}  # slot -> the fd of its lock file, held while the rig lives


def _free_slot() -> int:
    """A /28 of 10.231.9.0/24 that no address in the root namespace uses and no rig holds, in this
    process or another (pytest-xdist workers): each slot has a lock file in /tmp, flock'ed by its
    rig for its lifetime, so the lock goes with a process that dies, leaving nothing stale."""
    used = set(_taken_slots)
    for addr in re.findall(rf"inet ({re.escape(SUBNET)}\.\d+)/", sh("ip", "-o", "-4", "addr", "show", check=False).stdout):
        used.add(int(addr.rsplit(".", 1)[1]) // 16)
    for slot in range(SLOTS):
        if slot in used:
            continue
        try:
            fd = os.open(f"/tmp/gpulaunch-slurmrig-slot{slot}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        except OSError:  # another user's lock file: their slot
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another rig (or not ours to lock)
            os.close(fd)
            continue
        _taken_slots[slot] = fd
        return slot
    raise RuntimeError(f"all {SLOTS} rig slots of {SUBNET}.0/24 are in use")


def _release_slot(slot: int) -> None:
    fd = _taken_slots.pop(slot, None)
    if fd is not None:
        os.close(fd)  # closing drops the flock


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    ns: str
    address: str
    veth: str  # the node's end inside the switch namespace (eth0 is the end inside the node)
    gpus: list[Path] = field(default_factory=list)
    slurmd: subprocess.Popen | None = None


class SlurmRig:
    """One private Slurm cluster. Use as a context manager, or ``start()`` / ``stop()``.

    Client commands must use ``env`` (``SLURM_CONF`` points at this rig's slurm.conf, whose
    ``AuthInfo`` names the rig's munge socket); ``run([...])`` does that.
    """

    ifname = "eth0"  # every node's interface (for GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)

    def __init__(
        self,
        workdir: Path,
        *,
        nodes: int = 2,
        cpus_per_node: int = 2,
        gpus_per_node: int = 0,
        partition: str = "debug",
        slurmd_timeout: int = 5,
        kill_wait: int = 2,
        min_job_age: int = 300,
        cred_expire: int | None = None,
        sched_interval: int | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        if not 1 <= nodes <= 13:
            raise ValueError("a rig holds 1 to 13 nodes (one /28)")
        self.slot = _free_slot()
        self.tag = f"{PREFIX}-{self.slot}"
        self.workdir = Path(workdir) / self.tag  # every daemon's paths carry the tag (stale cleanup)
        if len(str(self.workdir / "munge" / "munge.socket.lock")) > 100:  # sun_path is 108 bytes
            self.workdir = Path(tempfile.mkdtemp(prefix="slurm")) / self.tag
        self.partition = partition
        self.cpus_per_node = cpus_per_node
        self.gpus_per_node = gpus_per_node
        self.slurmd_timeout = slurmd_timeout
        self.kill_wait = kill_wait
        self.min_job_age = min_job_age
        self.cred_expire = cred_expire
        self.sched_interval = sched_interval
        self.start_timeout_s = start_timeout_s
        base = 16 * self.slot
        self.controller_host = socket.gethostname().split(".")[0]
        self.controller_address = f"{SUBNET}.{base + 1}"
        self.prefixlen = 28
        self.switch_ns = f"{self.tag}-sw"
        self.root_veth = f"sl{PID}x{self.slot}"
        assert len(self.root_veth) <= 15, self.root_veth
        self.nodes = [
            Node(name=f"n{i}", ns=f"{self.tag}-n{i}", address=f"{SUBNET}.{base + 1 + i}", veth=f"n{i}") for i in range(1, nodes + 1)
        ]
        self.conf = self.workdir / "etc" / "slurm.conf"
        self.munge_socket = self.workdir / "munge" / "munge.socket"
        self.port = 0
        self.munged: subprocess.Popen | None = None
        self.slurmctld: subprocess.Popen | None = None
        self.scriptd: list[int] = []  # slurmctld's slurmscriptd child
        self._namespaces: list[str] = []
        self._root_veth_made = False
        self._logs: list = []
        self.up_s: float | None = None
        self.down_s: float | None = None
        self.stopped = False

    # ---------------------------------------------------------------- public view

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def addresses(self) -> dict[str, str]:
        return {n.name: n.address for n in self.nodes}

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_ns, *(n.ns for n in self.nodes)]

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands: this process's, less any SLURM_* a surrounding
        job set, plus SLURM_CONF."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
        env["SLURM_CONF"] = str(self.conf)
        return env

    @property
    def pids(self) -> dict[str, int]:
        """Live daemons: munged, slurmctld, slurmscriptd, slurmd:<node>."""
        found = {}
        if self.munged is not None and self.munged.poll() is None:
            found["munged"] = self.munged.pid
        if self.slurmctld is not None and self.slurmctld.poll() is None:
            found["slurmctld"] = self.slurmctld.pid
        for pid in self.scriptd:  # not our child: a zombie counts as gone
            if alive(pid):
                found["slurmscriptd"] = pid
        for n in self.nodes:
            if n.slurmd is not None and n.slurmd.poll() is None:
                found[f"slurmd:{n.name}"] = n.slurmd.pid
        return found

    def run(self, argv: list[str], *, timeout: float = 60, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
        """A client command (sinfo, sbatch, srun, ...) against this rig, from the root namespace."""
        kwargs.setdefault("cwd", self.workdir)
        kwargs.setdefault("env", self.env)
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}\n{done.stdout}")
        return done

    def scontrol_show(self, kind: str, name: str) -> dict[str, str]:
        """``scontrol show -o KIND NAME`` as a dict (e.g. ``("job", "12")["JobState"]``)."""
        done = self.run(["scontrol", "show", "-o", kind, str(name)], check=True)
        return dict(re.findall(r"(\S+?)=(\S*)", done.stdout))

    def node_state(self, name: str) -> str:
        """e.g. ``IDLE``, ``ALLOCATED``, ``DOWN+NOT_RESPONDING``."""
        return self.scontrol_show("node", name)["State"]

    def job(self, job_id: str | int) -> dict[str, str]:
        return self.scontrol_show("job", job_id)

    def wait_for(self, what: str, predicate, timeout_s: float = 30.0, interval_s: float = 0.2):
        value = poll(predicate, timeout_s, interval_s)
        if not value:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}\n{self.log_tail()}")
        return value

    def wait_idle(self, names: list[str] | None = None, timeout_s: float = 30.0) -> None:
        want = set(names or self.node_names)

        def idle() -> bool:
            done = self.run(["sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %T"], timeout=15)
            if done.returncode != 0:
                return False
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            return all(states.get(n) == "idle" for n in want)

        self.wait_for(f"nodes {sorted(want)} idle", idle, timeout_s)

    def sbatch(self, script: str, *args: str, timeout: float = 120) -> tuple[str, subprocess.CompletedProcess]:
        """Submit ``script`` (text) with ``sbatch --parsable ARGS``; returns (job id, result)."""
        path = Path(tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.workdir / "jobs")[1])
        path.write_text(script)
        done = self.run(["sbatch", "--parsable", *args, str(path)], timeout=timeout)
        job_id = done.stdout.strip().split(";")[0] if done.stdout.strip() else ""
        return job_id, done

    def sbatch_until_ended(self, script: str, *args: str, timeout: float = 120) -> tuple[str, dict[str, str]]:
        """Submit ``script`` and wait for the job to end (its record polled every 0.2 s, as
        ``sbatch --wait`` would with a short MinJobAge); returns (job id, its record)."""
        job_id, done = self.sbatch(script, *args, timeout=timeout)
        if done.returncode != 0 or not job_id:
            raise RuntimeError(f"sbatch failed: {done.stderr}")
        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
        self.wait_for(f"job {job_id} to end", lambda: self.job(job_id)["JobState"] in ended, timeout, 0.2)
        return job_id, self.job(job_id)

    def kill_node(self, name: str) -> None:
        """Node loss: SIGKILL that node's slurmd and every process in its namespace (job steps)."""
        node = self.node(name)
        kill_all_in(node.ns)
        if node.slurmd is not None:
            node.slurmd.wait(10)

    def restart_node(self, name: str) -> None:
        """Start a killed node's slurmd again (ReturnToService=2 brings it back to service)."""
        node = self.node(name)
        if node.slurmd is not None and node.slurmd.poll() is None:
            raise RuntimeError(f"slurmd on {name} is still running")
        self._start_slurmd(node)

    def leftovers(self) -> dict[str, set[int]]:
        """Processes in the nodes' namespaces other than slurmd (job steps, ranks, slurmstepd)."""
        daemons = {n.slurmd.pid for n in self.nodes if n.slurmd is not None}
        found = {}
        for n in self.nodes:
            pids = {p for p in netns_pids(n.ns) if alive(p)} - daemons
            if pids:
                found[n.name] = pids
        return found

    def wait_clean(self, timeout_s: float = 60.0) -> dict[str, set[int]]:
        """What is left on the nodes once nothing is, or after ``timeout_s``: a hang guard far
        above what a loaded machine needs to see processes that were stopped go."""
        return wait_empty(self.leftovers, timeout_s)

    def describe(self, pids: dict[str, set[int]]) -> str:
        out = []
        for where, ps in pids.items():
            for pid in sorted(ps):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    cmd = "?"
                out.append(f"{where}: {pid} {cmd[:200]}")
        return "\n".join(out)

    def log_tail(self, chars: int = 3000) -> str:
        out = []
        for path in sorted((self.workdir / "log").iterdir()):
            text = path.read_text(errors="replace")
            if text:
                out.append(f"--- {path.name}\n{text[-chars:]}")
        return "\n".join(out)

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SlurmRig:
        t0 = time.monotonic()
        try:
            self._write_files()
            self._network()
            self._start_munged()
            self._start_slurmctld()
            for node in self.nodes:
                self._start_slurmd(node)
            self.wait_idle(timeout_s=self.start_timeout_s)
            # A step on every node proves the rig end to end (munge, slurmctld, slurmd, srun's
            # connections back to the root namespace) before any test relies on it.
            self.run(["srun", "-N", str(len(self.nodes)), "true"], timeout=self.start_timeout_s, check=True)
            self.wait_idle(timeout_s=self.start_timeout_s)
        except Exception as e:
            logs = self.log_tail() if (self.workdir / "log").is_dir() and not isinstance(e, TimeoutError) else ""
            self.stop()
            raise RuntimeError(f"the Slurm rig did not start: {e}\n{logs}") from e
        except BaseException:
            self.stop()
            raise
        self.up_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Idempotent; kills by pid, deletes namespaces and the veth, even after a partial start."""
        if self.stopped:
            return
        t0 = time.monotonic()
        errors = []
        for node in self.nodes:
            if node.ns in self._namespaces:
                try:
                    kill_all_in(node.ns)
                except RuntimeError as e:
                    errors.append(str(e))
            if node.slurmd is not None:
                if node.slurmd.poll() is None:
                    node.slurmd.kill()
                node.slurmd.wait(10)
        if self.slurmctld is not None:
            self.scriptd = sorted(set(self.scriptd) | set(_children(self.slurmctld.pid)))
            # Its state is thrown away: no need to wait out an RPC to a lost node (~3 s).
            self._terminate(self.slurmctld, grace_s=1.0)
            for pid in self.scriptd:
                if alive(pid):
                    _kill(pid)
        if self.munged is not None:
            self._terminate(self.munged)
        for ns in reversed(self._namespaces):
            try:
                delete_ns(ns)
            except RuntimeError as e:
                errors.append(str(e))
        if self._root_veth_made:
            sh("ip", "link", "del", self.root_veth, check=False)  # usually gone with the switch namespace
        for f in self._logs:
            f.close()
        _release_slot(self.slot)
        self.stopped = True
        self.down_s = time.monotonic() - t0
        if errors:
            raise RuntimeError("; ".join(errors))

    @staticmethod
    def _terminate(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait(10)

    def _log(self, name: str):
        f = open(self.workdir / "log" / f"{name}.out", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(f)
        return f

    def _write_files(self) -> None:
        w = self.workdir
        for sub in ("etc", "state", "spool", "run", "log", "jobs", "dev"):
            (w / sub).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            (w / "spool" / n.name).mkdir(exist_ok=True)
        (w / "munge").mkdir(mode=0o755, exist_ok=True)  # clients of any uid reach the socket
        key = w / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        hosts = [
            "127.0.0.1 localhost",
            f"{self.controller_address} {self.controller_host}",
            *(f"{n.address} {n.name}" for n in self.nodes),
        ]
        (w / "etc" / "hosts").write_text("\n".join(hosts) + "\n")
        (w / "etc" / "plugstack.conf").write_text("")  # not the system's /etc/slurm/plugstack.conf
        gres_lines = []
        for n in self.nodes:
            if self.gpus_per_node:
                (w / "dev" / n.name).mkdir(exist_ok=True)
                for k in range(self.gpus_per_node):
                    dev = w / "dev" / n.name / f"nvidia{k}"
                    if not dev.exists():
                        sh("mknod", str(dev), "c", "1", "3")  # a character device (as /dev/null)
                    n.gpus.append(dev)
                # slurmd 22.05 drops a count-only gpu GRES ("Removing file-less GPU"): name files.
                gres_lines.append(f"NodeName={n.name} Name=gpu File={w}/dev/{n.name}/nvidia[0-{self.gpus_per_node - 1}]")
        (w / "etc" / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        self.port = _free_port()
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        lines = [
            f"ClusterName=gls{PID}x{self.slot}",
            f"SlurmctldHost={self.controller_host}({self.controller_address})",
            f"SlurmctldPort={self.port}",
            "SlurmdPort=6818",  # each slurmd has its own namespace
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}" + (f",cred_expire={self.cred_expire}" if self.cred_expire else ""),
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={w}/state",
            f"SlurmdSpoolDir={w}/spool/%n",
            f"SlurmctldPidFile={w}/run/slurmctld.pid",
            f"SlurmdPidFile={w}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={w}/log/slurmctld.log",
            f"SlurmdLogFile={w}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"PlugStackConfig={w}/etc/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            # Batch jobs start at once, not after the default 3 s batch_sched_delay.
            "SchedulerParameters=batch_sched_delay=0" + (f",sched_interval={self.sched_interval},bf_interval={self.sched_interval}" if self.sched_interval else ""),
            "MpiDefault=none",
            "SwitchType=switch/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout}",
            "SlurmctldTimeout=10",
            f"KillWait={self.kill_wait}",
            f"MinJobAge={self.min_job_age}",
            "InactiveLimit=0",
            "MessageTimeout=5",
            # The nodes declare cpus_per_node whatever this machine has (CI machines differ).
            "SlurmdParameters=config_overrides",
            *(["GresTypes=gpu"] if self.gpus_per_node else []),
            *(
                f"NodeName={n.name} NodeHostname={n.name} NodeAddr={n.address} CPUs={self.cpus_per_node}{gres} State=UNKNOWN"
                for n in self.nodes
            ),
            f"PartitionName={self.partition} Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _network(self) -> None:
        sw = self.switch_ns
        sh("ip", "netns", "add", sw)
        self._namespaces.append(sw)
        sh("ip", "-n", sw, "link", "set", "lo", "up")
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        # The controller's end stays in the root namespace; its peer joins the bridge.
        sh("ip", "link", "add", "name", self.root_veth, "type", "veth", "peer", "name", "ctl", "netns", sw)
        self._root_veth_made = True
        sh("ip", "addr", "add", f"{self.controller_address}/{self.prefixlen}", "dev", self.root_veth)
        sh("ip", "link", "set", self.root_veth, "up")
        sh("ip", "-n", sw, "link", "set", "ctl", "master", "br0")
        sh("ip", "-n", sw, "link", "set", "ctl", "up")
        for n in self.nodes:
            sh("ip", "netns", "add", n.ns)
            self._namespaces.append(n.ns)
            sh("ip", "-n", n.ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", "name", self.ifname, "netns", n.ns, "type", "veth", "peer", "name", n.veth, "netns", sw)
            sh("ip", "-n", n.ns, "addr", "add", f"{n.address}/{self.prefixlen}", "dev", self.ifname)
            sh("ip", "-n", n.ns, "link", "set", self.ifname, "up")
            sh("ip", "-n", sw, "link", "set", n.veth, "master", "br0")
            sh("ip", "-n", sw, "link", "set", n.veth, "up")

    def _start_munged(self) -> None:
        m = self.workdir / "munge"
        self.munged = subprocess.Popen(
            [
                which("munged"), "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={m}/munge.key",
                f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",  # -F: it logs to stderr
            ],
            stdout=self._log("munged"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.wait_for("munged's socket", lambda: self.munge_socket.exists() or self.munged.poll() is not None, 10, 0.02)
        if self.munged.poll() is not None:
            raise RuntimeError(f"munged exited ({self.munged.returncode})\n{self.log_tail()}")

    def _start_slurmctld(self) -> None:
        self.slurmctld = subprocess.Popen(
            [which("slurmctld"), "-D", "-i", "-f", str(self.conf)],
            stdout=self._log("slurmctld"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
        )  # fmt: skip

        def up() -> bool:
            if self.slurmctld.poll() is not None:
                raise RuntimeError(f"slurmctld exited ({self.slurmctld.returncode})\n{self.log_tail()}")
            return "UP" in self.run(["scontrol", "ping"], timeout=15).stdout

        self.wait_for("slurmctld to answer", up, self.start_timeout_s, 0.05)
        self.scriptd = _children(self.slurmctld.pid)

    def _start_slurmd(self, node: Node) -> None:
        inner = (
            f"hostname {node.name} && mount --bind {self.workdir}/etc/hosts /etc/hosts && "
            f"exec {which('slurmd')} -D -f {self.conf} -N {node.name}"
        )
        node.slurmd = subprocess.Popen(
            [which("nsenter"), f"--net=/var/run/netns/{node.ns}", which("unshare"), "--uts", "--mount", "--propagation", "private",
             "sh", "-c", inner],
            stdout=self._log(f"slurmd-{node.name}"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
        )  # fmt: skip
