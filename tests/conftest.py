"""Shared test helpers: the repo root, an in-process CLI runner, and process-table checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]

# Every launch the suite starts (here or in a child, which inherits the environment) announces its
# metrics endpoint in a directory of the suite's own, never /tmp/gpulaunch/prom_sd/, which a real
# Prometheus may watch (launcher/monitoring/endpoint.py: SD_DIR_ENV). Each xdist worker (and the
# controller) makes its own and removes it at its end; every child that imports this module (a job
# of the test tree) finds its worker's in the environment: none left behind (a folder per
# importing process was: 383 of them in /tmp).
_SUITE_SD_ENV = f"GPULAUNCH_TEST_PROM_SD_DIR_{os.environ.get('PYTEST_XDIST_WORKER', 'main').upper()}"
_SD_MADE_HERE = not os.environ.get(_SUITE_SD_ENV)
PROM_SD_DIR = Path(tempfile.mkdtemp(prefix="gpulaunch-test-prom-sd-") if _SD_MADE_HERE else os.environ[_SUITE_SD_ENV])
os.environ[_SUITE_SD_ENV] = os.environ["GPULAUNCH_PROM_SD_DIR"] = str(PROM_SD_DIR)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SD_MADE_HERE:
        shutil.rmtree(PROM_SD_DIR, ignore_errors=True)


# Under pytest-xdist (``pytest -n 3``) every test file is a unit that runs on one worker (its
# module-scoped fixtures are built once), except a directory whose tests share a rig that is slow
# to build once per package: tests/ray's Ray head. The units spread over the workers, the long ones
# first (real clusters, then real processes), the unit tests last. The Slurm and sshd rigs come up
# in about a second, so each file there builds its own, in network namespaces of its own.
SHARED_RIG_DIRECTORIES = ("ray",)
# The order units start in: the longest first (tests/ray's ~2 min on one worker, the benchmark
# smoke's single 40 s test), so that no long unit is left to run alone at the end.
RUN_FIRST = ("ray", "benchmarks", "slurm", "cluster", "jobs", "integration", "monitoring")


def xdist_unit_of(nodeid: str) -> str:
    """The worker-unit of a test id (``tests/ray/test_x.py::test_y`` -> ``ray``)."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")[1:] if path.startswith("tests/") else path.split("/")
    return parts[0] if parts and parts[0] in SHARED_RIG_DIRECTORIES else path


try:  # the test extra has pytest-xdist; without it the suite runs in one process
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pragma: no cover
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class RigScheduling(LoadScopeScheduling):
        """xdist's load-by-scope scheduling with our units as the scopes (xdist's own
        ``--dist loadgroup`` marks do not reach the scheduler under pytest 9)."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit_of(nodeid)

    @pytest.hookimpl(optionalhook=True)  # `pytest -p no:xdist` has no such hook
    def pytest_xdist_make_scheduler(config, log):  # noqa: ANN001, ANN201
        return RigScheduling(config, log)


def _run_order(item: pytest.Item) -> int:
    top = item.nodeid.split("/")[1] if item.nodeid.startswith("tests/") else ""
    return RUN_FIRST.index(top) if top in RUN_FIRST else len(RUN_FIRST)


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    import shutil

    items.sort(key=_run_order)  # stable: a file's tests keep their order
    has_gpu = shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, check=False
    ).returncode == 0
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        # the marker, not the keywords: a test's keywords hold its folders' names (tests/gpu/ has unmarked tests)
        if item.get_closest_marker("gpu") is not None:
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
