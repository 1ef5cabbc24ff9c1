"""How far an attempt got, exactly, with real torchrun ranks that end in silence: each rank's step
counter (``launcher.runtime.stepcount``), read by its agent once the rank is gone, makes the
attempt's ``steps`` and ``lost_steps`` and every rank's ``metrics.steps`` the true count, not a
beacon up to half a second old. The ranks print every step they finish to their logs; the record
must say the same."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.faultkit import Launched, result_of, wait_no_pids, write_spec

STOP_AT = 157  # the step after which the ranks are SIGKILLed (many steps a beacon interval: its count lags)
SAVE_AT = 100  # every rank saves a checkpoint after this step
_STEP_LINE = re.compile(r"exact-steps: rank (\d+) step (\d+)")


def job(ctx: Any) -> None:
    """Steps in lockstep (one all-reduce each), saves after ``save_at``; each rank of ``killed``
    SIGKILLs itself right after step ``stop_at``; the others go on until their peer's loss ends them."""
    import torch
    import torch.distributed as dist

    stop_at, save_at, killed = int(ctx.param("stop_at")), int(ctx.param("save_at")), list(ctx.param("killed"))
    grads = torch.ones(1)
    step = 0
    while True:
        dist.all_reduce(grads)
        ctx.metrics.step()
        step += 1
        print(f"exact-steps: rank {ctx.rank} step {step}", flush=True)
        if step == save_at:
            ctx.checkpoint.save({"step": torch.tensor(step)}, step=step)
        if step == stop_at and ctx.rank in killed:
            os.kill(os.getpid(), signal.SIGKILL)  # no handler, no report, no last beacon


def ddp_job(ctx: Any) -> None:
    """A DDP job that counts no step of its own (no ``ctx.metrics.step()``: its optimizer's steps
    are its count) and saves through ``ctx.checkpoint`` after ``save_at``; every rank SIGKILLs
    itself right after step ``stop_at``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    stop_at, save_at = int(ctx.param("stop_at")), int(ctx.param("save_at"))
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 10**9):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        print(f"exact-steps: rank {ctx.rank} step {step}", flush=True)
        if step == save_at:
            ctx.checkpoint.save({"model": model.module.state_dict()}, step=step)
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGKILL)


_SCRIPT = """\
import os, signal
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stop_at = int(os.environ["STOP_AT"])
for step in range(1, 10**9):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    print(f"exact-steps: rank {os.environ['RANK']} step {step}", flush=True)
    if step == stop_at:
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def launched():
    started: list[Launched] = []

    def start(spec: Path, out: Path) -> Launched:
        run = Launched(spec, out)
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()


def _last_steps(run_dir: Path) -> dict[int, int]:
    """Each rank's last step, as it printed it."""
    out: dict[int, int] = {}
    for log in (run_dir / "world2" / "logs").glob("rank*.log"):
        for rank, step in _STEP_LINE.findall(log.read_text(errors="replace")):
            out[int(rank)] = max(out.get(int(rank), 0), int(step))
    return out


def _finished(run: Launched, out: Path) -> tuple[dict[str, Any], dict[int, int]]:
    rc = run.wait()
    assert rc == 1, run.output()
    run_dir = run.run_dir()
    left, _ = wait_no_pids(str(out), 5)
    assert left == [], left
    return result_of(run_dir), _last_steps(run_dir)


def _spec(tmp_path: Path, killed: list[int]) -> Path:
    return write_spec(
        tmp_path, name="exact_steps", entrypoint="tests.integration.test_exact_steps:job", max_restarts=0,
        params={"stop_at": STOP_AT, "save_at": SAVE_AT, "killed": killed},
    )  # fmt: skip


def test_ranks_sigkilled_together_right_after_a_step_are_counted_exactly(tmp_path, launched):
    out = tmp_path / "runs"
    result, printed = _finished(launched(_spec(tmp_path, killed=[0, 1]), out), out)
    assert printed == {0: STOP_AT, 1: STOP_AT}
    (attempt,) = result["stages"][0]["attempts"]
    assert attempt["failure_class"] == "rank_lost", attempt
    assert (attempt["steps"], attempt["checkpoint_step"], attempt["lost_steps"]) == (STOP_AT, SAVE_AT, STOP_AT - SAVE_AT), attempt
    for rank in result["ranks"]:
        assert rank["metrics"]["steps"] == STOP_AT, rank
        assert rank["metrics"].get("steps_from") == "beacon", rank  # neither wrote a report: its settled beacon's count


def test_a_rank_sigkilled_while_its_peer_runs_is_counted_exactly(tmp_path, launched):
    out = tmp_path / "runs"
    result, printed = _finished(launched(_spec(tmp_path, killed=[1]), out), out)
    assert printed[1] == STOP_AT  # rank 0 finished that step too (its all-reduce had rank 1's part), then lost rank 1
    (attempt,) = result["stages"][0]["attempts"]
    assert attempt["failure_class"] == "rank_lost" and attempt["cause"].startswith("rank 1 on "), attempt
    assert (attempt["steps"], attempt["lost_steps"]) == (STOP_AT, STOP_AT - SAVE_AT), attempt
    by_rank = {r["rank"]: r for r in result["ranks"]}
    assert by_rank[1]["metrics"] == {"steps": STOP_AT, "steps_from": "beacon"}, by_rank[1]
    assert by_rank[0]["metrics"]["steps"] == printed[0], (by_rank[0], printed)  # its own report, or its settled beacon


def test_a_script_counted_by_its_ddp_optimizer_is_counted_exactly(tmp_path, launched):
    (tmp_path / "train.py").write_text(_SCRIPT)
    spec = write_spec(tmp_path, name="exact_steps_script", script="train.py", max_restarts=0, env={"STOP_AT": str(STOP_AT)})
    out = tmp_path / "runs"
    result, printed = _finished(launched(spec, out), out)
    assert printed == {0: STOP_AT, 1: STOP_AT}
    (attempt,) = result["stages"][0]["attempts"]
    assert (attempt["steps"], attempt["checkpoint_step"], attempt["lost_steps"]) == (STOP_AT, None, STOP_AT), attempt
    assert [r["metrics"]["steps"] for r in result["ranks"]] == [STOP_AT, STOP_AT], result["ranks"]


def test_a_job_counted_by_its_ddp_optimizer_loses_only_the_steps_after_its_checkpoint(tmp_path, launched):
    """Its checkpoint is placed among the steps its beacon counts (once, the save counted only
    ``ctx.metrics.step()`` calls: 0, so a restart said every step of the attempt lost)."""
    spec = write_spec(
        tmp_path, name="exact_steps_ddp", entrypoint="tests.integration.test_exact_steps:ddp_job", max_restarts=0,
        params={"stop_at": STOP_AT, "save_at": SAVE_AT},
    )  # fmt: skip
    out = tmp_path / "runs"
    result, printed = _finished(launched(spec, out), out)
    assert printed == {0: STOP_AT, 1: STOP_AT}
    (attempt,) = result["stages"][0]["attempts"]
    assert (attempt["steps"], attempt["checkpoint_step"], attempt["lost_steps"]) == (STOP_AT, SAVE_AT, STOP_AT - SAVE_AT), attempt
