"""What the console prints keeps every status, number and path whole on an 80-column console.

Rich, left to itself, shortens the widest columns of a table whatever they hold: at 80 columns
the run summary read ``succe…`` for ``succeeded``. The result rendered here comes from a real
(tiny) run, so its fields are the ones ``launch`` prints at the end of every run.
"""

from __future__ import annotations

import copy
import io
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from launcher.control.api import dry_run, run_job
from rich.text import Text

from launcher.ui.console import (
    MAX_TIMER_ROWS,
    RunUI,
    _cell,
    _duration,
    devices_table,
    plan_renderables,
    summary_renderables,
    timer_renderables,
)
from launcher.hardware.devices import NodeInventory, parse_nvidia_smi_csv
from launcher.spec.model import load_job

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "jobs" / "matmul_scaling.yaml"
# the cells of one printed table line, whichever borders the layout draws between them
CELLS = re.compile(r"[^\s│┃]+")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """result.json of a real run: the matmul job on one CPU worker (or GPU), tiny sizes."""
    quiet = RunUI(Console(file=io.StringIO()), quiet=True)
    overrides = ["params.sizes=[32]", "params.iters=2", "scaling.workers=[1]"]
    run = run_job(JOB, overrides=overrides, out=tmp_path_factory.mktemp("runs"), events=quiet)
    assert run.ok, run.data.get("failure")
    return dict(run.data)


