"""A real Prometheus for the monitoring tests: started from a config file, listening on a free
127.0.0.1 port, its TSDB in the test's tmp dir, killed by pid in a finalizer (even on failure).

And a discovery directory of the session's own: no launch of these tests announces itself in
/tmp/gpulaunch/prom_sd/, the directory a real Prometheus on this machine may watch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from launcher.monitoring.endpoint import DEFAULT_SD_DIR, SD_DIR_ENV
from tests.ports import unshared_port
from tests.waiting import poll


@pytest.fixture(scope="session", autouse=True)
def private_sd_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """GPULAUNCH_PROM_SD_DIR for the session, unless it names a private directory already (the
    suite's conftest sets one for every test folder): every launch here, in this process or a child
    (children inherit the environment), writes its file-SD entry there."""
    current = os.environ.get(SD_DIR_ENV)
    if current and Path(current) != DEFAULT_SD_DIR:
        yield Path(current)
        return
    path = tmp_path_factory.mktemp("prom_sd")
    os.environ[SD_DIR_ENV] = str(path)
    try:
        yield path
    finally:
        if current is None:
            os.environ.pop(SD_DIR_ENV, None)
        else:
            os.environ[SD_DIR_ENV] = current


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    value = poll(predicate, timeout_s, interval_s)
    if not value:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {value!r})")
    return value


@dataclass
class Prometheus:
    proc: subprocess.Popen
    url: str
    log: Path

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
            doc = json.load(resp)
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict[str, Any]]:
        """A range query's matrix: [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}")
        assert data["resultType"] == "matrix", data
        return data["result"]

    def active_targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or next((p for p in ("/usr/bin/prometheus",) if os.access(p, os.X_OK)), None)


@pytest.fixture
def start_prometheus(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[[Path], Prometheus]:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("needs the `prometheus` binary (apt-get install prometheus)")

    def start(config: Path) -> Prometheus:
        for _attempt in range(3):  # a free port can be taken between probing and binding
            port = unshared_port()
            log = tmp_path / f"prometheus-{port}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / f'tsdb-{port}'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )
            request.addfinalizer(lambda proc=proc: _stop(proc))
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
                        if resp.status == 200:
                            return Prometheus(proc, url, log)
                except OSError:
                    time.sleep(0.2)
            _stop(proc)
            if "address already in use" not in log.read_text(errors="replace"):
                break
        raise AssertionError(f"prometheus did not become ready:\n{log.read_text(errors='replace')[-3000:]}")

    return start


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)
