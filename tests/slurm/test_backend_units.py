"""The Slurm backend's pure parts, without a cluster: parsing Slurm's output, the allocation a spec
asks for (and the refusal of one no partition can hold), the sbatch script (its body run by bash
with a stand-in launcher and scancel), the ``slurm:`` section's checks, and why a job that ended
without a result ended (the lines the launcher inside a job writes for the one outside are the
remote-run wire's: tests/unit/test_wire.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from launcher.backends.slurm import commands
from launcher.backends.slurm.commands import Partition, SlurmNode
from launcher.backends.slurm import script as slurm_script
from launcher.backends.slurm.jobs import OutputTail
from launcher.backends.slurm.script import allocation_for, batch_body, sbatch_script
from launcher.backends.slurm.submit import SlurmRun
from launcher.backends.slurm.inside import restart_count, saved_progress
from launcher.stage.watch import RunEvents
from launcher.stage.wire import WireReader
from launcher.backends.slurm.outcome import explain_end
from launcher.errors import PlanError, SpecError
from launcher.records import FailureReason
from launcher.spec.model import load_job
from tests.waiting import poll


def job(tmp_path: Path, extra: str = "", resources: str = "{nodes: 2, cpu_workers: 2}"):
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: tiny\nentrypoint: launcher.workloads.matmul:run\nbackend: slurm\n"
        f"resources: {resources}\ntimeouts: {{rendezvous_s: 60, run_s: 600}}\n" + textwrap.dedent(extra)
    )
    return load_job(path)


DEBUG = Partition("debug", (SlurmNode("n1", 8, 0, "idle"), SlurmNode("n2", 8, 0, "idle")))
GPU = Partition("gpu", (SlurmNode("g1", 32, 4, "idle"), SlurmNode("g2", 32, 4, "mixed"), SlurmNode("g3", 16, 2, "idle")))


def test_slurm_output_is_parsed():
    sinfo = "n1|2|(null)|idle|debug*\nn2|2|gpu:a100:4(S:0-1),shard:8|mixed|debug*\ng1|64|gpu:8|idle|gpu\n"
    parts = commands.parse_sinfo(sinfo)
    assert [(n.name, n.cpus, n.gpus) for n in parts["debug*"]] == [("n1", 2, 0), ("n2", 2, 4)]
    assert commands.gpu_count("gpu:2,gpu:v100:1") == 3 and commands.gpu_count("(null)") == 0
    assert commands.parse_cpus_per_node("2(x3),4") == [2, 2, 2, 4]
    assert commands.gpus_per_node_env("a100:2") == 2 and commands.gpus_per_node_env(None) == 0
    assert [commands.time_limit(s) for s in (1, 60, 3661, 86_400 + 120)] == ["0:01:00", "0:01:00", "1:02:00", "1-0:02:00"]
    record = commands.parse_key_values("NodeName=n2 Arch=x86_64 State=DOWN+NOT_RESPONDING Reason=Not responding [slurm@2026] NodeAddr=10.0.0.3")
    assert record["Reason"] == "Not responding [slurm@2026]" and record["NodeAddr"] == "10.0.0.3"


def test_the_allocation_one_task_per_node_sized_for_the_largest_stage(tmp_path):
    alloc = allocation_for(job(tmp_path, "scaling: {workers: [2, 4]}\n"), DEBUG)
    # 2 x (60 + 600) + 60 s, and Slurm's warning: preemption.grace_s (60) + 30 s
    assert (alloc.nodes, alloc.gpus_per_node, alloc.cpus_per_task, alloc.time) == (2, 0, 2, "0:25:00")
    gpus = allocation_for(job(tmp_path, "slurm: {partition: gpu, cpus_per_task: 16, time: '2:00:00'}\n"), GPU)
    assert (gpus.gpus_per_node, gpus.cpus_per_task, gpus.time) == (2, 16, "2:00:00")  # auto: the fewest any node has
    cpu = allocation_for(job(tmp_path, resources="{nodes: 2, device: cpu, cpu_workers: auto}"), GPU)
    assert (cpu.gpus_per_node, cpu.cpus_per_task) == (0, 16)


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ("{nodes: 3, cpu_workers: 2}", "resources.nodes: 3 node(s) requested, but partition debug has 2 nodes with 8 CPUs and no GPUs"),
        ("{nodes: 2, gpus_per_node: 1}", "resources.gpus_per_node: 1 GPU(s) per node on 2 node(s) requested, but partition debug has"),
        ("{nodes: 2, device: cuda}", "resources.device: 'cuda' requested but partition debug has 2 nodes with 8 CPUs and no GPUs"),
        ("{nodes: 2, cpu_workers: 9}", "resources.cpu_workers (one CPU per rank): 9 CPU(s) per node on 2 node(s) requested"),
    ],
)
def test_a_request_the_partition_can_never_hold_is_refused(tmp_path, resources, message):
    with pytest.raises(PlanError) as info:
        allocation_for(job(tmp_path, resources=resources), DEBUG)
    assert message in str(info.value) and str(info.value).endswith("nothing was submitted")


def test_the_gpu_partition_says_what_it_has(tmp_path):
    with pytest.raises(PlanError) as info:
        allocation_for(job(tmp_path, resources="{nodes: 3, gpus_per_node: 4}"), GPU)
    assert "partition gpu has 2 nodes with 32 CPUs and 4 GPUs, 1 node with 16 CPUs and 2 GPUs" in str(info.value)


def test_ranks_sharing_a_gpu_ask_slurm_for_the_gpus_and_a_cpu_per_rank(tmp_path):
    """resources.ranks_per_gpu: k ranks on each GPU: Slurm is asked for the GPUs (not the ranks)
    per node, and one CPU per rank (GPUs x k), partition known or not; the dry run says so."""
    shared = "{nodes: 2, gpus_per_node: 2, ranks_per_gpu: 4}"
    known = allocation_for(job(tmp_path, "slurm: {partition: gpu}\n", resources=shared), GPU)
    assert (known.partition, known.nodes, known.gpus_per_node, known.cpus_per_task, known.ranks_per_gpu) == ("gpu", 2, 2, 8, 4)
    assert known.describe().startswith("2 node(s) x 8 CPU(s), 2 GPU(s) shared by 4 ranks each (8 ranks per node) in partition gpu")
    unknown = allocation_for(job(tmp_path, resources=shared), None)
    assert (unknown.partition, unknown.nodes, unknown.gpus_per_node, unknown.cpus_per_task, unknown.ranks_per_gpu) == (None, 2, 2, 8, 4)
    assert "2 GPU(s) shared by 4 ranks each (8 ranks per node) in the default partition" in unknown.describe()
    auto = allocation_for(job(tmp_path, resources="{nodes: 2, gpus_per_node: auto, ranks_per_gpu: 3}"), GPU)
    assert (auto.gpus_per_node, auto.cpus_per_task) == (2, 6)  # the fewest GPUs any node has, 3 ranks on each
    cuda = allocation_for(job(tmp_path, resources="{nodes: 1, device: cuda, ranks_per_gpu: 2}"), None)
    assert (cuda.gpus_per_node, cuda.cpus_per_task) == (1, 2)  # one GPU where unknown, two ranks on it
    pinned = allocation_for(job(tmp_path, "slurm: {cpus_per_task: 3}\n", resources=shared), GPU)
    assert (pinned.gpus_per_node, pinned.cpus_per_task) == (2, 3)  # slurm.cpus_per_task wins
    cpu = allocation_for(job(tmp_path, resources="{nodes: 2, device: cpu, cpu_workers: 2, ranks_per_gpu: 4}"), DEBUG)
    assert (cpu.gpus_per_node, cpu.cpus_per_task, cpu.ranks_per_gpu) == (0, 2, 1) and "shared" not in cpu.describe()  # ignored on the CPU
    script = sbatch_script(job(tmp_path, resources=shared), known, Path("/r"), python="p", cwd=Path("/"))
    assert "#SBATCH --cpus-per-task=8\n#SBATCH --gpus-per-node=2\n" in script
    with pytest.raises(PlanError) as info:  # 3 nodes have 2 GPUs or more, only g1 and g2 have 20 CPUs
        allocation_for(job(tmp_path, resources="{nodes: 3, gpus_per_node: 2, ranks_per_gpu: 10}"), GPU)
    assert "resources.ranks_per_gpu: 10 ranks on each of 2 GPU(s), one CPU per rank: 20 CPU(s) per node on 3 node(s) requested" in str(info.value)
    with pytest.raises(PlanError) as info:
        allocation_for(job(tmp_path, resources="{nodes: 2, gpus_per_node: 4, ranks_per_gpu: 16}"), GPU)
    assert "64 CPU(s) per node on 2 node(s) requested, but partition gpu has 2 nodes with 32 CPUs and 4 GPUs" in str(info.value)


def test_the_sbatch_script(tmp_path):
    loaded = job(tmp_path, "slurm: {partition: gpu, account: proj, qos: high, constraint: a100&ib, extra_sbatch: [--mem=64G, --exclusive]}\n")
    alloc = allocation_for(loaded, GPU)
    script = sbatch_script(loaded, alloc, Path("/shared/runs/tiny/r1"), python="/opt/venv/bin/python", cwd=Path("/shared/proj"))
    lines = script.splitlines()
    sbatch = [ln for ln in lines if ln.startswith("#SBATCH ")]
    assert sbatch == [
        "#SBATCH --job-name=tiny-r1", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=2",
        "#SBATCH --gpus-per-node=2", "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --qos=high",
        "#SBATCH --time=0:14:00", "#SBATCH --constraint=a100&ib", "#SBATCH --output=/shared/runs/tiny/r1/slurm-%j.out",
        "#SBATCH --chdir=/shared/proj", "#SBATCH --export=ALL", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@90",
        "#SBATCH --open-mode=append", "#SBATCH --mem=64G", "#SBATCH --exclusive",
    ]  # fmt: skip
    started = [ln for ln in lines if "/opt/venv/bin/python -m launcher.control.submitted slurm /shared/runs/tiny/r1 ) &" in ln]
    assert lines[0] == "#!/bin/bash" and len(started) == 1 and started[0].startswith("( trap - TERM; trap '' USR2 USR1; exec ")
    assert lines.index("export GPULAUNCH_SLURM_INSIDE=1") < lines.index(started[0]) and lines[-1] == 'exit "$code"'
    # the shell's traps are set before the launcher starts: a stop or a warning as it starts is not lost
    assert max(i for i, ln in enumerate(lines) if ln.startswith("trap '")) < lines.index(started[0])
    # a one-minute grace: the warning 90 s before the time limit (Slurm may send it a minute sooner)
    graced = job(tmp_path, "preemption: {grace_s: 59.5}\nslurm: {time: '0:10:00'}\n")
    assert "#SBATCH --signal=B:USR1@90\n" in sbatch_script(graced, allocation_for(graced, DEBUG), Path("/r"), python="p", cwd=Path("/"))


def test_the_slurm_job_is_named_after_the_run_it_runs(tmp_path):
    """One id for the run: the run directory <job>/<run id>, the Slurm job <job>-<run id>."""
    from launcher.records import new_run_id

    loaded = job(tmp_path)
    run_id = new_run_id()
    run_dir = tmp_path / "runs" / "tiny" / run_id
    script = sbatch_script(loaded, allocation_for(loaded, DEBUG), run_dir, python="p", cwd=tmp_path)
    assert [ln for ln in script.splitlines() if ln.startswith("#SBATCH --job-name=")] == [f"#SBATCH --job-name=tiny-{run_id}"]
    assert slurm_script.job_name("tiny", run_dir) == f"tiny-{run_id}"


def test_a_time_limit_within_the_warnings_reach_is_refused(tmp_path):
    """A time limit the warning (grace + 30 s, up to 60 s sooner) would reach at the start would
    have the job warned, stopped and requeued as soon as it starts."""
    for limit, grace, refused in (("2", 60, True), ("2:31", 60, False), ("0:02:30", 60, True), ("1", 1, True), ("2", 1, False)):
        loaded = job(tmp_path, f"preemption: {{grace_s: {grace}}}\nslurm: {{time: '{limit}'}}\n")
        if refused:
            with pytest.raises(PlanError) as info:
                allocation_for(loaded, None)
            assert f"slurm.time: {limit} leaves no time to run" in str(info.value) and str(info.value).endswith("nothing was submitted")
        else:
            assert allocation_for(loaded, DEBUG).time == limit
    assert [commands.limit_seconds(t) for t in ("90", "2:30", "1:02:03", "1-2", "1-0:30", "1-0:0:5", "INFINITE")] == [
        5400, 150, 3723, 93_600, 88_200, 86_405, None,
    ]


# A stand-in for the launcher inside: says it is ready, then exits as MODE says; "stop" stops the
# run on SIGTERM (exit 130, as the launcher does once its result is written), "save" too but with
# its progress saved (EXIT_RESUMABLE), and each notes every SIGTERM it gets; "bare" has no handler
# (a stop before the launcher set its own: it dies of it).
FAKE_LAUNCHER = """\
import os, signal, sys, time
mode, notes = sys.argv[1], sys.argv[2]
def note(what):
    with open(notes, "a") as f:
        f.write(what + "\\n")
