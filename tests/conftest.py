"""Shared test helpers: the repo root, an in-process CLI runner, and process-table checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    import shutil

    has_gpu = shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, check=False
    ).returncode == 0
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo() -> Path:
    return REPO


def launch(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the real `launch` console script in a child process (as a user would)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment mentions ``text`` (e.g. a run directory).

    The environment counts because ranks forked from a forkserver carry their server's command
    line; every process of a stage has ``GPULAUNCH_STAGE_DIR`` in its environment."""
    found = []
    for proc in psutil.process_iter(["pid", "status", "cmdline", "environ"]):
        info = proc.info  # a field psutil may not read (another user's, a zombie's) is None
        if info["pid"] == os.getpid() or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        args = "\0".join(info["cmdline"] or [])
        env = "\0".join(f"{k}={v}" for k, v in (info["environ"] or {}).items())
        if text in args or text in env:
            found.append(info["pid"])
    return found
