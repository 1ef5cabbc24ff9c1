"""Slurm's client commands (sinfo, sbatch, squeue, scontrol, scancel, sacct), run and parsed.

Every call has a timeout and turns a missing command or a controller that does not answer into
one ``LauncherError`` line. Parsing is pure (``parse_*``), so unit tests feed recorded output.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from launcher.errors import EXIT_BAD_INPUT, LauncherError

TIMEOUT_S = 30.0
# A job in one of these states has ended and holds no resources any more (COMPLETING does).
TERMINAL = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
)


class SlurmError(LauncherError):
    """A Slurm command is missing, failed, or the controller did not answer."""

    exit_code = EXIT_BAD_INPUT


class SlurmUnreachable(SlurmError):
    """No Slurm to ask here: its commands are missing, or they cannot reach a controller."""


def run(argv: Sequence[str], *, timeout_s: float = TIMEOUT_S, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a Slurm client command; raise SlurmError if it is missing or does not answer in time."""
    if shutil.which(argv[0]) is None:
        raise SlurmUnreachable(f"{argv[0]}: command not found; the Slurm client commands (sinfo, sbatch, squeue, scontrol, scancel) must be installed where launch runs")
    try:
        # its own session: a Ctrl-C at the terminal is the launcher's to handle
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False, env=env, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise SlurmUnreachable(f"{' '.join(argv[:3])}: no answer within {timeout_s:g}s (is slurmctld up?)") from None


def checked(argv: Sequence[str], **kwargs) -> str:
    """stdout of a command that must succeed."""
    done = run(argv, **kwargs)
    if done.returncode != 0:  # a client with no configuration, or no controller to talk to
        raise SlurmUnreachable(f"{' '.join(argv[:3])} failed: {one_line(done.stderr or done.stdout)}")
    return done.stdout


def one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "no output")[:400]


# --- parsing ------------------------------------------------------------------------------------


def parse_key_values(line: str) -> dict[str, str]:
    """One line of ``scontrol show -o``: ``Key=value Key2=value with spaces ...``."""
    starts = [m for m in re.finditer(r"(?:^|\s)([A-Za-z][\w/:.]*)=", line)]
    out = {}
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def gpu_count(gres: str) -> int:
    """GPUs in a GRES string: ``gpu:2``, ``gpu:a100:4(S:0-1)``, ``gpu:2,shard:8``; 0 for ``(null)``."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_cpus_per_node(text: str) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE``: ``2(x3),4`` -> [2, 2, 2, 4]."""
    out: list[int] = []
    for item in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m:
            out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def gpus_per_node_env(text: str | None) -> int:
    """``SLURM_GPUS_PER_NODE``: ``2``, ``a100:2`` or ``gpu:a100:2`` -> 2 (0 when unset)."""
    last = (text or "").split(",")[0].split(":")[-1]
    return int(last) if last.isdigit() else 0


