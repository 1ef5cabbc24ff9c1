"""Recovery in place with real torchrun processes on CPU (issue 36): a rank SIGKILLed mid-run is
replaced while its peer keeps its process, without a restart of the group, its story in
``result.json``, and the final model equal, bit for bit, to an uninterrupted run's; and a
replacement that cannot join hands the loss to the restart path, which resumes from disk.

Timing-proof: the victim kills itself at a fixed step (``in_place_job.py``), the steps are
bounded, the data order is the step's, and no duration is asserted: the deadlines are hang
guards only (a launch here takes seconds; the guards are minutes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.faultkit import Launched, describe, result_of, wait_no_pids, write_spec

ENTRY = "tests.integration.in_place_job:run"
HANG_GUARD_S = 400


def _run(tmp_path: Path, name: str, max_restarts: int = 0, spec_extra: dict[str, Any] | None = None, **params: Any) -> dict[str, Any]:
    spec = write_spec(
        tmp_path,
        name=name,
        entrypoint=ENTRY,
        params={"steps": 30, "checkpoint_every": 10, "marker": str(tmp_path / f"{name}.killed"), **params},
        max_restarts=max_restarts,
        timeouts={"rendezvous_s": 120, "run_s": HANG_GUARD_S},
        **(spec_extra or {}),
    )
    out = tmp_path / f"{name}-runs"
    run = Launched(spec, out)
    try:
        code = run.wait(HANG_GUARD_S + 60)
        run_dir = run.run_dir()
        result = result_of(run_dir)
        assert code == 0, run.output()
        left, _ = wait_no_pids(str(out), 60)
        assert left == [], f"processes of the run remain:\n{describe(left)}"
        result["_run_dir"] = str(run_dir)
        result["_log"] = run.log.name
        return result
    finally:
        run.close()


def _hashes(result: dict[str, Any]) -> set[str]:
    return {r["result"]["model_sha256"] for r in result["ranks"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    result = _run(tmp_path_factory.mktemp("clean"), "clean")
    assert result["stages"][0]["attempts"][0]["steps"] == 30
    return _hashes(result)


def test_a_rank_killed_mid_run_is_replaced_in_place(tmp_path: Path, uninterrupted: set[str]) -> None:
    result = _run(tmp_path, "killed", max_restarts=1, kill_at=17, victim=1)
    assert (tmp_path / "killed.killed").exists()  # the fault happened
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 0, stage  # no restart of the group
    assert len(stage["attempts"]) == 1, stage["attempts"]
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "in_place" and recovery["dead_ranks"] == [1], recovery
    assert recovery["resumed_step"] == 17 and recovery["steps_lost"] == 0, recovery
    assert recovery["recovery_s"] is not None and recovery["state_bytes"] > 0, recovery
    record = json.loads((Path(result["_run_dir"]) / "world2/in_place/attempt0/gen1.json").read_text())
    assert record["dead_pids"] == [int((tmp_path / "killed.killed").read_text())], record
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert ranks[1]["result"]["first_step"] == 17 and ranks[1]["result"]["gen"] == 1  # the replacement went on from its peer's step
    assert (
        ranks[0]["result"]["first_step"] == 0
        and ranks[0]["pid"] == json.loads((Path(result["_run_dir"]) / "world2/in_place/attempt0/armed.rank0.json").read_text())["pid"]
    )  # the survivor kept its process
    assert _hashes(result) == uninterrupted  # bit for bit


def test_a_replacement_that_cannot_join_falls_back_to_the_restart_path(tmp_path: Path, uninterrupted: set[str]) -> None:
    result = _run(tmp_path, "fallback", max_restarts=1, kill_at=17, victim=1, replacement="fail")
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 1, stage
    first, second = stage["attempts"]
    assert first["failure_class"] == "rank_lost" and first["restarted"], first  # the lost rank, as without the keeper
    assert second["resumed_step"] == 10, second  # from the last checkpoint on disk
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "restart" and "replacement ended" in recovery["why"], recovery
    assert _hashes(result) == uninterrupted


def test_a_recovery_that_times_out_names_where_each_rank_was_and_takes_the_restart_path(tmp_path: Path, uninterrupted: set[str]) -> None:
    result = _run(tmp_path, "stuck", max_restarts=1, kill_at=17, victim=1, replacement="hang", wait_s=5)
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 1 and stage["attempts"][1]["resumed_step"] == 10, stage
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "restart" and recovery["why"] == "no recovery within wait_s=5s", recovery
    stuck = {line.split(" (pid ")[0]: line for line in recovery["stuck"]}
    assert sorted(stuck) == ["rank 0", "rank 1"], recovery  # the keeper read both before it fell back
    assert "in_place_job.py:" in stuck["rank 1"] and "time.sleep(3600)" in stuck["rank 1"], stuck  # the replacement that never took the state
    assert "peerstate.py:" in stuck["rank 0"] or "inplace.py:" in stuck["rank 0"], stuck  # the survivor, sending it
    output = Path(result["_log"]).read_text(errors="replace")
    assert stuck["rank 1"] in output, output[-3000:]  # the console's summary says it too
    assert _hashes(result) == uninterrupted


def test_a_warm_spare_takes_the_lost_ranks_place_with_its_start_done_ahead(tmp_path: Path, uninterrupted: set[str]) -> None:
    prepared_log = tmp_path / "prepared.log"
    spare = {"prepare": "tests.integration.in_place_job:prepare", "checkpoint": {"warm_spares": 1}}
    result = _run(tmp_path, "spare", max_restarts=1, spec_extra=spare, kill_at=17, victim=1, await_spare=True, prepared_log=str(prepared_log))
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 0, stage
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "in_place" and recovery["replacements"] == ["warm spare"], recovery
    assert recovery["resumed_step"] == 17 and recovery["steps_lost"] == 0, recovery
    folder = Path(result["_run_dir"]) / "world2/in_place/attempt0"
    ranks = {r["rank"]: r for r in result["ranks"]}
    replacement = ranks[1]["result"]["pid"]
    assert (folder / f"spare.{replacement}.json").exists()  # the rank that took the place is the spare that prepared
    assert ranks[1]["result"]["first_step"] == 17 and ranks[1]["result"]["gen"] == 1
    prepared = [int(line) for line in prepared_log.read_text().split()]
    # each process prepared once: both ranks, the spare that became rank 1 (not again as a rank),
    # and the spare forked after the recovery (stopped unused at the end: no process is left)
    killed = int((tmp_path / "spare.killed").read_text())
    assert {ranks[0]["result"]["pid"], killed, replacement} <= set(prepared) and len(prepared) == len(set(prepared)), prepared
    assert len(prepared) in (3, 4), prepared  # the next spare may not have been forked before the run ended
    assert _hashes(result) == uninterrupted  # bit for bit


def test_a_spare_that_died_waiting_leaves_the_loss_to_a_fork_and_no_spare_follows(tmp_path: Path, uninterrupted: set[str]) -> None:
    prepared_log = tmp_path / "prepared.log"
    spare = {"prepare": "tests.integration.in_place_job:prepare", "checkpoint": {"warm_spares": 1}}
    result = _run(tmp_path, "dead-spare", max_restarts=1, spec_extra=spare, kill_at=17, victim=1, await_spare=True, spare_dies=True,
                  prepared_log=str(prepared_log))  # fmt: skip
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 0, stage
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "in_place" and recovery["replacements"] == ["forked"] and recovery["steps_lost"] == 0, recovery
    prepared = [int(line) for line in prepared_log.read_text().split()]
    replacement = {r["rank"]: r for r in result["ranks"]}[1]["result"]["pid"]
    assert len(prepared) == 4 and prepared[3] == replacement, prepared  # two ranks, the spare that died, the fork: no second spare
    assert "a warm spare ended (exit 5) before it was needed; no more spares this attempt" in Path(result["_log"]).read_text()
    assert _hashes(result) == uninterrupted
