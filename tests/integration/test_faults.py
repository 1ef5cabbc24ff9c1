"""Issue 6 with real processes on CPU: a rank that raises, calls os._exit, is SIGKILLed or hangs;
a script that fails; a transient failure with restarts. Each asserts the report, the exit code
and an empty process table for the run afterwards."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from launcher.records import RankExit
from launcher.procutil import oom_kill_count
from launcher.control.diagnosis import find_root_cause
from tests.conftest import launch, pids_mentioning
from tests.integration.faultkit import Launched, describe, record, result_of, wait_no_pids, write_spec

HOST = socket.gethostname()
SECRET = "hf_s3cr3t-value-1234"
# Fail fast is a path, not a figure: the peers block in a gloo all-reduce (timeout 3600 s) and
# timeouts.run_s is 600 s, so a launcher that did not stop them on the first failure would end in
# "timeout" (or Launched.wait's 180 s hang guard would fire), never in "failed" with the peers
# stopped as collateral. The seconds it took are recorded (record), not asserted.


def _no_orphans(out: Path) -> None:
    # The launcher exited after stopping them: this waits only for the kernel to finish the
    # kills. 60 s is a hang guard (a leaked rank sleeps for an hour), not a speed figure.
    left, _ = wait_no_pids(str(out), 60)
    assert left == [], f"processes of the run remain:\n{describe(left)}"


def _assert_failed_fast(result: dict) -> None:
    """The last stage ended on rank 1's failure: its peer, blocked in the all-reduce, was stopped."""
    failure = result["failure"]
    assert result["status"] == "failed" and failure["reason"] == "failed", failure  # not "timeout" (run_s)
    assert failure["collateral_ranks"] == [0], failure
    peer = next(r for r in result["ranks"] if r["world_size"] == result["stages"][-1]["world_size"] and r["rank"] == 0)
    assert peer["status"] == "stopped", peer  # stopped by the launcher, not failed by a gloo timeout


@pytest.fixture
def launched():
    started: list[Launched] = []

    def start(spec: Path, out: Path, *extra: str) -> Launched:
        run = Launched(spec, out, *extra)
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()


def test_rank_that_raises_is_the_root_cause_and_stops_the_rest_fast(tmp_path, launched):
    """World 1 succeeds, world 2 fails on rank 1: one report, collateral named, results kept."""
    spec = write_spec(
        tmp_path,
        params={"fault": "raise", "rank": 1, "var": "HF_TOKEN"},
        scaling={"workers": [1, 2]},
        env={"HF_TOKEN": SECRET},
    )
    run = launched(spec, tmp_path / "runs")
    rc = run.wait()
    t_exit = time.time()
    out = run.output()
    assert rc == 1, out
    run_dir = run.run_dir()
    result = result_of(run_dir)
    assert result["status"] == "failed"
    failure = result["failure"]
    root = failure["root_cause"]
    assert (root["host"], root["rank"], root["local_rank"], root["device"]) == (HOST, 1, 1, "cpu")
    assert root["type"] == "ValueError" and root["message"].startswith("injected failure on rank 1")
    assert "faulty.py" in root["traceback"] and "raise ValueError" in root["traceback"]
    assert any("ValueError: injected failure on rank 1" in line for line in root["log_tail"])
    assert failure["collateral_ranks"] == [0]
    # the console report: one failure report with the same facts
    assert out.count("FAILED: rank 1 on") == 1
    assert f"root cause: host {HOST}, rank 1, local rank 1, device cpu" in out
    assert "stopped as collateral: ranks [0]" in out
    assert "SignalException" not in out, "teardown must not look like a second failure"
    # the traceback once, with the job's frames only; torchelastic's teardown warnings stay in the logs
    assert out.count("ValueError: injected failure on rank 1") == 2  # the traceback's last line, and the FAILED line
    assert out.count("Traceback (most recent call last):") == 1 and "faulty.py" in out
    assert "launcher/runtime/worker.py" not in out and "Received 15 death signal" not in out
    assert "launcher/runtime/worker.py" in root["traceback"]  # ... which result.json keeps whole
    failure_block = out[out.index("FAILED: rank 1 on"):out.index("run directory:")]
    assert len(failure_block.splitlines()) <= 15
    # nothing lost: the completed stage's results stay, the failed stage keeps its logs
    stage1, stage2 = result["stages"]
    assert (stage1["world_size"], stage1["status"], stage2["status"]) == (1, "succeeded", "failed")
    ok = [r for r in result["ranks"] if r["world_size"] == 1]
    assert ok and ok[0]["status"] == "ok" and ok[0]["result"] == {"rank": 0, "fault": "raise"}
    assert "ValueError" in (run_dir / "world2" / "logs" / "rank1.log").read_text()
    assert (run_dir / "world2" / "logs" / "rank0.log").is_file()
    # fail fast: the first failure ended the stage, not the gloo (3600 s) or run_s (600 s) timeouts
    fault_at = next(r for r in result["ranks"] if r["world_size"] == 2 and r["rank"] == 1)["error"]["time"]
    record("raise: first failure -> launcher exit", t_exit - fault_at)
    _assert_failed_fast(result)
    # secrets: masked on the console, in logs (ours and torchrun's raw copies), reports, result.json
    assert SECRET not in out
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), f"secret leaked into {path}"
    assert "HF_TOKEN=****" in (run_dir / "world2" / "logs" / "rank0.log").read_text()
    assert result["spec"]["env"]["HF_TOKEN"] == "****"
    _no_orphans(tmp_path / "runs")


