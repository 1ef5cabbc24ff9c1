"""What a real ``launch`` prints, piped (80 columns), for runs that end without a workload's own
summary: a run stopped with Ctrl-C after its first step, and a torchrun ``script:`` job.

Ctrl-C: the stage table and result.json give each start-up phase the ranks went through before
the stop (the ranks' own stamps, carried by their beacons: a stopped rank writes no report), and
the run phase lasts until the stop; they used to read ``-`` throughout. A script job: ``launch
runs`` gives its wall time and how its ranks exited, never "0 steps/rank" (a script counts no
steps), and its summary says that a script gets no plot."""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
import time
from pathlib import Path
from typing import Any

from tests.conftest import REPO, launch
from tests.integration.faultkit import Launched, result_of, write_spec

CELLS = re.compile(r"[^\s│┃]+")
PHASES = ("spawn", "import", "rendezvous", "pg_init", "run", "to_first_step")

STEPPER = '''\
import time


def run(ctx):
    with ctx.metrics.timer("first/step"):
        time.sleep(0.01)
    ctx.metrics.step()
    print(f"stepped: rank {ctx.rank}", flush=True)
    while True:  # never watches ctx.should_stop: Ctrl-C stops it where it is
        time.sleep(0.05)
'''


def _wait_for_steps(run: Launched, ranks: int, timeout_s: float = 120) -> None:
    """Until every rank's beacon counts a step."""
    run_dir = run.run_dir(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stepped = 0
        for path in run_dir.glob("world*/progress/rank*.json"):
            try:
                stepped += json.loads(path.read_text()).get("steps", 0) >= 1
            except (OSError, ValueError):
                continue
        if stepped == ranks:
            return
        assert run.proc.poll() is None, f"launcher exited ({run.proc.returncode}) before its ranks stepped:\n{run.output()}"
        time.sleep(0.05)
    raise AssertionError(f"ranks did not step within {timeout_s}s:\n{run.output()}")


def _row(text: str, first: list[str]) -> list[str]:
    """The cells of the printed table line that starts with ``first``."""
    rows = [cells for cells in map(CELLS.findall, text.splitlines()) if cells[: len(first)] == first]
    assert len(rows) == 1, text
    return rows[0]


def test_a_run_stopped_with_ctrl_c_after_its_first_step_shows_the_phases_it_went_through(tmp_path: Path) -> None:
    (tmp_path / "stepper.py").write_text(STEPPER)
    spec = write_spec(tmp_path, name="stepper", entrypoint="stepper:run", env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    run = Launched(spec, tmp_path / "runs")
    try:
        _wait_for_steps(run, 2)
        os.kill(run.pid, signal.SIGINT)
        assert run.wait(60) == 130, run.output()
        out = run.output()
        result = result_of(run.run_dir())
    finally:
        run.close()
    (stage,) = result["stages"]
    assert (result["status"], stage["status"]) == ("interrupted", "interrupted")
    assert {r["status"] for r in result["ranks"]} == {"stopped"} and {r["last_phase"] for r in result["ranks"]} == {"running"}
    phases = stage["phases"]
    assert all(isinstance(phases[p], float) for p in PHASES), phases  # every phase it went through, dated
    assert phases["to_first_step"] < stage["wall_s"]
    # spawn to the stop: the phases count from the attempt's start (the stage's own preparation
    # comes before it) and end where the last rank stamped "finished" as it stopped, or, where no
    # rank got to, at the stop; the stage's wall time holds both
    attempt = stage["attempts"][-1]
    finished = [r["timeline_s"]["finished"] for r in result["ranks"] if "finished" in r["timeline_s"]]
    stopped_at = max(finished) if finished else attempt["ended_at"] - attempt["started_at"]
    started = sum(phases[p] for p in PHASES[:-1])
    assert abs(started - stopped_at) < 0.001 and started <= stage["wall_s"], (phases, attempt, stage["wall_s"])
    # the printed stage table (piped: 80 columns) shows the same numbers, none of them "-"
    assert "INTERRUPTED: interrupted (SIGINT)" in out and "Traceback" not in out
    cells = _row(out, ["2", "interrupted"])
    assert cells[3:] == [f"{stage['wall_s']:.2f}", *(f"{phases[p]:.2f}" for p in PHASES)], out
    table = [line for line in out.splitlines() if "restarts" in line or CELLS.findall(line)[:2] == ["2", "interrupted"]]
    assert table and all(len(line) <= 80 for line in table), out


def test_launch_runs_of_a_script_job_gives_its_wall_time_and_exit_not_zero_steps(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent("""\
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        print("sum", int(t.item()))
        dist.destroy_process_group()
        """))
    spec = tmp_path / "script_job.yaml"
    spec.write_text("name: script_job\nscript: train.py\nresources: {cpu_workers: 2}\n")
    out = tmp_path / "runs"
    done = launch(str(spec), "--out", str(out), env={"COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    (run_dir,) = (out / "script_job").iterdir()
    result: dict[str, Any] = json.loads((run_dir / "result.json").read_text())
    assert result["summary"]["steps_per_rank"] == 0 and result.get("plots") == []
    said = done.stdout.replace("\n", " ")
    assert "a script: job has no ctx.metrics, so it gets no series table and no plot" in said, done.stdout
    headline = f"{result['wall_s']:.1f} s, 2/2 ranks exit 0"
    wide = launch("runs", "--out", str(out), env={"COLUMNS": "200"})
    assert wide.returncode == 0, wide.stderr
    assert _row(wide.stdout, ["script_job", run_dir.name])[-6:] == headline.split(), wide.stdout
    narrow = launch("runs", "--out", str(out), env={"COLUMNS": "80"})  # piped, as a terminal of 80 columns
    assert "steps/rank" not in narrow.stdout and "exit 0" in narrow.stdout and "…" not in narrow.stdout, narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80