def on_term(signum, frame):
    note("TERM")
    time.sleep(0.3)  # stopping its steps, writing its result: a second signal would come now
    sys.exit(75 if mode == "save" else 130)
if mode != "bare":
    signal.signal(signal.SIGTERM, on_term)
with open(notes + ".pid", "w") as f:
    f.write(str(os.getpid()))
note("ready")
if mode in ("0", "1"):
    sys.exit(int(mode))
time.sleep(30)
sys.exit(3)
"""

CANCELLED, REQUEUED = "scancel --quiet 4242", "scontrol requeue 4242"


def _start_batch_shell(tmp_path: Path, body: list[str]) -> subprocess.Popen:
    """The batch script's ``body`` run by bash as Slurm would, with stand-in ``scancel`` and
    ``scontrol`` that write what they were asked into ``tmp_path/asked``."""
    (tmp_path / "bin").mkdir()
    for command in ("scancel", "scontrol"):
        (tmp_path / "bin" / command).write_text(f'#!/bin/sh\necho "{command} $*" >> {tmp_path / "asked"}\n')
        (tmp_path / "bin" / command).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text("\n".join(["#!/bin/bash", *body]) + "\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    return subprocess.Popen(["bash", str(script)], env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)


def _napping(shell: int) -> bool:
    """The batch shell sleeps, waiting for Slurm's end (its ``trap - TERM`` is behind it then)."""
    try:
        return any(child.name() == "sleep" for child in psutil.Process(shell).children())
    except psutil.NoSuchProcess:
        return False


