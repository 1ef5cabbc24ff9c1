"""Hangs on this machine, with real torchrun ranks: each injected hang is noticed from the live
stream, every rank's evidence gathered (py-spy from outside, the flight recorder's collectives),
the culprit named with its host and file:line, everything torn down, exit 1 (no false alarm:
test_hang_false_alarms.py).

The injected hangs are in ``tests/integration/hang_job.py`` (nothing in it knows about hangs).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.integration.faultkit import Launched, child_env, pythonpath, record, result_of, wait_no_pids

pytestmark = pytest.mark.slow

HOST = socket.gethostname()
HANG_S = 6
JOB = REPO / "tests" / "integration" / "hang_job.py"


def hang_spec(tmp_path: Path, name: str, *, params: dict, hang_s: float = HANG_S, workers: int = 2, **fields) -> Path:
    spec = {
        "name": name,
        "entrypoint": "tests.integration.hang_job:run",
        "params": params,
        "resources": {"cpu_workers": workers},
        "timeouts": {"hang_s": hang_s, "run_s": 300, "rendezvous_s": 120},
        "env": {"PYTHONPATH": pythonpath()},
        **fields,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def line_of(marker: str) -> int:
    """The line of hang_job.py that holds ``marker`` (where a hung rank must be found)."""
    return next(i for i, text in enumerate(JOB.read_text().splitlines(), 1) if marker in text)


# what each hang must be named as: why (part of the text), and the line it is at
CASES = {
    "sleep": ("has not reached all_reduce #", "time.sleep(FOREVER_S)"),
    "skip": ("is in broadcast [1] as #", "dist.broadcast(flag, src=0)  # the all-reduce before it skipped"),
    "stop": ("is frozen (its process is stopped", "signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)"),
    "lock": ("has not reached all_reduce #", "with lock:  # never acquired"),
}


@pytest.mark.parametrize("hang", sorted(CASES))
def test_an_injected_hang_is_named_with_its_rank_host_and_line(tmp_path, hang):
    why, marker = CASES[hang]
    run = Launched(hang_spec(tmp_path, f"hang-{hang}", params={"hang": hang, "rank": 3, "at": 20}, workers=4), tmp_path / "runs")
    try:
        run.wait_running(4)
        running_at = time.monotonic()
        rc = run.wait(280)  # a hang guard below run_s=300: a hang not named ends in "timeout", or here
        took = time.monotonic() - running_at
        out = run.output()
    finally:
        run.close()
    assert rc == 1, out
    result = result_of(run.run_dir())
    assert result["status"] == "hung", out
    hang_info = result["failure"]["hang"]
    (culprit,) = hang_info["culprits"]
    assert (culprit["rank"], culprit["host"], culprit["device"]) == (3, HOST, "cpu"), hang_info
    assert why in culprit["why"], hang_info
    assert (Path(culprit["file"]).name, culprit["line"]) == ("hang_job.py", line_of(marker)), hang_info
    # ranks 0-2 are found waiting in the collective rank 3 never entered, at the job's all-reduce
    waiting = next(g for g in hang_info["groups"] if g["ranks"] == [0, 1, 2])
    assert waiting["collective"] and waiting["collective"].startswith("all_reduce #"), hang_info
    assert waiting["where"].startswith(f"hang_job.py:{line_of('dist.all_reduce(grads)')} "), hang_info
    # the console said it, once, in words; the evidence of both ranks is on this machine
    assert f"HUNG: rank 3 on {HOST} (cpu) {why}" in " ".join(out.split()), out[-3000:]
    evidence = Path(hang_info["evidence_dir"])
    stacks = (evidence / "stacks.txt").read_text()
    assert all(f"rank {r} on {HOST}" in stacks for r in range(4)) and "all_reduce #" in stacks, stacks[:2000]
    # torch's own dumps of the answering ranks' flight recorders, for its tools (a frozen rank gives none)
    from torch.distributed.flight_recorder.components.loader import read_dump

    answered = [r for r in range(4) if not (hang == "stop" and r == 3)]
    for r in answered:
        dump = read_dump("fr_trace_rank", str(evidence / f"fr_trace_rank{r}"))
        assert dump["entries"] and dump["entries"][-1]["profiling_name"].endswith(("all_reduce", "broadcast")), dump["entries"][-1:]
    # named by the hang watch after hang_s of no progress (honoured: at least that), not by run_s
    # (300 s: status "timeout"); how long it all took is recorded, not asserted
    assert hang_info["stalled_for_s"] >= HANG_S, hang_info
    record(f"hang {hang}: all ranks running to exit", took)
    print(f"hang {hang}: stalled {hang_info['stalled_for_s']} s when named, {hang_info['detected_after_s']} s into the stage; "
          f"evidence gathered in {hang_info['gather_s']} s")
    left, _ = wait_no_pids(str(tmp_path / "runs"), 10)
    assert left == [], left


def test_on_hang_restart_keeps_each_attempts_diagnosis(tmp_path):
    spec = hang_spec(tmp_path, "hang-again", params={"hang": "sleep", "rank": 1, "at": 10}, max_restarts=1)
    spec.write_text(spec.read_text().replace("run_s: 300", "run_s: 300\n  on_hang: restart"))
    done = subprocess.run([sys.executable, "-m", "launcher", str(spec), "--out", str(tmp_path / "runs")], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "hang-again").iterdir()
    result = result_of(run_dir)
    assert result["status"] == "hung" and result["stages"][0]["restarts"] == 1, result["stages"][0]
    first = json.loads((run_dir / "world2" / "attempt0" / "hang" / "diagnosis.json").read_text())
    assert first["culprits"][0]["rank"] == 1 and "restarting the group" in done.stdout
    assert result["failure"]["hang"]["culprits"][0]["rank"] == 1


DDP_SCRIPT = """\
import os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(100000):
    if step == 20 and dist.get_rank() == 1:
        time.sleep(3600)  # the injected hang
    opt.zero_grad()
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    time.sleep(0.02)
"""


def test_a_torchrun_script_with_ddp_is_watched_through_its_optimizer_steps(tmp_path):
    """A script counts no steps itself; its DDP model's optimizer steps are counted for it."""
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    spec = tmp_path / "script.yaml"
    spec.write_text(yaml.safe_dump({"name": "scripthang", "script": str(script), "resources": {"cpu_workers": 2},
                                    "timeouts": {"hang_s": HANG_S, "run_s": 300}}))  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "launcher", str(spec), "--out", str(tmp_path / "runs"), "--no-metrics"], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "scripthang").iterdir()
    info = result_of(run_dir)["failure"]["hang"]
    (culprit,) = info["culprits"]
    assert (culprit["rank"], Path(culprit["file"]).name, culprit["line"]) == (1, "train.py", 10), info
    assert culprit["where"] == "train.py:10 time.sleep(3600)", info
