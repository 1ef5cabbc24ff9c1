"""The Slurm backend's pure parts, without a cluster: parsing Slurm's output, the allocation a spec
asks for (and the refusal of one no partition can hold), the sbatch script (its body run by bash
with a stand-in launcher and scancel), the ``slurm:`` section's checks, and why a job that ended
without a result ended (the lines the launcher inside a job writes for the one outside are the
remote-run wire's: tests/unit/test_wire.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher.backends.slurm import commands
from launcher.backends.slurm.commands import Partition, SlurmNode
from launcher.backends.slurm.script import allocation_for, batch_body, sbatch_script
from launcher.backends.slurm.outcome import explain_end
from launcher.errors import PlanError, SpecError
from launcher.records import FailureReason
from launcher.spec.model import load_job


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
    assert (alloc.nodes, alloc.gpus_per_node, alloc.cpus_per_task, alloc.time) == (2, 0, 2, "0:23:00")  # 2 x (60 + 600) + 60 s
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


def test_the_sbatch_script(tmp_path):
    loaded = job(tmp_path, "slurm: {partition: gpu, account: proj, qos: high, constraint: a100&ib, extra_sbatch: [--mem=64G, --exclusive]}\n")
    alloc = allocation_for(loaded, GPU)
    script = sbatch_script(loaded, alloc, Path("/shared/runs/tiny/r1"), python="/opt/venv/bin/python", cwd=Path("/shared/proj"))
    lines = script.splitlines()
    sbatch = [ln for ln in lines if ln.startswith("#SBATCH ")]
    assert sbatch == [
        "#SBATCH --job-name=tiny", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=2",
        "#SBATCH --gpus-per-node=2", "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --qos=high",
        "#SBATCH --time=0:12:00", "#SBATCH --constraint=a100&ib", "#SBATCH --output=/shared/runs/tiny/r1/slurm-%j.out",
        "#SBATCH --chdir=/shared/proj", "#SBATCH --export=ALL", "#SBATCH --no-requeue", "#SBATCH --mem=64G", "#SBATCH --exclusive",
    ]  # fmt: skip
    assert lines[0] == "#!/bin/bash" and "/opt/venv/bin/python -m launcher.control.submitted slurm /shared/runs/tiny/r1 &" in lines
    assert lines.index("export GPULAUNCH_SLURM_INSIDE=1") < lines.index("trap '' USR2") and lines[-1] == 'exit "$code"'


# A stand-in for the launcher inside: says it is ready, then exits as MODE says; "stop" stops the
# run on SIGTERM (exit 130, as the launcher does once its result is written) and notes each
# SIGTERM it gets; "bare" has no handler (a stop before the launcher set its own: it dies of it).
FAKE_LAUNCHER = """\
import os, signal, sys, time
mode, notes = sys.argv[1], sys.argv[2]
def note(what):
    with open(notes, "a") as f:
        f.write(what + "\\n")
def on_term(signum, frame):
    note("TERM")
    time.sleep(0.3)  # stopping its steps, writing its result: a second signal would come now
    sys.exit(130)
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


@pytest.mark.parametrize(
    "mode, signals, code, cancelled",
    [
        ("0", "", 0, False),  # finished: COMPLETED
        ("1", "", 1, False),  # failed: FAILED
        ("stop", "USR2 USR2", 130, True),  # launch stops it (twice: Ctrl-C, then launch stop): one SIGTERM
        ("stop", "TERM", 130, True),  # Slurm's own SIGTERM (time limit, scancel): the launcher's, not handed on
        ("bare", "USR2", 143, True),  # stopped before the launcher set its handler: cancelled all the same
    ],
)
def test_the_batch_script_ends_the_job_as_the_launcher_inside_did(tmp_path, mode, signals, code, cancelled):
    """The batch script's body, run by bash with a stand-in launcher and a stand-in scancel: a
    stopped run (SIGUSR2 to the shell, from launch) has its launcher get one SIGTERM and, once it
    exits 130, the job cancelled from inside (Slurm then records CANCELLED); Slurm's SIGTERM to
    the whole batch step reaches the launcher once, the shell stays; 0 and 1 are passed on alone."""
    (tmp_path / "launcher.py").write_text(FAKE_LAUNCHER)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "scancel").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "scancel.args"}\n')
    (tmp_path / "bin" / "scancel").chmod(0o755)
    notes = tmp_path / "notes"
    script = tmp_path / "job.sbatch"
    script.write_text("\n".join(["#!/bin/bash", *batch_body([sys.executable, str(tmp_path / "launcher.py"), mode, str(notes)])]) + "\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    shell = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while "ready" not in (notes.read_text() if notes.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.02)
        launcher = int((tmp_path / "notes.pid").read_text())
        for name in signals.split():
            sig = getattr(signal, f"SIG{name}")
            os.kill(shell.pid, sig)
            if name == "TERM":  # Slurm signals every process of the batch step
                os.kill(launcher, sig)
            time.sleep(0.05)
        assert shell.wait(20) == code
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    assert notes.read_text().split() == ["ready", *(["TERM"] if mode == "stop" else [])]
    asked = tmp_path / "scancel.args"
    assert (asked.read_text() if asked.exists() else None) == ("--quiet 4242\n" if cancelled else None)


def test_the_slurm_section_is_checked_with_file_and_line(tmp_path):
    extra = """\
    slurm:
      partition: "a b"
      time: 2h
      extra_sbatch: [--mem=1G, "-N 2", --nodes=4, "--output=x"]
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
