"""A checkpoint directory that cannot be used is bad input: one line naming the path, exit 2, no
traceback, nothing started, no run directory made; never a silent fresh start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.checkpoint_store import FileDigest, Manifest, job_identity, write_manifest
from tests.conftest import REPO, launch

SPEC = "name: ck\nentrypoint: launcher.workloads.matmul:run\nparams: {sizes: [8], iters: 1, trials: 1}\nscaling: {workers: [1]}\ncheckpoint: {dir: ckpt}\n"


def stage_checkpoint(root: Path, step: int, job: str = "ck", program: str = "launcher.workloads.matmul:run") -> Path:
    folder = root / f"step-{step:09d}"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"not read before the check")
    write_manifest(folder, Manifest(step, job, job_identity(job, program), "torch", 1, 0.0, files={"state.pt": FileDigest(25, "0" * 64)}))
    return folder


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "ck.yaml"
    path.write_text(SPEC)
    return path


def refused(spec: Path, out: Path) -> str:
    done = launch(str(spec), "--out", str(out), "--quiet")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not (out / "ck").exists()  # nothing started: not even a run directory
    return lines[0]


def test_another_jobs_checkpoint_is_refused_before_anything_starts(spec: Path, tmp_path: Path) -> None:
    folder = stage_checkpoint(tmp_path / "ckpt" / "world1", 4, job="other", program="other:run")
    line = refused(spec, tmp_path / "runs")
    assert line.startswith(f"error: checkpoint {folder}: written by another job ('other'"), line


def test_a_corrupted_manifest_is_refused_before_anything_starts(spec: Path, tmp_path: Path) -> None:
    folder = stage_checkpoint(tmp_path / "ckpt" / "world1", 4)
    (folder / "manifest.json").write_text(json.dumps({"step": 4})[:-3])
    line = refused(spec, tmp_path / "runs")
    assert line.startswith(f"error: checkpoint {folder / 'manifest.json'}: corrupted manifest"), line


def test_a_checkpoint_dir_that_cannot_be_written_is_refused(spec: Path, tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("a file where the directory should be")
    line = refused(spec, tmp_path / "runs")
    assert line.startswith(f"error: checkpoint.dir {tmp_path / 'ckpt' / 'world1'}: not writable"), line


def test_this_jobs_checkpoint_there_is_resumed_from(spec: Path, tmp_path: Path) -> None:
    """A checkpoint of this job in checkpoint.dir is no error: the run's job loads it (here it is
    unreadable garbage under a valid manifest: the rank's load fails on its digest, one line)."""
    folder = stage_checkpoint(tmp_path / "ckpt" / "world1", 4)
    done = launch(str(spec), "--out", str(tmp_path / "runs"), "--quiet", cwd=REPO)
    assert done.returncode == 1, done.stdout + done.stderr
    (run_dir,) = (tmp_path / "runs" / "ck").iterdir()
    assert f"world1: the job finds its checkpoint of step 4 in {folder.parent} and resumes from it" in done.stderr + done.stdout
    failure = json.loads((run_dir / "result.json").read_text())["failure"]
    assert failure["root_cause"]["type"] == "CheckpointError" and failure["failure_class"] == "job_error"
    assert failure["root_cause"]["message"].startswith(f"checkpoint {folder / 'state.pt'}: its contents differ from its manifest")