def _wait_ready(notes: Path, timeout_s: float = 60) -> None:
    """Until the stand-in launcher has written "ready" (its handlers are set)."""
    deadline = time.monotonic() + timeout_s
    while "ready" not in (notes.read_text() if notes.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize(
    "mode, signals, code, asked",
    [
        ("0", "", 0, []),  # finished: COMPLETED
        ("1", "", 1, []),  # failed: FAILED
        ("stop", "USR2 USR2", 130, [CANCELLED]),  # launch stops it (twice: Ctrl-C, then launch stop): one SIGTERM
        ("save", "USR2", 130, [CANCELLED]),  # stopped with its progress saved: cancelled all the same
        # Slurm's own SIGTERM (time limit, scancel, scontrol requeue, preemption): the launcher's,
        # not handed on, and the job's end is Slurm's: never cancelled (a requeued job would be) nor requeued
        ("stop", "TERM", 130, []),
        ("save", "TERM", 130, []),
        ("bare", "USR2", 143, [CANCELLED]),  # stopped before the launcher set its handler: cancelled all the same
        ("save", "USR1", 130, [REQUEUED]),  # Slurm's warning, progress saved: requeued, to resume
        ("save", "USR1 USR2", 130, [CANCELLED]),  # a stop during the warning's grace wins: cancelled
        ("save", "USR1 USR1", 130, [REQUEUED]),  # the warning again: one SIGTERM, one requeue
        ("stop", "USR1", 130, [CANCELLED]),  # warned, nothing saved: not requeued; Slurm's end did not come: cancelled
        ("stop", "USR1 wait TERM", -signal.SIGTERM, []),  # ... Slurm's end came (the time limit): the shell goes with it
    ],
)
def test_the_batch_script_ends_the_job_as_the_launcher_inside_did(tmp_path, monkeypatch, mode, signals, code, asked):
    """The batch script's body, run by bash with a stand-in launcher, scancel and scontrol: a
    stopped run (SIGUSR2 to the shell, from launch) has its launcher get one SIGTERM and, once it
    exits 130, the job cancelled from inside (Slurm then records CANCELLED); Slurm's warning
    (SIGUSR1 to the shell) has it get one SIGTERM and, once it exits with its progress saved,
    the job requeued; a warned run that saved nothing waits for Slurm's own end (here it never
    comes: cancelled after the warning's lead); Slurm's SIGTERM to the whole batch step reaches
    the launcher once, the shell stays; 0 and 1 are passed on alone."""
    monkeypatch.setattr(slurm_script, "SIGNAL_EARLY_S", 0)  # the wait for Slurm's end: warn_s alone
    # Slurm's end comes within the warning's lead where the case says so ("wait TERM"): a lead of
    # 60 s then, so that it comes first however late a loaded machine sends it; else 1 s
    warn_s = 60 if "wait" in signals.split() else 1
    (tmp_path / "launcher.py").write_text(FAKE_LAUNCHER)
    notes = tmp_path / "notes"
    shell = _start_batch_shell(tmp_path, batch_body([sys.executable, str(tmp_path / "launcher.py"), mode, str(notes)], warn_s))
    try:
        _wait_ready(notes)
        launcher = int((tmp_path / "notes.pid").read_text())
        for name in signals.split():
            if name == "wait":  # until the launcher has ended and the shell waits for Slurm's end (its nap)
                assert poll(lambda: _napping(shell.pid), 60.0, 0.02), "the shell never began to wait for Slurm's end"  # a hang guard
                continue
            sig = getattr(signal, f"SIG{name}")
            os.kill(shell.pid, sig)
            if name == "TERM" and psutil.pid_exists(launcher):  # Slurm signals every process of the batch step
                os.kill(launcher, sig)
            time.sleep(0.05)
        assert shell.wait(60) == code  # 60 s: a hang guard
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)  # a nap the shell left (it holds the shell's stdout open)
        said = shell.stdout.read() if shell.stdout else ""
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    assert notes.read_text().split() == ["ready", *(["TERM"] if mode in ("stop", "save") and signals else [])]
    done = tmp_path / "asked"
    assert (done.read_text().splitlines() if done.exists() else []) == asked
    if "USR1" in signals:
        assert f"gpulaunch: SIGUSR1 from Slurm (time limit in {warn_s} s, or preemption)" in said, said
    if asked == [REQUEUED]:
        assert "gpulaunch: Slurm job 4242 requeued: the next allocation resumes the run" in said, said
    elif mode == "stop" and signals == "USR1":
        assert "saved no progress since this allocation began: not requeued" in said, said