def render(things: list[Any], width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    for thing in things:
        console.print(thing)
    return console.export_text()


def assert_fits(text: str, width: int) -> None:
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width, text


def stage_cells(stage: dict[str, Any]) -> list[str]:
    """The stage table's row for ``stage``: world size, status, restarts, then seconds to 2 decimals."""
    phases = [stage["phases"][k] for k in ("spawn", "import", "rendezvous", "pg_init", "run", "to_first_step")]
    seconds = ["-" if s is None else f"{s:.2f}" for s in (stage["wall_s"], *phases)]
    return [str(stage["world_size"]), stage["status"], str(stage["restarts"]), *seconds]


def assert_rows(text: str, rows: list[list[str]]) -> None:
    """Every row is one printed line holding exactly its cells, none cut, folded or merged."""
    lines = [CELLS.findall(line) for line in text.splitlines()]
    for row in rows:
        assert row in lines, f"no line holds {row}:\n{text}"


def test_the_stage_table_keeps_statuses_and_numbers_whole_at_80_columns(result: dict[str, Any]) -> None:
    text = render(summary_renderables(result), 80)
    assert_fits(text, 80)
    assert "succeeded" in text
    assert_rows(text, [stage_cells(s) for s in result["stages"]])
    assert f"[{result['backend']}]" in text  # the title's "[torchrun]" is text, not rich markup


@pytest.mark.parametrize("status", ["succeeded", "failed", "timeout", "interrupted"])  # StageOutcome.status
def test_every_stage_status_fits_a_day_long_run_at_80_columns(result: dict[str, Any], status: str) -> None:
    long_run = copy.deepcopy(result)
    for stage in long_run["stages"]:
        stage.update(status=status, restarts=12, wall_s=86399.994)
        stage["phases"].update(run=86000.123, to_first_step=412.5)
    text = render(summary_renderables(long_run), 80)
    assert_fits(text, 80)
    assert_rows(text, [stage_cells(s) for s in long_run["stages"]])


def test_a_wide_console_keeps_the_boxed_table_with_one_line_headers(result: dict[str, Any]) -> None:
    text = render(summary_renderables(result), 120)
    header = next(line for line in text.splitlines() if "world" in line)
    assert header.startswith("┃ world ┃") and "┃ rendezvous ┃" in header and "┃ to 1st step ┃" in header
    assert_rows(text, [stage_cells(s) for s in result["stages"]])


@pytest.mark.parametrize("width", [60, 80])
@pytest.mark.parametrize("scale", [1, 100_000])  # as measured here, and GPU-sized GFLOP/s ("93,412")
def test_the_workload_table_keeps_numbers_whole(result: dict[str, Any], width: int, scale: int) -> None:
    scaled = copy.deepcopy(result)
    summary = scaled["summary"]
    for row in summary["rows"]:
        row["gflops"] *= scale
        row["gflops_per_rank"] *= scale
    table = [t for t in summary_renderables(scaled) if getattr(t, "title", None) == summary["title"]]  # the workload's own
    assert len(table) == 1
    text = render(table, width)
    assert_fits(text, width)
    # numbers and single tokens stay whole on their row; a column of words (a note) may wrap
    numeric = [c for c in summary["columns"] if not any(" " in _cell(row[c]) for row in summary["rows"])]
    lines = [CELLS.findall(line) for line in text.splitlines()]
    for row in summary["rows"]:
        cells = [_cell(row[c]) for c in numeric]
        assert any(line[: len(cells)] == cells for line in lines), f"no line holds {cells}:\n{text}"


@pytest.mark.parametrize("out", ["runs", "a/much/longer/directory/for/the/runs/of/this/team/than/a/line/holds"])
def test_the_dry_run_plan_keeps_log_paths_whole_on_a_line_of_their_own(tmp_path: Path, out: str) -> None:
    """A log path in a table column was folded mid-word at 80 columns ("runs/matmul_s│caling/..."):
    each is printed under its stage's table, whole on one line, however long (never wrapped)."""
    dry = dry_run(load_job(JOB), out=tmp_path / out)
    things = plan_renderables(dry.plans, dry.requests)
    console = Console(width=80, record=True, file=io.StringIO())
    for thing in things:  # as `launch --dry-run` prints them: its Text lines are never wrapped
        console.print(thing, soft_wrap=isinstance(thing, Text))
    text = console.export_text()
    lines = text.splitlines()
    for plan in dry.plans:
        for r in plan.ranks:
            path = str(plan.paths.log(r.rank))
            assert f"rank {r.rank} log: {path}" in lines, text
            short = [str(r.rank), str(r.node_rank), r.host, str(r.local_rank), r.device, plan.pg_backend]
            assert any(cells == short for cells in map(CELLS.findall, lines)), text
        assert f"{plan.job}: world size {plan.world_size}, rendezvous {plan.rendezvous}" in lines  # its title, on one line
    tables = [line for line in lines if line.startswith(("┃", "│", "┏", "└"))]
    assert tables and all(len(line) <= 80 for line in tables) and "…" not in text


def test_the_device_table_keeps_uuids_whole_at_80_columns() -> None:
    csv = (REPO / "tests" / "unit" / "data" / "nvidia_smi_h100x4.csv").read_text()
    inv = NodeInventory("gpu-node-017.cluster.internal", 224, tuple(parse_nvidia_smi_csv(csv)))
    text = render(devices_table(inv, 2), 80)
    assert_fits(text, 80)
    joined = "".join(CELLS.findall(text))
    for gpu in inv.gpus:
        assert gpu.uuid in joined
        assert f"{gpu.memory_used_mib} / {gpu.memory_total_mib}" in text


def test_the_summary_lists_each_timer_with_its_median_and_count(result: dict[str, Any]) -> None:
    """What the job timed with ctx.metrics.timer (matmul: one timer per size) is in the summary:
    per stage and timer, the median block over every rank, the count of blocks and of ranks."""
    from statistics import median

    text = render(summary_renderables(result), 80)
    assert_fits(text, 80)
    assert "timers (ctx.metrics.timer)" in text
    timed = [(r["world_size"], name, times) for r in result["ranks"] for name, times in r["metrics"]["times_ms"].items()]
    assert timed, result["ranks"]
    for world, name, times in timed:
        shown = _duration(median(times)).split()
        assert_rows(text, [[str(world), name, *shown, str(len(times)), "1"]])


def test_timers_beyond_the_cap_are_counted_and_durations_take_their_unit(result: dict[str, Any]) -> None:
    many = copy.deepcopy(result)
    many["ranks"][0]["metrics"]["times_ms"] = {f"t{i:02d}": [float(i)] for i in range(MAX_TIMER_ROWS + 3)}
    text = render(timer_renderables(many), 80)
    assert "t00" in text and f"t{MAX_TIMER_ROWS - 1}" in text and f"t{MAX_TIMER_ROWS}" not in text
    assert "3 more timer row(s) not shown" in text
    assert [_duration(x) for x in (None, 0.0123, 12.345, 4560.0, 7.2e6)] == ["-", "12.3 µs", "12.3 ms", "4.56 s", "7,200 s"]
    nothing = copy.deepcopy(result)
    for r in nothing["ranks"]:
        r["metrics"]["times_ms"] = {}
    assert timer_renderables(nothing) == [] and "timers" not in render(summary_renderables(nothing), 80)


def test_a_workload_summary_without_a_title_still_shows_its_table(result: dict[str, Any]) -> None:
    untitled = copy.deepcopy(result)
    untitled["summary"]["title"] = None
    text = render(summary_renderables(untitled), 80)
    assert "summary" in text and "gflops" in text


def test_tracebacks_lose_the_launchers_own_frames_and_keep_the_jobs() -> None:
    from launcher.ui.console import job_frames

    tb = [
        "Traceback (most recent call last):",
        '  File "/x/launcher/runtime/worker.py", line 219, in run_rank',
        "    rank.run_entry(entry, device)",
        '  File "/x/launcher/runtime/worker.py", line 177, in run_entry',
        "    r.result = _jsonable(entry(ctx))",
        "                         ^^^^^^^^^^",
        '  File "/home/me/train.py", line 37, in run',
        "    raise ValueError('bad batch')",
        "ValueError: bad batch",
        "an ordinary line after it",
    ]
    assert job_frames(tb) == [tb[0], *tb[6:]]


def test_a_failure_prints_its_root_cause_once_and_an_interrupt_is_no_failure() -> None:
    from launcher.ui.console import failure_renderables

    root = {"host": "h", "rank": 1, "local_rank": 1, "device": "cpu", "type": "ValueError", "message": "bad",
            "traceback": 'Traceback (most recent call last):\n  File "/x/launcher/runtime/worker.py", line 1, in run_rank\n'
                         '    x()\n  File "/me/train.py", line 2, in run\n    raise ValueError("bad")\nValueError: bad',
            "log_tail": ["ValueError: bad"], "hint": None}
    failure = {"reason": "failed", "summary": "rank 1 on h (cpu): ValueError: bad", "root_cause": root, "collateral_ranks": [0]}
    shown = render(failure_renderables(failure, traceback_shown=True), 80)
    assert "(its traceback is above)" in shown and "Traceback" not in shown and "last lines" not in shown
    quiet = render(failure_renderables(failure), 80)  # --quiet: the traceback was not shown live
    assert quiet.count("Traceback (most recent call last):") == 1 and "/me/train.py" in quiet and "worker.py" not in quiet
    interrupted = render(failure_renderables({"reason": "interrupted", "summary": "interrupted (SIGINT)", "collateral_ranks": []}), 80)
    assert interrupted.startswith("INTERRUPTED: interrupted (SIGINT)") and "FAILED" not in interrupted and "collateral" not in interrupted
