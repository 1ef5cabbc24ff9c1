"""What a stopped run tells the user to paste is one whole line at any width, piped or not; a
restarted or resumed run's summary lists every attempt and says what its wall time sums."""

from __future__ import annotations

import io

from rich.console import Console

from launcher.ui.console import RunUI
from launcher.ui.report import _headline

RUN_DIR = "/tmp/pytest-of-root/pytest-12/test_sigterm_saves_at_the_next_0/ddp_train/20261127-101500-a1b2c3"
SUMMARY = f"stopped after a notice (SIGTERM): its last checkpoint is step 12; continue with: launch resume {RUN_DIR}"


def _result(**more):
    attempts = [
        {"attempt": 0, "status": "interrupted", "failure_class": "preempted", "steps": 12, "resumed_step": None, "lost_steps": 0,
         "started_at": 100.0, "ended_at": 110.0},
        {"attempt": 1, "status": "succeeded", "failure_class": None, "steps": 12, "resumed_step": 12, "lost_steps": None,
         "started_at": 200.0, "ended_at": 205.0},
    ]  # fmt: skip
    stage = {"world_size": 2, "status": "interrupted", "restarts": 0, "wall_s": 10.0, "attempts": attempts,
             "phases": {"spawn": 0.5, "import": 1.0, "rendezvous": 0.1, "pg_init": 0.1, "run": 8.0, "to_first_step": 1.8}}  # fmt: skip
    return {"job": "ddp_train", "backend": "torchrun", "status": "interrupted", "stages": [stage], "summary": {}, "wall_s": 10.0,
            "failure": {"reason": "interrupted", "summary": SUMMARY, "failure_class": "preempted"}, **more}  # fmt: skip


def _shown(result, width: int, terminal: bool) -> str:
    out = io.StringIO()
    RunUI(Console(file=out, width=width, force_terminal=terminal, color_system=None)).show_result(result, RUN_DIR)
    return out.getvalue()


def test_the_resume_hint_holds_the_whole_command_on_one_line_at_80_columns_piped_or_not():
    for terminal in (False, True):
        for width in (40, 80, 200):
            text = _shown(_result(), width, terminal)
            lines = text.splitlines()
            assert f"continue with: launch resume {RUN_DIR}" in lines, text  # the whole command, alone on its line
            assert not any(line.rstrip().endswith("launch resume") for line in lines), text
            assert f"{RUN_DIR};" not in text and "every rank was stopped" in text  # nothing glued to the path


def test_a_path_with_a_space_is_quoted_for_the_shell():
    spaced = _result(failure={"reason": "interrupted", "summary": "stopped: its last checkpoint is step 3; continue with: launch resume /tmp/my runs/j/1"})
    assert "continue with: launch resume '/tmp/my runs/j/1'" in _shown(spaced, 80, False).splitlines()


def test_the_runs_list_never_cuts_the_command_and_a_resumed_runs_summary_lists_every_attempt():
    headline = _headline(_result())
    assert "launch resume" in headline and RUN_DIR not in headline and "continue with" not in headline
    resumed = _result(status="succeeded", failure=None, wall_s=15.0, parts=[{"wall_s": 10.0, "gap_s": None}, {"wall_s": 5.0, "gap_s": 90.0}])
    text = _shown(resumed, 80, False)
    assert "attempts (result.json: stages[].attempts)" in text and "preempted" in text
    assert "2 launches (launch resume 1 time(s)): wall time 15.0 s, theirs summed; 90.0 s between them" in " ".join(text.split())


def test_torchs_terminating_process_line_stays_in_the_agents_log_not_the_console():
    out = io.StringIO()
    ui = RunUI(Console(file=out, width=80, color_system=None))
    ui.rank_output("vm:agent", "W1127 10:00:00.123000 3858 site-packages/torch/multiprocessing/spawn.py:165] Terminating process 3858 via signal SIGTERM")
    ui.rank_output("vm:0", "step 3")
    assert out.getvalue().splitlines() == ["vm:0 step 3"]