@pytest.mark.parametrize(
    ("sig", "asked", "said"), [("USR1", [REQUEUED], "gpulaunch: SIGUSR1 from Slurm"), ("USR2", [CANCELLED], ""), ("TERM", [], "")]
)
def test_a_signal_while_the_launcher_starts_is_not_lost(tmp_path, sig, asked, said):
    """Slurm's warning or launch's stop that comes just as the launcher inside starts, before the
    shell has run its next line (on a busy node that line may run much later): the shell is held
    there on purpose, between starting the launcher and knowing its pid, until the signal has
    come. It is handed on all the same: the launcher gets one SIGTERM, and the job is requeued or
    cancelled as it would be at any other time (a shell that ignored it there waited on); Slurm's
    own SIGTERM to the whole batch step ends the launcher, and the shell stays to report."""
    launcher_py, notes, signalled = tmp_path / "launcher.py", tmp_path / "notes", tmp_path / "signalled"
    launcher_py.write_text(FAKE_LAUNCHER)
    body = batch_body([sys.executable, str(launcher_py), "save", str(notes)], 1)
    started = next(i for i, ln in enumerate(body) if str(launcher_py) in ln)
    body.insert(started + 1, f"until [ -e {signalled} ]; do sleep 0.02; done  # the window, held open")
    shell = _start_batch_shell(tmp_path, body)
    try:
        _wait_ready(notes)
        os.kill(shell.pid, getattr(signal, f"SIG{sig}"))
        if sig == "TERM":  # Slurm signals every process of the batch step
            os.kill(int((tmp_path / "notes.pid").read_text()), signal.SIGTERM)
        time.sleep(0.1)
        signalled.touch()
        assert shell.wait(20) == 130
        out = shell.stdout.read() if shell.stdout else ""
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    assert notes.read_text().split() == ["ready", "TERM"]
    assert ((tmp_path / "asked").read_text().splitlines() if (tmp_path / "asked").exists() else []) == asked
    assert said in out, out


