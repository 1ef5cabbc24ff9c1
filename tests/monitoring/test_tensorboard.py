"""Every ctx.metrics series as TensorBoard scalars: written once, read back with TensorBoard's own
reader, one run per world size under <run_dir>/tensorboard/world<N>."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from launcher.results import tensorboard as tb


def rank(world_size: int, k: int, values: dict, times: dict | None = None, **extra) -> dict:
    return {"world_size": world_size, "rank": k, "status": "ok",
            "metrics": {"steps": max((len(v) for v in values.values()), default=0), "values": values, "times_ms": times or {}}, **extra}


RESULT = {
    "job": "train", "run_id": "20260101-000000-abcd", "finished_at": 1_767_225_600.0, "world_sizes": [1, 2],
    "ranks": [
        rank(1, 0, {"loss": [2.0, 1.5, 1.25], "train/acc": [0.1, 0.5, 0.9]}, {"step": [11.0, 10.0, 10.5]}),
        rank(2, 0, {"loss": [2.0, 1.0]}, {"step": [6.0, 5.5]}),
        rank(2, 1, {"loss": [2.5, 1.5]}, {"step": [6.5, 6.0]}),
    ],
}


def read(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_series_by_world_size_and_tag_without_tensorboard():
    series = tb.scalar_series(RESULT)
    assert series == {
        1: {"loss/rank0": [2.0, 1.5, 1.25], "train/acc/rank0": [0.1, 0.5, 0.9], "time_ms/step/rank0": [11.0, 10.0, 10.5]},
        2: {"loss/rank0": [2.0, 1.0], "time_ms/step/rank0": [6.0, 5.5], "loss/rank1": [2.5, 1.5], "time_ms/step/rank1": [6.5, 6.0]},
    }


def test_event_files_read_back_with_the_logged_values(tmp_path):
    pytest.importorskip("tensorboard")
    files = tb.write_scalars(RESULT, tmp_path)
    assert [f.parent.name for f in files] == ["world1", "world2"]  # one TensorBoard run per world size
    assert all(f.name.startswith("events.out.tfevents.") and f.parent.parent == tmp_path / "tensorboard" for f in files)

    one = read(tmp_path / "tensorboard" / "world1")
    assert one["loss/rank0"] == [(0, 2.0), (1, 1.5), (2, 1.25)]
    assert one["train/acc/rank0"] == [(0, pytest.approx(0.1)), (1, pytest.approx(0.5)), (2, pytest.approx(0.9))]
    assert one["time_ms/step/rank0"] == [(0, 11.0), (1, 10.0), (2, 10.5)]
    two = read(tmp_path / "tensorboard" / "world2")
    assert set(two) == {"loss/rank0", "loss/rank1", "time_ms/step/rank0", "time_ms/step/rank1"}
    assert two["loss/rank1"] == [(0, 2.5), (1, 1.5)]
    assert two["time_ms/step/rank1"] == [(0, 6.5), (1, 6.0)]


def test_the_whole_runs_directory_shows_every_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    for run_id in ("run-a", "run-b"):
        tb.write_scalars({**RESULT, "run_id": run_id}, tmp_path / "runs" / "train" / run_id)
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path / "runs"))  # what `tensorboard --logdir runs/` does
    mux.Reload()
    assert set(mux.Runs()) == {f"train/{r}/tensorboard/world{n}" for r in ("run-a", "run-b") for n in (1, 2)}


def test_writing_again_replaces_the_files_instead_of_doubling_the_points(tmp_path):
    pytest.importorskip("tensorboard")
    tb.write_scalars(RESULT, tmp_path)
    files = tb.write_scalars(RESULT, tmp_path)  # e.g. `launch report` on the same run
    assert len(list((tmp_path / "tensorboard" / "world2").glob("events.out.tfevents.*"))) == 1
    assert len(files) == 2
    assert read(tmp_path / "tensorboard" / "world2")["loss/rank0"] == [(0, 2.0), (1, 1.0)]


def test_from_a_result_json_on_disk_with_failed_ranks_and_odd_names(tmp_path):
    pytest.importorskip("tensorboard")
    doc = {
        "finished_at": 1.0,
        "ranks": [
            rank(2, 0, {"my loss (avg)": [1.0, float("nan"), 3.0], "flag": [True]}),
            {"world_size": 2, "rank": 1, "status": "failed", "metrics": {}},  # died before reporting
            rank(2, 0, {"my loss (avg)": [4.0]}, restart=1),  # the group restarted: the last report wins
        ],
    }
    (tmp_path / "result.json").write_text(json.dumps(doc))
    files = tb.write_scalars(json.loads((tmp_path / "result.json").read_text()), tmp_path)
    assert len(files) == 1
    assert read(tmp_path / "tensorboard" / "world2") == {"my_loss__avg_/rank0": [(0, 4.0)]}
    assert tb.scalar_series({"ranks": [rank(1, 0, {"x": [1.0, "bad", None]})]})[1]["x/rank0"][0] == 1.0
    assert all(math.isnan(v) for v in tb.scalar_series({"ranks": [rank(1, 0, {"x": ["bad", None]})]})[1]["x/rank0"])


def test_nothing_to_write_or_no_tensorboard_is_no_error(tmp_path, monkeypatch):
    assert tb.write_scalars({"ranks": []}, tmp_path) == []
    assert tb.write_scalars({"ranks": [{"world_size": 1, "rank": 0, "metrics": {}}]}, tmp_path) == []
    monkeypatch.setattr(tb, "available", lambda: False)  # the optional extra is not installed
    assert tb.write_scalars(RESULT, tmp_path) == []
    assert not (tmp_path / "tensorboard").exists()


def test_writing_imports_no_torch(tmp_path):
    """The launcher writes the events at the end of every run: torch's SummaryWriter would cost it a
    1.5 s import of torch for a handful of scalars."""
    pytest.importorskip("tensorboard")
    code = (
        "import json, sys\n"
        "from launcher.results import tensorboard as tb\n"
        f"files = tb.write_scalars(json.loads(sys.argv[1]), {str(tmp_path)!r})\n"
        "print('FILES', len(files), 'TORCH', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps(RESULT)], capture_output=True, text=True, check=True)
    assert "FILES 2 TORCH False" in done.stdout, done.stdout + done.stderr
    assert read(tmp_path / "tensorboard" / "world2")["loss/rank1"] == [(0, 2.5), (1, 1.5)]