# ranks forked from the forkserver (the default) and fresh interpreters report failures alike
BOTH_START_METHODS = pytest.mark.parametrize("start_method", ["forkserver", "spawn"])


@BOTH_START_METHODS
def test_rank_that_calls_os_exit_is_reported_with_its_exit_code(tmp_path, launched, start_method):
    spec = write_spec(tmp_path, params={"fault": "exit", "rank": 1, "code": 3}, start_method=start_method)
    run = launched(spec, tmp_path / "runs")
    rc = run.wait()
    t_exit = time.time()
    assert rc == 1, run.output()
    run_dir = run.run_dir()
    failure = result_of(run_dir)["failure"]
    root = failure["root_cause"]
    assert (root["rank"], root["local_rank"], root["host"], root["exitcode"]) == (1, 1, HOST, 3)
    assert root["type"] == "ProcessExit" and "exited with code 3" in root["message"]
    assert failure["collateral_ranks"] == [0]
    assert "FAILED: rank 1 on" in run.output() and "exited with code 3" in run.output()
    exited_at = float(re.search(r"exiting at ([\d.]+)", (run_dir / "world2/logs/rank1.log").read_text())[1])
    record("os._exit: rank exit -> launcher exit", t_exit - exited_at)
    _assert_failed_fast(result_of(run_dir))
    _no_orphans(tmp_path / "runs")


@BOTH_START_METHODS
def test_rank_killed_by_sigkill_is_reported_by_signal_name(tmp_path, launched, start_method):
    spec = write_spec(tmp_path, params={"fault": "sleep"}, start_method=start_method)
    run = launched(spec, tmp_path / "runs")
    pids = run.wait_running(2)
    killed_at = time.time()
    import os

    os.kill(pids[1], signal.SIGKILL)
    rc = run.wait()
    record("SIGKILL of a rank -> launcher exit", time.time() - killed_at)
    assert rc == 1, run.output()
    failure = result_of(run.run_dir())["failure"]
    root = failure["root_cause"]
    assert root["rank"] == 1 and root["signal"] == "SIGKILL"
    assert root["type"] in ("KilledBySignal", "OutOfMemoryKill") and "killed by SIGKILL" in root["message"]
    assert failure["collateral_ranks"] == [0]
    assert "killed by SIGKILL" in run.output()
    _assert_failed_fast(result_of(run.run_dir()))
    _no_orphans(tmp_path / "runs")


