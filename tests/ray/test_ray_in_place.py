"""Recovery in place on the Ray backend when it does not work out: the driver, which replaces a
lost actor (``launcher.backends.ray_inplace``), gives the generation up and the loss takes the
restart path, unchanged, from the last checkpoint on disk. (The recovery that works, with the
shipped ``ddp_train``: ``test_ray_resume.py``.)

The job is ``tests/integration/in_place_job.py`` (its victim SIGKILLs itself at a fixed step; a
replacement exits before it joins, or joins and sleeps); as the backend's other tests, the runs
call ``launcher.run_job`` in this process, connected as a Ray driver to the session's head. The
deadlines are hang guards only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

import launcher
from tests.integration.faultkit import write_spec
from tests.ray.conftest import RayHead, assert_ray_run_left_nothing, descendants, wait_no_orphans

pytestmark = pytest.mark.slow

ENTRY = "tests.integration.in_place_job:run"


def _run(tmp_path: Path, name: str, max_restarts: int = 0, **params: Any) -> dict[str, Any]:
    baseline = descendants(os.getpid())
    spec = write_spec(tmp_path, name=name, entrypoint=ENTRY, max_restarts=max_restarts, timeouts={"rendezvous_s": 120, "run_s": 400},
                      params={"steps": 30, "checkpoint_every": 10, "marker": str(tmp_path / f"{name}.killed"), **params})  # fmt: skip
    result = launcher.run_job(spec, backend="ray", out=tmp_path / "runs", events=launcher.RunEvents(), metrics=False)
    doc: dict[str, Any] = json.loads((Path(result.run_dir) / "result.json").read_text())
    assert result.exit_code == 0, doc.get("failure")
    pids = [r["pid"] for r in doc["ranks"] if isinstance(r.get("pid"), int)]
    if (tmp_path / f"{name}.killed").exists():
        pids.append(int((tmp_path / f"{name}.killed").read_text()))
    from tests.ray.conftest import DRIVER

    assert DRIVER.head is not None
    assert_ray_run_left_nothing(DRIVER.head, name, pids)
    assert wait_no_orphans(baseline) == [], "a process of the run is still alive under pytest"
    return doc


def _hashes(result: dict[str, Any]) -> set[str]:
    return {r["result"]["model_sha256"] for r in result["ranks"]}


@pytest.fixture(scope="module")
def uninterrupted(ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    from tests.ray.conftest import DRIVER

    DRIVER.connect(ray_head)
    result = _run(tmp_path_factory.mktemp("ray-clean"), "clean")
    assert result["stages"][0]["attempts"][0]["steps"] == 30
    yield _hashes(result)


def test_a_replacement_actor_that_cannot_join_falls_back_to_the_restart_path(ray_driver: RayHead, tmp_path: Path, uninterrupted: set[str]) -> None:
    result = _run(tmp_path, "fallback", max_restarts=1, kill_at=17, victim=1, replacement="fail")
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 1, stage
    first, second = stage["attempts"]
    assert first["failure_class"] == "rank_lost" and first["restarted"], first  # the lost rank, as without recovery in place
    assert second["resumed_step"] == 10, second  # from the last checkpoint on disk
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "restart" and recovery["why"] == "the replacement ended before it joined", recovery
    assert _hashes(result) == uninterrupted


def test_a_recovery_that_times_out_takes_the_restart_path(ray_driver: RayHead, tmp_path: Path, uninterrupted: set[str]) -> None:
    result = _run(tmp_path, "stuck", max_restarts=1, kill_at=17, victim=1, replacement="hang", wait_s=5)
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 1 and stage["attempts"][1]["resumed_step"] == 10, stage
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "restart" and recovery["why"] == "no recovery within wait_s=5s", recovery
    assert _hashes(result) == uninterrupted