def test_a_requeue_that_fails_cancels_the_job(tmp_path):
    """A job Slurm will not requeue (an extra --no-requeue, a site's policy): cancelled, not FAILED."""
    (tmp_path / "launcher.py").write_text(FAKE_LAUNCHER)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\necho 'scontrol: error: Requested operation is presently disabled' >&2\nexit 1\n")
    (tmp_path / "bin" / "scancel").write_text(f'#!/bin/sh\necho "scancel $*" >> {tmp_path / "asked"}\n')
    for command in ("scontrol", "scancel"):
        (tmp_path / "bin" / command).chmod(0o755)
    notes = tmp_path / "notes"
    script = tmp_path / "job.sbatch"
    script.write_text("\n".join(["#!/bin/bash", *batch_body([sys.executable, str(tmp_path / "launcher.py"), "save", str(notes)], 1)]) + "\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    shell = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while "ready" not in (notes.read_text() if notes.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(shell.pid, signal.SIGUSR1)
        assert shell.wait(20) == 130
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    assert (tmp_path / "asked").read_text() == "scancel --quiet 4242\n"
    assert "could not be requeued: cancelled" in (shell.stdout.read() if shell.stdout else "")


def _result(*stages: tuple[str, list[tuple[int | None, int | None]]], status: str = "interrupted") -> dict:
    """A result.json's shape: each stage's status and its attempts' (resumed_step, checkpoint_step)."""
    return {"status": status, "stages": [{"status": st, "attempts": [{"resumed_step": r, "checkpoint_step": c} for r, c in attempts]}
                                         for st, attempts in stages]}  # fmt: skip


def test_a_warned_run_is_requeued_only_with_progress_saved_in_this_allocation():
    """Requeued, a run continues from where this allocation left it; one that saved nothing new
    would start the same work over, allocation after allocation: it is not requeued."""
    assert saved_progress(None, _result(("interrupted", [(None, 8)])))  # a fresh run's first checkpoint
    assert not saved_progress(None, _result(("interrupted", [(None, None)])))  # stopped before its first
    assert saved_progress(_result(("interrupted", [(None, 8)])), _result(("interrupted", [(8, 12)])))
    assert not saved_progress(_result(("interrupted", [(None, 8)])), _result(("interrupted", [(8, 8)])))  # warned as it resumed
    assert saved_progress(_result(("interrupted", [(None, 8)])), _result(("interrupted", [(8, 9), (9, 16)])))  # a restart in between
    two = _result(("succeeded", [(None, 24)]), ("interrupted", [(None, None)]))
    assert saved_progress(None, two) and not saved_progress(two, two)  # a stage done in this allocation counts
    assert not saved_progress(None, _result(("succeeded", [(None, 24)]), status="succeeded"))  # finished: nothing to requeue
    assert not saved_progress(None, _result(("failed", [(None, 8)]), status="failed"))
    assert [restart_count(env) for env in ({}, {"SLURM_RESTART_COUNT": "0"}, {"SLURM_RESTART_COUNT": "2"}, {"SLURM_RESTART_COUNT": "x"})] == [0, 0, 2, 0]


class _Told(RunEvents):
    def __init__(self) -> None:
        self.said: list[str] = []

    def message(self, text: str) -> None:
        self.said.append(text)


def test_the_submitter_follows_a_requeued_job_to_its_next_allocation(tmp_path, monkeypatch):
    """squeue and scontrol played back: running, its launcher's 'finished' (interrupted) line,
    COMPLETING with one more restart: requeued, not ended; pending, running again, and only the
    next allocation's end ends the follow. The output file truncated by a requeue is read anew."""
    loaded = job(tmp_path)
    states = iter(["RUNNING", "RUNNING", "COMPLETING", "PENDING", "RUNNING", "COMPLETED"])
    restarts = {"n": 0}
    monkeypatch.setattr(commands, "squeue_state", lambda job_id: commands.JobState(job_id, next(states), "", "n[1-2]", "n1"))
    monkeypatch.setattr(commands, "job_record", lambda job_id: {"Restarts": str(restarts["n"])})
    told = _Told()
    run = SlurmRun(loaded, "7", tmp_path, told, pending_after_s=loaded.spec.timeouts.rendezvous_s)
    reader = WireReader(told, "slurm")
    assert run.ended(reader) is None and told.said == ["Slurm job 7 is running on n[1-2] (batch host n1)"]
    reader.feed_line('@gpulaunch {"event":"finished","job":"tiny","status":"interrupted"}')
    assert run.ended(reader) is None and reader.finished == "interrupted"  # still running, not requeued (yet)
    restarts["n"] = 1  # scontrol requeue: Slurm counts a restart at once
    run._ask_after = 0.0
    assert run.ended(reader) is None and reader.finished is None and run.restarts == 1 and run.rerun_since is None
    assert told.said[-1].startswith("Slurm job 7 was requeued (restart 1): when it runs again, the launcher there resumes the run")
    assert run.ended(reader) is None  # pending: already told
    assert run.ended(reader) is None and told.said[-1] == "Slurm job 7 is running on n[1-2] (batch host n1)"
    assert run.rerun_since is not None and run.rerun_since <= time.time()  # older results are the last allocation's
    assert run.ended(reader) == "COMPLETED" and run.restarts == 1 and len(told.said) == 3

    out = tmp_path / "slurm-7.out"
    out.write_text("first allocation\nsecond line\n")
    tail = OutputTail(out)
    assert tail.lines() == ["first allocation", "second line"]
    out.write_text("again\n")  # --open-mode=truncate: the requeued job's output starts over
    assert tail.lines() == ["again"]


def test_the_slurm_section_is_checked_with_file_and_line(tmp_path):
    extra = """\
    slurm:
      partition: "a b"
      time: 2h
      extra_sbatch: [--mem=1G, "-N 2", --nodes=4, "--output=x", "--signal=B:USR1@60", --no-requeue]
      acount: me
    """
    with pytest.raises(SpecError) as info:
        job(tmp_path, extra)
    path = tmp_path / "job.yaml"
    assert info.value.problems == [
        f"{path}:7: slurm.partition: expected one word (no blanks, quotes or backslashes) (got 'a b')",
        f"{path}:8: slurm.time: expected a Slurm time limit: MINUTES, HH:MM:SS, D-HH or D-HH:MM:SS (got '2h')",
        f"{path}:9: slurm.extra_sbatch.1: expected one long sbatch option, e.g. --mem=64G (got '-N 2')",
        f"{path}:9: slurm.extra_sbatch.2: --nodes is written by the launcher (set resources.nodes instead) (got '--nodes=4')",
        f"{path}:9: slurm.extra_sbatch.3: --output is written by the launcher (not an option here) (got '--output=x')",
        f"{path}:9: slurm.extra_sbatch.4: --signal is written by the launcher (set preemption.grace_s instead) (got '--signal=B:USR1@60')",
        f"{path}:9: slurm.extra_sbatch.5: --no-requeue is written by the launcher (not an option here) (got '--no-requeue')",
        f"{path}:10: slurm.acount: unknown key, did you mean 'account'?",
    ]


def test_a_job_that_ended_without_a_result_is_explained(tmp_path):
    out = tmp_path / "slurm-7.out"
    out.write_text("error: /x/job.yaml: resources.device: 'cuda' requested but n1 has no visible GPU\n")
    state = commands.JobState("7", "FAILED", "NonZeroExitCode", "n[1-2]", "n1", "2:0")
    reason, summary = explain_end("7", state, None, out)
    assert reason == FailureReason.FAILED and summary.endswith("without the launcher inside writing a result: error: /x/job.yaml: resources.device: 'cuda' requested but n1 has no visible GPU")
    assert explain_end("7", state, "SIGINT", tmp_path / "none.out")[1] == "interrupted (SIGINT; Slurm job 7 cancelled before it ran)"
    timeout = commands.JobState("7", "TIMEOUT", "TimeLimit", "n1", "n1", "0:15")
    assert explain_end("7", timeout, None, out)[0] == FailureReason.TIMEOUT
    assert commands.restarts_of({"Restarts": "2"}) == 2 and commands.restarts_of({}) is None


def test_a_job_whose_batch_script_died_with_its_node_names_the_node(tmp_path, monkeypatch):
    """A batch script killed with its node (exit code 0:9) is reported ended a moment before the
    node goes: the job ends FAILED, not NODE_FAIL. Slurm has the batch host down by the time it
    has ended: the node is named, not "ended FAILED without a result"; a script that ended by
    itself (2:0), or killed on a node that is up, is explained as before."""
    monkeypatch.setattr(commands, "hostnames", lambda nodelist: nodelist.split(","))
    states = {"n1": "DOWN+NOT_RESPONDING"}
    monkeypatch.setattr(commands, "node_records", lambda names: {n: {"NodeName": n, "State": states.get(n, "IDLE"), "Reason": "Not responding"} for n in names})
    out = tmp_path / "slurm-3.out"
    killed = commands.JobState("3", "FAILED", "", "n[1-2]", "n1", "0:9")
    reason, summary = explain_end("3", killed, None, out)
    assert (reason, summary) == (FailureReason.FAILED, "lost node n1 (DOWN+NOT_RESPONDING, Not responding), the job's batch host: the launcher inside went with it (Slurm job 3 ended FAILED, exit code 0:9)")
    assert explain_end("3", commands.JobState("3", "FAILED", "", "n[1-2]", "n1", "2:0"), None, out)[1].startswith("Slurm job 3 ended FAILED (exit code 2:0) without")
    states.clear()
    assert explain_end("3", killed, None, out)[1].startswith("Slurm job 3 ended FAILED (exit code 0:9) without the launcher inside writing a result")
    # found lost by the launch outside: cancelled by it, or ended by Slurm before it could
    assert explain_end("3", commands.JobState("3", "CANCELLED"), None, out, lost="n1 (gone)")[1].endswith("went with it (Slurm job 3 cancelled)")
    assert explain_end("3", killed, None, out, lost="n1 (gone)")[1].endswith("went with it (Slurm job 3 ended FAILED, exit code 0:9)")


def test_an_earlier_allocations_result_is_not_the_requeued_jobs(tmp_path):
    """A requeued job whose last allocation wrote no result (its batch host lost) is explained
    from Slurm's state, not by the interrupted result the allocation before it left."""
    from launcher.backends.slurm.outcome import settle
    from launcher.results.store import write_result

    earlier = {"job": "tiny", "run_id": tmp_path.name, "status": "interrupted", "finished_at": 100.0, "stages": [], "ranks": []}
    write_result(tmp_path, earlier)
    failed = commands.JobState("7", "NODE_FAIL", "", "n[1-2]", "n1", "0:0", 1)
    kept = settle(tmp_path, "7", failed, written_after=50.0)  # written after the job ran again: the last allocation's
    assert kept["status"] == "interrupted" and kept["slurm"]["restarts"] == 1
    rebuilt = settle(tmp_path, "7", failed, written_after=200.0)
    assert rebuilt["status"] == "failed" and rebuilt["failure"]["summary"].startswith("Slurm job 7 ended NODE_FAIL"), rebuilt["failure"]
    # requeued, then stopped in the queue: interrupted, whatever the allocation before it wrote
    write_result(tmp_path, {**earlier, "status": "failed", "failure": {"reason": "failed", "summary": "rank 1 lost"}})
    cancelled = commands.JobState("7", "CANCELLED", "", "", "", "0:0", 1)
    stopped = settle(tmp_path, "7", cancelled, "SIGINT", requeued=True)
    assert (stopped["status"], stopped["failure"]["reason"]) == ("interrupted", "interrupted") and stopped["stages"] == []
    assert stopped["failure"]["summary"] == "interrupted (SIGINT; Slurm job 7 cancelled while requeued, before it ran again)"


def test_the_time_limit_counts_every_stage_auto_scaling_makes(tmp_path):
    """``scaling.workers: auto`` over 2 nodes of 4 ranks each runs worlds 2, 4 and 8: three stages'
    timeouts, as the same list written out; no scaling: one stage."""
    auto = allocation_for(job(tmp_path, "scaling: {workers: auto}\n", resources="{nodes: 2, cpu_workers: 4}"), DEBUG)
    listed = allocation_for(job(tmp_path, "scaling: {workers: [2, 4, 8]}\n", resources="{nodes: 2, cpu_workers: 4}"), DEBUG)
    single = allocation_for(job(tmp_path, resources="{nodes: 2, cpu_workers: 4}"), DEBUG)
    assert auto.time == listed.time != single.time
    assert commands.limit_seconds(auto.time) - commands.limit_seconds(single.time) == 2 * (60 + 600)
