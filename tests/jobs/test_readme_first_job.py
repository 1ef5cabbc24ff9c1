"""The README's first command does what the README shows: ``launch jobs/matmul_scaling.yaml``
run as a user runs it (piped, a 100-column terminal as the README's block says) prints the same
stages, the same tables with the same columns and the same kinds of notes. The figures differ
from machine to machine; the shape of what a newcomer reads first must not drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def _readme_output() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## The first job's output", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "README: no ```text block under 'The first job's output'"
    return block.group(1).splitlines()


def _columns(lines: list[str]) -> list[list[str]]:
    """Each table's column names: its header rows (``┃ ... ┃`` between ``┏`` and ``┡``) read down
    each column, as rich wraps a long name over two rows where the figures leave it less room."""
    tables, rows = [], None
    for ln in lines:
        if ln.startswith("┏"):
            rows = []
        elif ln.startswith("┡") and rows is not None:
            cells = [[c.strip() for c in row.strip("┃").split("┃")] for row in rows]
            tables.append([" ".join(filter(None, col)).replace("_ ", "_") for col in zip(*cells)])
            rows = None
        elif rows is not None and ln.startswith("┃"):
            rows.append(ln)
    return tables


def _shape(lines: list[str]) -> dict[str, list]:
    """What must match: the stage lines, each table's title and columns, and the plot and run
    directory lines without their paths."""
    return {
        "stages": [ln.strip() for ln in lines if ln.startswith("▶")],
        "columns": _columns(lines),
        "titles": [ln.strip() for ln in lines if ln.strip() and ln.startswith(" ") and not ln.startswith(" •")],
        "ends": [ln.split(":", 1)[0] for ln in lines if ln.startswith(("plot:", "run directory:"))],
    }


def test_the_first_command_prints_what_the_readme_shows(tmp_path) -> None:
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "launcher", "jobs/matmul_scaling.yaml", "--out", str(tmp_path / "runs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip  (a hang guard)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = (done.stderr + done.stdout).splitlines()
    readme, ours = _shape(_readme_output()), _shape(printed)
    assert ours == readme, "\n".join(printed)
    assert any(re.fullmatch(r"launcher: metrics: http://127\.0\.0\.1:\d+/metrics", ln) for ln in printed), printed[:5]
