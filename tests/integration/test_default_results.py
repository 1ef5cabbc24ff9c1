"""A job without hooks still gets results: every logged series per rank in the summary's table,
each stage's step rate in words, and a line plot per stage (one panel per series, ranks as lines)."""

from __future__ import annotations

from launcher import RunEvents, run_job
from tests.conftest import REPO

SPEC = """\
name: user_mlp
entrypoint: tests.integration.user_mlp:run
env: {PYTHONPATH: %s}
resources: {cpu_workers: 2}
scaling: {workers: [1, 2]}
"""


def test_a_job_without_hooks_gets_its_series_summarised_and_plotted(tmp_path, capsys):
    spec = tmp_path / "user.yaml"
    spec.write_text(SPEC % REPO)
    run = run_job(spec, out=tmp_path / "runs", events=RunEvents(), metrics=False)
    assert run.ok, run.data.get("failure")
    summary = run.data["summary"]
    rows = {(r["workers"], r["series"], r["rank"]): r for r in summary["rows"]}
    assert set(rows) == {(1, "loss", 0), (1, "lr", 0), (2, "loss", 0), (2, "loss", 1), (2, "lr", 0), (2, "lr", 1)}
    assert all(r["count"] == 60 for r in rows.values())
    assert rows[(2, "lr", 1)]["mean"] == 0.05 and rows[(2, "loss", 0)]["min"] <= rows[(2, "loss", 0)]["mean"] <= rows[(2, "loss", 0)]["max"]
    assert [s["world_size"] for s in summary["step_rates"]] == [1, 2] and all(s["steps_per_s"] > 0 for s in summary["step_rates"])
    assert any(line.startswith("world size 2: ") and "steps/s per rank" in line for line in summary["conclusions"])
    assert run.data["plots"] == ["series_world1.png", "series_world2.png"]
    assert all((run.run_dir / p).stat().st_size > 10_000 for p in run.data["plots"])
    # the run is listed, and `launch report` on the job's directory renders this latest run
    from launcher.ui.cli import main

    assert main(["runs", "--out", str(tmp_path / "runs")]) == 0
    assert main(["report", str(tmp_path / "runs" / "user_mlp")]) == 0
    shown = capsys.readouterr().out
    assert run.run_dir.name in shown and "succeeded" in shown
    assert f"plot: {run.run_dir}/series_world2.png" in shown.replace("\n", "")