def test_run_timeout_dumps_stuck_stacks_and_names_stuck_ranks(tmp_path, launched):
    spec = write_spec(tmp_path, params={"fault": "hang", "rank": 1}, timeouts={"run_s": 20})
    run = launched(spec, tmp_path / "runs")
    run.wait_running(2)
    rc = run.wait()
    out = run.output()
    assert rc == 1, out
    run_dir = run.run_dir()
    result = result_of(run_dir)
    assert result["status"] == "timeout"
    failure = result["failure"]
    assert failure["reason"] == "timeout" and failure["stuck_ranks"] == [0, 1]
    assert "timeouts.run_s=20s" in failure["summary"]
    assert "stuck ranks (stacks dumped to their logs): [0, 1]" in out
    log1 = (run_dir / "world2" / "logs" / "rank1.log").read_text()
    assert "stuck_in_python" in log1 and "faulty.py" in log1, log1[-2000:]  # the faulthandler dump
    _no_orphans(tmp_path / "runs")


def test_script_mode_failure_gets_the_same_report(tmp_path, launched):
    script = tmp_path / "train.py"
    script.write_text(
        "import os, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(0.5)\n"
        "    raise RuntimeError('script broke on rank ' + os.environ['RANK'])\n"
        "time.sleep(3600)\n"
    )
    spec = write_spec(tmp_path, name="script_fault", script="train.py")
    run = launched(spec, tmp_path / "runs")
    rc = run.wait()
    out = run.output()
    assert rc == 1, out
    root = result_of(run.run_dir())["failure"]["root_cause"]
    assert (root["rank"], root["type"], root["message"]) == (1, "RuntimeError", "script broke on rank 1")
    assert "train.py" in root["traceback"] and root["log_tail"]
    assert "FAILED: rank 1 on" in out and "stopped as collateral: ranks [0]" in out
    _no_orphans(tmp_path / "runs")


def test_transient_failure_is_restarted_and_succeeds(tmp_path, launched):
    marker = tmp_path / "failed-once"
    spec = write_spec(
        tmp_path, params={"fault": "flaky", "marker": str(marker)}, resources={"cpu_workers": 1}, max_restarts=2
    )
    run = launched(spec, tmp_path / "runs")
    rc = run.wait()
    out = run.output()
    assert rc == 0, out
    assert marker.is_file()
    run_dir = run.run_dir()
    result = result_of(run_dir)
    assert result["status"] == "succeeded" and result["restarts"] == 1
    assert result["stages"][0]["restarts"] == 1
    assert "restarting the group (restart 1 of 2 (rank_lost))" in out
    first, second = result["stages"][0]["attempts"]
    assert (first["failure_class"], first["restarted"], second["status"]) == ("rank_lost", True, "succeeded")
    # the failed attempt's logs and report are kept beside the successful one
    assert "transient failure" in (run_dir / "world1" / "attempt0" / "logs" / "rank0.log").read_text()
    assert json.loads((run_dir / "world1" / "attempt0" / "reports" / "rank0.json").read_text())["status"] == "stopped"  # it died: no report of its own
    _no_orphans(tmp_path / "runs")


def test_a_job_error_is_not_restarted_by_default(tmp_path, launched):
    spec = write_spec(tmp_path, params={"fault": "raise", "rank": 0, "delay_s": 0}, resources={"cpu_workers": 1}, max_restarts=3)
    run = launched(spec, tmp_path / "runs")
    assert run.wait() == 1, run.output()
    result = result_of(run.run_dir())
    assert result["status"] == "failed" and result["restarts"] == 0
    assert result["failure"]["root_cause"]["type"] == "ValueError" and result["failure"]["failure_class"] == "job_error"
    (only,) = result["stages"][0]["attempts"]
    assert only["decision"].startswith("job_error is not in restart_on")
    assert f"not restarted: {only['decision']}" in run.output()
    _no_orphans(tmp_path / "runs")


def test_restart_on_all_restarts_a_job_error_once_and_stops_when_the_traceback_repeats(tmp_path, launched):
    spec = write_spec(tmp_path, params={"fault": "raise", "rank": 0, "delay_s": 0}, resources={"cpu_workers": 1}, max_restarts=3, restart_on=["all"])
    run = launched(spec, tmp_path / "runs")
    assert run.wait() == 1, run.output()
    result = result_of(run.run_dir())
    assert result["status"] == "failed" and result["restarts"] == 1  # not 3: the same traceback came back
    first, second = result["stages"][0]["attempts"]
    assert first["restarted"] and not second["restarted"]
    assert second["decision"].startswith("the job raised the same error, with the same traceback")
    _no_orphans(tmp_path / "runs")


