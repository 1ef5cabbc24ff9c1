"""A hang on the Ray backend (embedded Ray): the stall is seen in the actors' drained beacons,
every rank's evidence is gathered on its own node by a task pinned there (an actor that sleeps
or is frozen cannot answer for itself), and the culprit is named with its line of the job."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.integration.test_hangs import CASES, line_of
from tests.ray.conftest import REPO, descendants, launch, wait_no_orphans

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("hang", sorted(CASES))
@pytest.mark.usefixtures("no_ray_driver")
def test_a_hung_actor_is_named_with_its_line_and_nothing_is_left(tmp_path: Path, hang: str) -> None:
    spec = tmp_path / "rayhang.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "rayhang", "entrypoint": "tests.integration.hang_job:run", "backend": "ray",
        "params": {"hang": hang, "rank": 1, "at": 20}, "resources": {"cpu_workers": 3},
        "timeouts": {"hang_s": 6, "run_s": 300}, "env": {"PYTHONPATH": str(REPO)},
    }))  # fmt: skip
    baseline = descendants(os.getpid())
    done = launch(str(spec), "--out", str(tmp_path / "runs"), "--no-metrics", timeout=240)
    assert done.returncode == 1, done.stderr[-3000:] + done.stdout[-3000:]
    results = list((tmp_path / "runs" / "rayhang").glob("*/result.json"))
    assert len(results) == 1, "no result.json:\n" + done.stderr[-3000:] + done.stdout[-3000:]
    (result_file,) = results
    result = json.loads(result_file.read_text())
    assert result["status"] == "hung" and result["backend"] == "ray"
    info = result["failure"]["hang"]
    why, marker = CASES[hang]
    (culprit,) = info["culprits"]
    assert culprit["rank"] == 1 and culprit["line"] == line_of(marker) and why in culprit["why"], info
    evidence = [json.loads((Path(info["evidence_dir"]) / f"evidence_rank{r}.json").read_text()) for r in range(3)]
    assert all(e["threads"] for e in evidence) and all(e["recorder"] for e in evidence if e["process_state"] != "stopped"), evidence
    assert wait_no_orphans(baseline) == []
