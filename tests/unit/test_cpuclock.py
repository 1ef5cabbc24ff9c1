"""The launcher's own CPU seconds by phase (launcher.control.cpuclock): what result.json keeps."""

from __future__ import annotations

import launcher.control.cpuclock as cpuclock


def _spin(seconds: float) -> None:
    start = cpuclock.cpu_s()
    while cpuclock.cpu_s() - start < seconds:
        pass


def test_phases_add_up_and_split_before_spawn_from_after_exit(monkeypatch):
    clock = cpuclock.begin()  # "start": everything this process spent so far
    _spin(0.02)
    cpuclock.mark("preflight")
    cpuclock.mark("spawn")
    _spin(0.02)
    cpuclock.mark("running")  # the stage's processes are gone: from here on it is after_exit
    _spin(0.02)
    cpuclock.mark("stage_end")
    got = cpuclock.record()  # marks "results"
    assert clock is cpuclock._clock
    phases = got["by_phase"]
    assert list(phases) == ["start", "preflight", "spawn", "running", "stage_end", "results"]
    assert all(v >= 0 for v in phases.values())
    assert phases["preflight"] >= 0.019 and phases["running"] >= 0.019 and phases["stage_end"] >= 0.019
    # before_spawn: the CPU clock when the first spawn was marked, i.e. every phase before it
    assert abs(got["before_spawn"] - (phases["start"] + phases["preflight"] + phases["spawn"])) < 0.003
    assert abs(got["after_exit"] - (phases["stage_end"] + phases["results"])) < 0.003
    assert abs(got["total"] - sum(phases.values())) < 0.005
    assert got["total"] >= got["before_spawn"] + got["after_exit"]


def test_a_second_stage_adds_to_its_phases_and_after_exit_counts_from_the_last():
    cpuclock.begin()
    for _ in range(2):
        cpuclock.mark("plan")
        cpuclock.mark("spawn")
        cpuclock.mark("running")
        _spin(0.01)
        cpuclock.mark("stage_end")
    got = cpuclock.record()
    phases = got["by_phase"]
    assert list(phases) == ["start", "plan", "spawn", "running", "stage_end", "results"]
    assert got["after_exit"] < phases["stage_end"]  # the first stage's end (0.01 s) is not after the exit
    # each figure is rounded to the millisecond on its own: a sum of three rounded ones may be 1.5 ms short
    assert got["before_spawn"] <= phases["start"] + phases["plan"] + phases["spawn"] + 0.0015


def test_a_run_that_never_spawned_says_so():
    cpuclock.begin()
    got = cpuclock.record()
    assert got["before_spawn"] is None and got["after_exit"] is None and got["total"] > 0


def test_the_ci_benchmark_names_the_phase_that_grew():
    from benchmarks.launcher_cpu import REFERENCE_S, judge

    assert judge(dict(REFERENCE_S)) == []
    grown = {**REFERENCE_S, "metrics": 0.09}  # a phase over its own budget, the total within its
    assert [line.split(":")[0] for line in judge(grown)] == ["phase metrics"]
    heavier = {**REFERENCE_S, "start": 0.64, "before_spawn": 0.75}  # the total over, no phase over its own
    said = judge(heavier)
    assert said[0].startswith("total before_spawn: 0.750 s > budget") and said[-1].startswith("phase start grew the most")