# --- the out-of-memory verdict, without exhausting this machine's memory -------------------------


def test_sigkill_with_an_oom_kill_counted_is_called_out_of_memory():
    oom = find_root_cause([], [RankExit(rank=1, exitcode=-9, signal="SIGKILL", oom_suspected=True)])
    assert oom.type == "OutOfMemoryKill" and "out of memory" in oom.message and oom.signal == "SIGKILL"
    plain = find_root_cause([], [RankExit(rank=1, exitcode=-9, signal="SIGKILL")])
    assert plain.type == "KilledBySignal" and plain.message == "killed by SIGKILL"


def test_oom_kill_count_reads_cgroup_v1_and_v2_files(tmp_path):
    v2 = tmp_path / "memory.events"
    v2.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oom_kill_count([str(tmp_path / "missing"), str(v2)]) == 2
    assert oom_kill_count([str(v1)]) == 5
    assert oom_kill_count([str(tmp_path / "missing")]) is None


def test_no_process_mentions_a_finished_test_run(tmp_path):
    assert pids_mentioning(str(tmp_path)) == []


# --- security: no unsafe YAML, no shell, secrets masked in dry runs --------------------------------


def test_no_unsafe_yaml_loader_and_no_shell_anywhere_in_the_launcher(repo):
    unsafe = re.compile(r"yaml\.load\(|unsafe_load|FullLoader|yaml\.Loader\b|UnsafeLoader|shell\s*=\s*True|os\.system\(|os\.popen\(")
    hits = [
        f"{path.relative_to(repo)}:{n}: {line.strip()}"
        for path in sorted((repo / "launcher").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if unsafe.search(line)
    ]
    assert hits == []


def test_dry_run_masks_secrets_and_quotes_spec_values(tmp_path, capsys, monkeypatch):
    from launcher.ui.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # rich wraps long lines otherwise
    spec = write_spec(
        tmp_path,
        params={"fault": "none"},
        env={"WANDB_API_KEY": "k3y-value-9876", "DB_PASSWORD": "pa55word!", "MY_SECRET": "s3cret-thing", "HF_TOKEN": SECRET,
             "PLAIN": "visible; $(touch /tmp/gpulaunch-pwned)"},
    )
    assert main([str(spec), "--dry-run", "--out", str(tmp_path / "runs")]) == 0
    text = capsys.readouterr().out
    for value in ("k3y-value-9876", "pa55word!", "s3cret-thing", SECRET):
        assert value not in text
    for name in ("WANDB_API_KEY", "DB_PASSWORD", "MY_SECRET", "HF_TOKEN"):
        assert f"{name}=****" in text
    assert "visible;" in text  # ordinary values are shown; they reach workers as env, never a shell
    assert not (tmp_path / "runs").exists() and not Path("/tmp/gpulaunch-pwned").exists()


def test_a_script_that_needs_a_gpu_on_a_cpu_machine_gets_one_hint_line(tmp_path):
    """pytorch/examples' DDP tutorial style: torch.cuda.set_device and NCCL, hard-coded."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    (tmp_path / "gpu_only.py").write_text(
        "import os, torch\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
        "torch.distributed.init_process_group('nccl')\n"
    )
    spec = write_spec(tmp_path, name="gpu_only", script="gpu_only.py", resources={"cpu_workers": 1})
    done = launch(str(spec), "--out", str(tmp_path / "runs"))
    assert done.returncode == 1, done.stdout + done.stderr
    shown = " ".join(done.stdout.split())  # the console wraps at its width
    assert shown.count("hint: ") == 1 and "hint: this rank ran on the CPU (no GPU visible here) and the job's code uses CUDA or NCCL" in shown
    (run_dir,) = (tmp_path / "runs" / "gpu_only").iterdir()
    assert "CUDA or NCCL" in result_of(run_dir)["failure"]["root_cause"]["hint"]
