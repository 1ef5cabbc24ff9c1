"""Helpers for the d2l "GPUs" job suite: run a job for real (torchrun, gloo on the CPU) and load its result."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import launch, pids_mentioning

PNG = b"\x89PNG\r\n\x1a\n"


@dataclass
class JobRun:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    result: dict[str, Any]

    @property
    def summary(self) -> dict[str, Any]:
        return self.result["summary"]

    def ranks(self, world_size: int | None = None) -> list[dict[str, Any]]:
        return [r for r in self.result["ranks"] if world_size is None or r["world_size"] == world_size]


def run_job(out: Path, job: str, *sets: str, backend: str | None = None) -> JobRun:
    """``launch jobs/<job>.yaml --set ... --out <out>`` in a child process, then its result.json."""
    args = [f"jobs/{job}.yaml", *(a for s in sets for a in ("--set", s)), "--out", str(out)]
    if backend:
        args += ["--backend", backend]
    done = launch(*args)
    runs = sorted((out / job).iterdir()) if (out / job).is_dir() else []
    assert runs, f"no run directory under {out / job}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    run_dir = runs[-1]
    result = json.loads((run_dir / "result.json").read_text())
    assert pids_mentioning(str(run_dir)) == [], "processes of the run are still alive"
    return JobRun(done.returncode, done.stdout, done.stderr, run_dir, result)


def assert_succeeded(run: JobRun, job: str, world_sizes: list[int]) -> None:
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    r = run.result
    assert r["schema_version"] == 1
    assert (r["job"], r["status"]) == (job, "succeeded")
    assert r["world_sizes"] == world_sizes
    for ws in world_sizes:
        ranks = run.ranks(ws)
        assert sorted(x["rank"] for x in ranks) == list(range(ws))
        assert all(x["status"] == "ok" and x["device"] == "cpu" for x in ranks)


def assert_plots(run: JobRun, *names: str) -> None:
    assert sorted(run.result["plots"]) == sorted(names)
    for name in names:
        data = (run.run_dir / name).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, name


# ddp_train at a size that trains in seconds on a CPU
TINY_TRAIN = ["params.n_train=1024", "params.n_test=256", "params.hidden=32", "params.batch_size=128"]


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jobs")
