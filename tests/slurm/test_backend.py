"""Issue 18: the same spec on a real Slurm cluster (the rig: slurmctld and two slurmd "nodes" in
network namespaces), run through ``launch`` as a user runs it: 1 and 2 nodes, scaling stages in
one allocation, a failing rank, a lost node (its slurmd and everything on it killed), Ctrl-C and
``launch stop`` (the job CANCELLED in Slurm's own record, as a finished one is COMPLETED and a
failed one FAILED, never requeued, though the script asks for ``--requeue``), ``--detach`` with ``launch status|logs|stop``, a job left pending, requests the
partition can never hold, the dry run, and a GPU (GRES) request.

Every ``launch`` a test starts is ended by pid, every job it submitted is cancelled by id, and
each test checks that no step, rank or agent is left on any node."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.procutil import cmdline
from tests.conftest import REPO
from tests.netns import netns_pids
from tests.slurm.slurmrig import SlurmRig, alive

pytestmark = pytest.mark.slow

ENTRY = "tests.integration.faulty:run"


def write_spec(tmp_path: Path, name: str, **fields: Any) -> Path:
    spec: dict[str, Any] = {
        "name": name,
        "entrypoint": ENTRY,
        "params": {"fault": "none"},
        "backend": "slurm",
        "resources": {"nodes": 2, "cpu_workers": 1},
        "env": {"PYTHONPATH": str(REPO)},
        "timeouts": {"rendezvous_s": 60, "run_s": 300},
    }
    for key, value in fields.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and isinstance(spec.get(key), dict) else value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class Launch:
    """``python -m launcher ARGS`` against a rig, in the background; its output in a file."""

    def __init__(self, rig: SlurmRig, out: Path, *args: str) -> None:
        self.rig, self.out = rig, out
        self.log_path = out.parent / f"{out.name}-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w+b")  # noqa: SIM115 - closed in close()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", *args, "--out", str(out)],
            cwd=REPO, env=cli_env(rig), stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait(self, timeout_s: float = 180) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launch still running after {timeout_s}s:\n{self.output()}") from None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def run_dir(self, timeout_s: float = 60) -> Path:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [p.parent for p in self.out.glob("*/*/slurm.json")]
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"no run directory under {self.out}:\n{self.output()}")

    def job_id(self) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            record = json.loads((self.run_dir() / "slurm.json").read_text())
            if record.get("job_id"):
                return record["job_id"]
            time.sleep(0.1)
        raise AssertionError(f"no job id:\n{self.output()}")

    def wait_running(self, ranks: int, timeout_s: float = 90) -> Path:
        """Until every rank's beacon says it runs the job's code; the run directory."""
        run_dir = self.run_dir()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beacons = [json.loads(p.read_text()) for p in run_dir.glob("world*/progress/rank*.json") if p.stat().st_size]
            if len(beacons) == ranks and all(b.get("phase") == "running" for b in beacons):
                return run_dir
            if self.proc.poll() not in (None, 0):
                break
            time.sleep(0.1)
        raise AssertionError(f"ranks not running after {timeout_s}s:\n{self.output()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def cli_env(rig: SlurmRig) -> dict[str, str]:
    return {**rig.env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}


def cli(rig: SlurmRig, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], cwd=REPO, env=cli_env(rig), capture_output=True, text=True, timeout=timeout_s
    )


def result_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "result.json").read_text())


def queue(rig: SlurmRig) -> list[str]:
    return rig.run(["squeue", "-h", "-o", "%i %T"], check=True).stdout.split("\n")[:-1]


def slurm_state(rig: SlurmRig, job_id: str) -> str:
    """The job's state in Slurm's own record: ``scontrol show job`` (the rig keeps no accounting,
    so no sacct; the rig's slurmctld remembers an ended job MinJobAge = 300 s)."""
    return rig.job(job_id)["JobState"]


def wait_queue_empty(rig: SlurmRig, timeout_s: float = 120) -> float:
    """Seconds until Slurm's queue is empty; ``timeout_s`` is a hang guard (TimeoutError past it)."""
    t0 = time.monotonic()
    rig.wait_for("an empty queue", lambda: not queue(rig), timeout_s, 0.1)
    return time.monotonic() - t0


@pytest.fixture
def launcher(tmp_path):
    """Start ``launch`` processes against a rig; afterwards every one is ended by pid and every
    job it submitted is cancelled by id."""
    started: list[Launch] = []

    def start(rig: SlurmRig, *args: str, out: Path | None = None) -> Launch:
        run = Launch(rig, out or tmp_path / f"runs{len(started)}", *args)
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()
        for record in run.out.glob("*/*/slurm.json"):
            job_id = json.loads(record.read_text()).get("job_id")
            if job_id:
                run.rig.run(["scancel", job_id])
    for rig in {id(run.rig): run.rig for run in started}.values():
        if not rig.stopped:
            assert rig.wait_clean() == {}, f"left on the nodes:\n{rig.describe(rig.leftovers())}"
            live = [n.name for n in rig.nodes if n.slurmd is not None and n.slurmd.poll() is None]
            rig.wait_idle(live, timeout_s=30)  # the next test on a session rig starts on idle nodes


def test_one_node_and_two_nodes_with_stages_in_one_allocation(slurm_rig: SlurmRig, launcher, tmp_path: Path):
    rig = slurm_rig
    one = launcher(rig, str(write_spec(tmp_path, "one", resources={"nodes": 1, "cpu_workers": 2})))
    assert one.wait() == 0, one.output()
    assert slurm_state(rig, one.job_id()) == "COMPLETED"
    result = result_of(one.run_dir())
    assert (result["backend"], result["status"], result["world_size"]) == ("slurm", "succeeded", 2)
    assert [(r["rank"], r["host"], r["hostname"], r["device"]) for r in result["ranks"]] == [(0, "n1", "n1", "cpu"), (1, "n1", "n1", "cpu")]
    assert re.search(r"^n1:1 faulty: rank 1 ", one.output(), re.MULTILINE), one.output()

    spec = write_spec(tmp_path, "two", resources={"nodes": 2, "cpu_workers": 2}, scaling={"workers": [2, 4]})
    two = launcher(rig, str(spec))
    assert two.wait() == 0, two.output()
    run_dir = two.run_dir()
    result = result_of(run_dir)
    assert result["status"] == "succeeded" and [s["world_size"] for s in result["stages"]] == [2, 4]
    hosts = {s: [(r["rank"], r["hostname"]) for r in result["ranks"] if r["world_size"] == s] for s in (2, 4)}
    assert hosts == {2: [(0, "n1"), (1, "n2")], 4: [(0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")]}  # node by node
    assert result["slurm"]["state"] in ("COMPLETED", "COMPLETING") and result["slurm"]["nodes"] == "n[1-2]"
    for size in (2, 4):
        assert sorted(p.name for p in (run_dir / f"world{size}" / "logs").glob("rank*.log")) == [f"rank{k}.log" for k in range(size)]
    script = (run_dir / "job.sbatch").read_text()
    # one allocation for both stages, sized for the largest (2 ranks per node, one CPU each)
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=2\n" in script
    out = two.output()
    assert re.search(r"^n2:3 faulty: rank 3 ", out, re.MULTILINE) and "world size 4 on cpu (slurm)" in out, out
    assert (run_dir / "slurm-spec.yaml").stat().st_mode & 0o077 == 0  # the unmasked spec: the user's only


def test_a_failing_rank_is_the_root_cause_with_its_host(slurm_rig: SlurmRig, launcher, tmp_path: Path):
    run = launcher(slurm_rig, str(write_spec(tmp_path, "raises", params={"fault": "raise", "rank": 1})))
    assert run.wait() == 1, run.output()
    assert slurm_state(slurm_rig, run.job_id()) == "FAILED"
    failure = result_of(run.run_dir())["failure"]
    assert failure["summary"].startswith("rank 1 on n2 (cpu): ValueError: injected failure on rank 1"), failure
    assert failure["root_cause"]["host"] == "n2" and failure["collateral_ranks"] == [0]
    assert "FAILED: rank 1 on n2" in run.output()


@pytest.mark.parametrize("hang", ["lock", "skip", "sleep", "stop"])
def test_a_hung_rank_on_the_second_node_is_named_from_an_srun_step_there(slurm_rig: SlurmRig, launcher, tmp_path: Path, hang: str):
    """Rank 3, on n2, hangs at step 20 (each of hang_job.py's four ways): the launcher inside
    the allocation sees the stall, gathers n2's evidence with one more step there (srun
    --overlap: py-spy, the ranks' flight recorders) and names the rank, its node and its line;
    the job ends, exit 1."""
    from tests.integration.test_hangs import CASES, line_of

    rig = slurm_rig
    # world 4 (two ranks a node): a skipped collective is told from the majority's
    spec = write_spec(tmp_path, f"hung-{hang}", entrypoint="tests.integration.hang_job:run", params={"hang": hang, "rank": 3, "at": 20},
                      timeouts={"hang_s": 6}, resources={"nodes": 2, "cpu_workers": 2})  # fmt: skip
    run = launcher(rig, str(spec))
    assert run.wait(180) == 1, run.output()
    result = result_of(run.run_dir())
    info = result["failure"]["hang"]
    why, marker = CASES[hang]
    (culprit,) = info["culprits"]
    assert (culprit["rank"], culprit["host"], culprit["line"]) == (3, "n2", line_of(marker)) and why in culprit["why"], info
    print(run.output()[-1200:])
    assert result["status"] == "hung" and "HUNG: rank 3 on n2 (cpu)" in " ".join(run.output().split())
    wait_queue_empty(rig)
    assert rig.wait_clean() == {}, rig.describe(rig.leftovers())


def test_a_lost_node_fails_the_run_naming_it(make_slurm_rig, launcher, tmp_path: Path):
    rig: SlurmRig = make_slurm_rig(slurmd_timeout=5)
    run = launcher(rig, str(write_spec(tmp_path, "lost", params={"fault": "sleep"})))
    run.wait_running(2)
    t0 = time.monotonic()
    rig.kill_node("n2")  # slurmd, slurmstepd, the agent and the rank on n2: gone at once
    assert run.wait(180) == 1, run.output()  # 180 s: a hang guard
    teardown = time.monotonic() - t0
    failure = result_of(run.run_dir())["failure"]
    # the launcher inside noticed the silent node itself (its own NodeLost for rank 1), not Slurm
    # (~3 x SlurmdTimeout: the job would end NODE_FAIL, with the launcher inside gone too)
    assert failure["summary"].startswith("rank 1 on n2 (cpu): NodeLost: lost node n2 ("), failure
    print(f"node n2 lost -> launch exited 1 after {teardown:.1f}s (SlurmdTimeout={rig.slurmd_timeout}s)")
    assert rig.wait_clean().get("n1") is None, "n1's step outlived the run"

    # the batch host lost: the launcher inside goes with it; the launch outside notices its ranks'
    # silence, finds its slurmd gone, cancels the job and names the node
    rig.restart_node("n2")
    rig.wait_idle(timeout_s=120)  # a hang guard
    run = launcher(rig, str(write_spec(tmp_path, "lost-batch-host", params={"fault": "sleep"})))
    run.wait_running(2)
    t0 = time.monotonic()
    rig.kill_node("n1")
    assert_batch_host_named_lost(rig, run, t0, "batch host n1 lost")


def assert_batch_host_named_lost(rig: SlurmRig, run: Launch, t0: float, what: str) -> None:
    """launch exits 1 by its own loss detection, naming n1 lost, and n2's step is gone."""
    assert run.wait(180) == 1, run.output()  # 180 s: a hang guard
    teardown = time.monotonic() - t0
    result = result_of(run.run_dir())
    # named by the launch outside ("lost node n1 (why)"), not by Slurm's NODE_FAIL record
    assert result["failure"]["summary"].startswith("lost node n1 ("), result["failure"]
    print(f"{what} -> launch exited 1 after {teardown:.1f}s: {result['failure']['summary']}")
    assert rig.wait_clean().get("n2") is None, "n2's step outlived the job"


def test_a_batch_host_lost_just_after_its_script_was_reported_ended_is_named(make_slurm_rig, launcher, tmp_path: Path):
    """The lost batch host's worst timing, forced: its batch script is killed and reported ended
    (FAILED, exit code 0:9) by its slurmstepd a moment before the rest of the node goes (the
    node's slurmd and every other process held still meanwhile, so that nothing of it answers or
    cleans up). The job is no longer RUNNING when the node is found gone: the launch outside still
    names the node, not "ended FAILED without the launcher inside writing a result"."""
    rig: SlurmRig = make_slurm_rig(slurmd_timeout=5)
    run = launcher(rig, str(write_spec(tmp_path, "lost-script-first", params={"fault": "sleep"})))
    run.wait_running(2)
    job_id = run.job_id()
    pids = {pid: " ".join(cmdline(pid)) for pid in netns_pids(rig.node("n1").ns) if alive(pid)}
    shells = [pid for pid, cmd in pids.items() if "slurm_script" in cmd]
    stepd = [pid for pid, cmd in pids.items() if cmd.startswith(f"slurmstepd: [{job_id}.batch]")]
    assert len(shells) == 1 and len(stepd) == 1, pids
    for pid in set(pids) - {*shells, *stepd}:  # slurmd, the launcher inside, its steps: held still
        os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    os.kill(shells[0], signal.SIGKILL)
    rig.wait_for("the batch script reported ended", lambda: slurm_state(rig, job_id) != "RUNNING", 20, 0.05)
    rig.kill_node("n1")
    assert_batch_host_named_lost(rig, run, t0, "batch host n1 lost after its script was reported ended")


STOP_ROUNDS = 3  # the bug this guards against (FAILED in Slurm's record) came in 2 of 5 stops on another rig


def test_ctrl_c_and_launch_stop_end_the_job_cancelled_in_slurms_own_record(slurm_rig: SlurmRig, launcher, tmp_path: Path):
    """Running jobs stopped with Ctrl-C (SIGINT to launch) and ``launch stop ID``, several times
    each (two jobs at once, side by side on both nodes): every step is gone, Slurm's own record
    says CANCELLED (not FAILED: the launcher inside exits 130 once its result is written; the
    batch script then cancels the job), and result.json is the launcher inside's, complete: every
    rank stopped on its node, status interrupted."""
    rig = slurm_rig
    took: dict[str, list[float]] = {"Ctrl-C": [], "launch stop": []}
    for i in range(STOP_ROUNDS):
        spec = str(write_spec(tmp_path, f"stopped{i}", params={"fault": "sleep"}))
        runs = {"Ctrl-C": launcher(rig, spec), "launch stop": launcher(rig, spec, "--detach")}
        assert runs["launch stop"].wait(60) == 0, runs["launch stop"].output()
        jobs = {how: (run.wait_running(2), run.job_id()) for how, run in runs.items()}
        assert set(rig.leftovers()) == {"n1", "n2"}
        t0 = time.monotonic()
        runs["Ctrl-C"].proc.send_signal(signal.SIGINT)
        job_id = jobs["launch stop"][1]
        stopped = cli(rig, "stop", job_id)
        took["launch stop"].append(time.monotonic() - t0)
        assert (stopped.returncode, stopped.stdout) == (0, f"{job_id}: CANCELLED\n"), stopped.stdout + stopped.stderr
        assert runs["Ctrl-C"].wait(60) == 130, runs["Ctrl-C"].output()
        took["Ctrl-C"].append(time.monotonic() - t0)
        for how, (run_dir, job_id) in jobs.items():
            assert slurm_state(rig, job_id) == "CANCELLED", (how, i, rig.job(job_id))
            result = result_of(run_dir)
            said = "interrupted (" + ("SIGINT" if how == "Ctrl-C" else f"launch stop {job_id}") + f"; Slurm job {job_id} cancelled)"
            assert (result["status"], result["failure"]["reason"], result["failure"]["summary"]) == ("interrupted", "interrupted", said)
            assert [(r["rank"], r["host"], r["status"]) for r in result["ranks"]] == [(0, "n1", "stopped"), (1, "n2", "stopped")], result["ranks"]
            assert [(s["world_size"], s["status"]) for s in result["stages"]] == [(2, "interrupted")] and result["finished_at"]
            assert (result["slurm"]["job_id"], result["slurm"]["state"]) == (job_id, "CANCELLED")
        wait_queue_empty(rig)
        assert rig.wait_clean() == {}, rig.describe(rig.leftovers())
    for how, times in took.items():
        print(f"{how} -> job CANCELLED, launch done after " + ", ".join(f"{t:.2f}s" for t in times))


def test_detach_status_logs_stop_and_a_job_left_pending(slurm_rig: SlurmRig, launcher, tmp_path: Path):
    rig = slurm_rig
    spec = write_spec(tmp_path, "detached", params={"fault": "sleep"}, resources={"nodes": 2, "cpu_workers": 2})
    detached = launcher(rig, str(spec), "--detach")
    assert detached.wait(60) == 0, detached.output()
    job_id, run_dir = detached.job_id(), detached.run_dir()
    assert f"Slurm job {job_id}: launch status {job_id}" in detached.output() and str(run_dir) in detached.output()
    detached.wait_running(4)
    status = cli(rig, "status", job_id, "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert (info["status"], info["metadata"]["run_dir"]) == ("RUNNING", str(run_dir))
    logs = cli(rig, "logs", job_id)
    assert re.search(r"^n2:3 faulty: rank 3 ", logs.stdout, re.MULTILINE), logs.stdout + logs.stderr

    # the partition is full: a second run pends, is reported pending with Slurm's reason, and stays
    waiting = launcher(rig, str(write_spec(tmp_path, "waiting", timeouts={"rendezvous_s": 1})))
    waiting_id = waiting.job_id()
    rig.wait_for("the pending report", lambda: f"Slurm job {waiting_id} is still pending" in waiting.output(), 120)  # a hang guard
    assert re.search(r"still pending after \d+s \(timeouts.rendezvous_s\): (Resources|Priority)", waiting.output()), waiting.output()
    assert f"{waiting_id} PENDING" in queue(rig)
    waiting.proc.send_signal(signal.SIGINT)  # cancels it while it pends
    assert waiting.wait(30) == 130, waiting.output()
    assert result_of(waiting.run_dir())["failure"]["summary"].endswith("cancelled before it ran)")
    assert slurm_state(rig, waiting_id) == "CANCELLED"

    t0 = time.monotonic()
    stopped = cli(rig, "stop", job_id)
    assert (stopped.returncode, stopped.stdout) == (0, f"{job_id}: CANCELLED\n"), stopped.stdout + stopped.stderr
    assert slurm_state(rig, job_id) == "CANCELLED"
    print(f"launch stop {job_id}: {time.monotonic() - t0:.2f}s")
    wait_queue_empty(rig)
    assert rig.wait_clean() == {}
    report = cli(rig, "report", str(run_dir))
    assert report.returncode == 0 and "interrupted (launch stop" in report.stdout, report.stdout + report.stderr
    assert cli(rig, "status", "999999").returncode == 2


def test_requests_the_partition_can_never_hold_are_refused_before_submitting(slurm_rig: SlurmRig, tmp_path: Path):
    rig = slurm_rig
    spec = str(write_spec(tmp_path, "impossible"))
    has = "partition debug has 2 nodes with 2 CPUs and no GPUs; nothing was submitted"
    cases = {
        "resources.nodes=3": "resources.nodes: 3 node(s) requested, but " + has,
        "resources.gpus_per_node=1": "resources.gpus_per_node: 1 GPU(s) per node on 2 node(s) requested, but " + has,
        "resources.cpu_workers=3": "resources.cpu_workers (one CPU per rank): 3 CPU(s) per node on 2 node(s) requested, but " + has,
        "slurm.partition=gpu": "slurm.partition: no partition 'gpu' on this cluster (partitions: debug); nothing was submitted",
        "slurm.extra_sbatch=[--nodes=4]": "slurm.extra_sbatch.0: --nodes is written by the launcher (set resources.nodes instead)",
        # Slurm's warning comes preemption.grace_s (60) + 30 s before the time limit, up to a minute sooner
        "slurm.time='0:02:30'": "slurm.time: 0:02:30 leaves no time to run: Slurm's warning to save and be requeued comes preemption.grace_s + 30 s "
                        "= 90 s before the time limit (up to 60 s sooner); set slurm.time to 0:03:00 or more",
    }
    for override, message in cases.items():
        done = cli(rig, spec, "--set", override, "--out", str(tmp_path / "runs"))
        assert done.returncode == 2 and message in done.stderr, (override, done.stderr)
    assert not (tmp_path / "runs").exists() and not queue(rig)


def test_dry_run_prints_the_sbatch_script_and_each_nodes_srun_line(slurm_rig: SlurmRig, tmp_path: Path):
    spec = write_spec(tmp_path, "dry", slurm={"qos": "normal", "extra_sbatch": ["--mem=0"]}, timeouts={"rendezvous_s": 60, "run_s": 600})
    done = cli(slurm_rig, str(spec), "--dry-run", "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    run_dir = tmp_path.resolve() / "runs" / "dry" / "<run-id>"
    for line in (
        f"$ sbatch --parsable {run_dir}/job.sbatch", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=1",
        "#SBATCH --partition=debug", "#SBATCH --qos=normal", "#SBATCH --time=0:14:00", f"#SBATCH --output={run_dir}/slurm-%j.out",
        "#SBATCH --requeue", "#SBATCH --signal=B:USR1@90", "#SBATCH --open-mode=append",  # preemption: warned, saved, requeued
        "#SBATCH --mem=0", f"exec {sys.executable} -m launcher.control.submitted slurm '{run_dir}' ) &",
    ):  # fmt: skip
        assert line in out, (line, out)
    assert "[n1] $ srun --nodes=1 --ntasks=1 --nodelist=n1 --cpus-per-task=1" in out and "--node-rank=1" in out, out
    assert "--gpus-per-node" not in out and not queue(slurm_rig) and not (tmp_path / "runs").exists()


def test_a_gpu_request_becomes_gres_per_node(slurm_gpu_rig: SlurmRig, launcher, tmp_path: Path):
    """The rig's GPUs are GRES entries over character devices: Slurm grants them (and sets
    CUDA_VISIBLE_DEVICES on every node's step), but no CUDA is behind them. So: the script asks
    --gpus-per-node, each node's step gets its two, and with ``device: auto`` the ranks say they
    found no GPU and run on the CPU; with ``device: cuda`` the run fails saying so."""
    rig = slurm_gpu_rig
    spec = write_spec(tmp_path, "gres", resources={"nodes": 2, "gpus_per_node": 2, "cpu_workers": 1}, params={"fault": "none", "var": "CUDA_VISIBLE_DEVICES"})
    dry = cli(rig, str(spec), "--dry-run")
    assert "#SBATCH --gpus-per-node=2" in dry.stdout and "cuda:1" in dry.stdout, dry.stdout + dry.stderr
    run = launcher(rig, str(spec))
    assert run.wait() == 0, run.output()
    run_dir = run.run_dir()
    assert "#SBATCH --gpus-per-node=2\n" in (run_dir / "job.sbatch").read_text()
    for rank, host in ((0, "n1"), (1, "n2")):
        log = (run_dir / "world2" / "logs" / f"rank{rank}.log").read_text()
        assert "CUDA_VISIBLE_DEVICES=0,1" in log, (host, log)
    assert "resources.gpus_per_node is 2, but n1 has no visible GPU: running on the CPU" in run.output()

    strict = launcher(rig, str(spec), "--set", "resources.device=cuda")
    assert strict.wait() == 1, strict.output()
    assert "'cuda' requested but n1 has no visible GPU" in result_of(strict.run_dir())["failure"]["summary"]


def test_a_rank_killed_on_the_second_node_is_replaced_in_place(slurm_rig: SlurmRig, launcher, tmp_path: Path):
    """Recovery in place under Slurm (a torchrun agent per node, started by srun): rank 3, on n2,
    SIGKILLs itself at step 17; n2's agent replaces it, the survivors on both nodes keep their
    processes and the state comes from rank 0's memory on n1; no restart, no step lost."""
    params = {"steps": 30, "checkpoint_every": 10, "marker": str(tmp_path / "killed"), "kill_at": 17, "victim": 3}
    spec = write_spec(tmp_path, "inplace", entrypoint="tests.integration.in_place_job:run", params=params,
                      resources={"nodes": 2, "cpu_workers": 2}, max_restarts=1)  # fmt: skip
    run = launcher(slurm_rig, str(spec))
    assert run.wait() == 0, run.output()
    assert (tmp_path / "killed").exists()  # the fault happened
    result = result_of(run.run_dir())
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 0 and len(stage["attempts"]) == 1, stage
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "in_place" and recovery["dead_ranks"] == [3], recovery
    assert recovery["resumed_step"] == 17 and recovery["steps_lost"] == 0 and recovery["state_bytes"] > 0, recovery
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert [ranks[k]["hostname"] for k in range(4)] == ["n1", "n1", "n2", "n2"]
    assert ranks[3]["result"]["first_step"] == 17 and all(ranks[k]["result"]["first_step"] == 0 for k in (0, 1, 2))
    assert len({r["result"]["model_sha256"] for r in result["ranks"]}) == 1