def limit_seconds(limit: str) -> int | None:
    """A Slurm time limit in seconds (``MINUTES``, ``MINUTES:SECONDS``, ``HOURS:MINUTES:SECONDS``,
    ``DAYS-HOURS``, ``DAYS-HOURS:MINUTES``, ``DAYS-HOURS:MINUTES:SECONDS``); None for none
    (``INFINITE``, ``UNLIMITED``) or a form this does not know."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit.strip())
    if not m:
        return None
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # DAYS-HOURS[:MINUTES[:SECONDS]]
        return days * 86_400 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # HOURS:MINUTES:SECONDS
        return (a or 0) * 3600 + (b or 0) * 60 + c
    return (a or 0) * 60 + (b or 0)  # MINUTES[:SECONDS]


def time_limit(seconds: float) -> str:
    """Seconds as Slurm's ``D-HH:MM:SS``, rounded up to whole minutes (Slurm's granularity)."""
    minutes = max(1, -(-int(seconds) // 60))
    days, rest = divmod(minutes, 24 * 60)
    text = f"{rest // 60}:{rest % 60:02d}:00"
    return f"{days}-{text}" if days else text


# --- the cluster: partitions and nodes ---------------------------------------------------------


@dataclass(frozen=True)
class SlurmNode:
    name: str
    cpus: int
    gpus: int
    state: str  # sinfo's %T: idle, mixed, allocated, down*, drained, ...


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[SlurmNode, ...]

    def describe(self) -> str:
        """What the partition has, grouped: ``2 nodes with 2 CPUs and 2 GPUs``."""
        groups: dict[tuple[int, int], int] = {}
        for n in self.nodes:
            groups[(n.cpus, n.gpus)] = groups.get((n.cpus, n.gpus), 0) + 1
        parts = [
            f"{count} node{'s' if count > 1 else ''} with {cpus} CPU{'s' if cpus != 1 else ''} and {gpus or 'no'} GPU{'s' if gpus != 1 else ''}"
            for (cpus, gpus), count in sorted(groups.items(), key=lambda kv: (-kv[0][1], -kv[0][0]))
        ]
        return ", ".join(parts) or "no nodes"


SINFO_FORMAT = "%N|%c|%G|%T|%P"


def parse_sinfo(text: str) -> dict[str, list[SlurmNode]]:
    """``sinfo -h -N -o '%N|%c|%G|%T|%P'`` -> partition name (``*`` kept for the default) -> nodes."""
    parts: dict[str, list[SlurmNode]] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5 or not fields[1].isdigit():
            continue
        name, cpus, gres, state, partition = fields
        parts.setdefault(partition, []).append(SlurmNode(name, int(cpus), gpu_count(gres), state))
    return parts


def partition(wanted: str | None, *, timeout_s: float = TIMEOUT_S) -> Partition:
    """The partition ``wanted`` (the cluster's default when None), as ``sinfo`` shows it."""
    found = parse_sinfo(checked(["sinfo", "-h", "-N", "-o", SINFO_FORMAT], timeout_s=timeout_s))
    default = next((p for p in found if p.endswith("*")), None)
    names = sorted(p.rstrip("*") for p in found)
    if wanted is None:
        if default is None:
            raise SlurmError(f"slurm.partition: this cluster has no default partition; set one of: {', '.join(names) or 'none'}")
        key = default
    else:
        named = next((p for p in found if p.rstrip("*") == wanted), None)
        if named is None:
            raise SlurmError(f"slurm.partition: no partition '{wanted}' on this cluster (partitions: {', '.join(names) or 'none'}); nothing was submitted")
        key = named
    unique = {n.name: n for n in found[key]}  # a node can be listed once per state line
    return Partition(key.rstrip("*"), tuple(sorted(unique.values(), key=lambda n: _natural(n.name))))


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def hostnames(nodelist: str) -> list[str]:
    """``n[1-3],gpu7`` -> ``['n1', 'n2', 'n3', 'gpu7']`` (``scontrol show hostnames``)."""
    return checked(["scontrol", "show", "hostnames", nodelist]).split()


def node_records(names: Sequence[str]) -> dict[str, dict[str, str]]:
    """``scontrol show -o node`` for these nodes: name -> fields (NodeAddr, State, Reason, ...)."""
    done = run(["scontrol", "show", "-o", "node", ",".join(names)])
    records = {}
    for line in done.stdout.splitlines():
        rec = parse_key_values(line)
        if "NodeName" in rec:
            records[rec["NodeName"]] = rec
    return records


def slurmd_port() -> int:
    done = run(["scontrol", "show", "config"])
    m = re.search(r"^SlurmdPort\s*=\s*(\d+)", done.stdout, re.MULTILINE)
    return int(m.group(1)) if m else 6818


def probe_nodes(names: Sequence[str], addresses: Mapping[str, str] | None = None, timeout_s: float = 2.0) -> dict[str, str]:
    """name -> why, for the nodes that are gone: Slurm says so already (DOWN, NOT_RESPONDING), or
    their slurmd does not accept a connection within ``timeout_s`` (Slurm notices a lost node only
    after SlurmdTimeout). A slurmd that is asked logs one "Zero Bytes" line; ask only when in doubt."""
    if not names:
        return {}
    try:
        records, port = node_records(names), slurmd_port()
    except SlurmError:
        records, port = {}, 6818
    lost = {}
    for name in names:
        record = records.get(name, {})
        state = record.get("State", "")
        if "DOWN" in state or "NOT_RESPONDING" in state or "FAIL" in state:
            why = record.get("Reason", "")
            lost[name] = f"Slurm reports it {state}" + (f": {why}" if why and why != "(null)" else "")
            continue
        address = (addresses or {}).get(name) or record.get("NodeAddr") or name
        try:
            with socket.create_connection((address, port), timeout=timeout_s):
                pass
        except OSError as exc:
            lost[name] = f"its slurmd at {address}:{port} does not answer: {exc.strerror or exc}"
    return lost


def accounting() -> bool:
    """Whether the cluster keeps job accounting (``sacct`` has finished jobs)."""
    done = run(["scontrol", "show", "config"])
    m = re.search(r"^AccountingStorageType\s*=\s*(\S+)", done.stdout, re.MULTILINE)
    return m is not None and m.group(1) != "accounting_storage/none"


# --- one job -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, NODE_FAIL, ...
    reason: str = ""  # why it pends, or why it ended (squeue %r)
    nodes: str = ""  # the allocation's node list (n[1-2])
    batch_host: str = ""
    exit_code: str = ""  # "0:0": the batch script's exit code and the signal that ended it
    restarts: int | None = None  # times Slurm requeued it (scontrol's Restarts); None: not asked

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def squeue_state(job_id: str) -> JobState | None:
    """The job as slurmctld knows it (any state), or None once it has forgotten it (MinJobAge)."""
    done = run(["squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T|%r|%N|%B"])
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        raise SlurmError(f"squeue -j {job_id} failed: {one_line(done.stderr or done.stdout)}")  # slurmctld away, not the job
    line = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""
    if not line:
        return None
    state, reason, nodes, batch = (line.split("|") + ["", "", "", ""])[:4]
    return JobState(job_id, state.strip(), reason.strip(), nodes.strip(), batch.strip())


def job_record(job_id: str) -> dict[str, str] | None:
    """``scontrol show -o job ID`` as fields (JobState, Reason, NodeList, StdOut, ExitCode, ...);
    None once slurmctld has forgotten the job."""
    done = run(["scontrol", "show", "-o", "job", job_id])
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return parse_key_values(done.stdout.strip().splitlines()[0])


def sacct_state(job_id: str) -> JobState | None:
    """From the accounting database, for a job slurmctld has forgotten (None without accounting)."""
    if not accounting():
        return None
    done = run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,NodeList,ExitCode,Reason"])
    line = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""
    if not line:
        return None
    state, nodes, code, reason = (line.split("|") + ["", "", "", ""])[:4]
    return JobState(job_id, state.split()[0], reason, nodes, "", code)


def state_of(job_id: str) -> JobState | None:
    """The job's state from slurmctld (squeue, then scontrol for its exit code), or from sacct."""
    state = squeue_state(job_id)
    if state is None:
        return sacct_state(job_id)
    if state.terminal:
        rec = job_record(job_id) or {}
        state = JobState(job_id, state.state, state.reason, state.nodes, state.batch_host, rec.get("ExitCode", ""), restarts_of(rec))
    return state


def restarts_of(record: Mapping[str, str]) -> int | None:
    """How many times the job was requeued, from ``scontrol show job``'s fields (None: not there)."""
    value = record.get("Restarts", "")
    return int(value) if value.isdigit() else None


def submit(script: str) -> str:
    """``sbatch --parsable SCRIPT``: the job id. Refusals (no such account, a request no node can
    hold) raise SlurmError with sbatch's own words; nothing was submitted then."""
    done = run(["sbatch", "--parsable", script], timeout_s=60)
    if done.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {one_line(done.stderr or done.stdout)}; nothing was submitted")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {done.stdout.strip()!r} instead of a job id")
    return job_id


def cancel(job_id: str, *, batch_signal: str | None = None) -> None:
    """``scancel`` the job; with ``batch_signal``, only send that signal to its batch script (the
    launcher inside, which then stops its steps and writes its result)."""
    argv = ["scancel", job_id] if batch_signal is None else ["scancel", "--batch", f"--signal={batch_signal}", job_id]
    try:
        run(argv, timeout_s=10)  # a job that has just ended is not an error
    except SlurmError:
        pass  # scancel retries a job it "cannot alter now" for long; the caller checks the state
