"""An embedded Ray listens on 127.0.0.1 only: every socket its processes listen on, checked with
``ss`` while a real run is live (Ray would otherwise use the machine's address and every interface)."""

from __future__ import annotations

import shutil
import subprocess

import psutil
import pytest

from launcher import RunEvents, run_job
from tests.conftest import REPO

SPEC = """\
name: loopback
entrypoint: launcher.workloads.matmul:run
params: {sizes: [128], iters: 200, trials: 3}
backend: ray
resources: {cpu_workers: 2}
scaling: {workers: [2]}
"""


def _listeners(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_an_embedded_ray_listens_on_loopback_only(tmp_path, monkeypatch):
    spec = tmp_path / "loopback.yaml"
    spec.write_text(SPEC)
    monkeypatch.syspath_prepend(str(REPO))
    seen: list[str] = []
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # another test's Ray head is not this run's

    class Watch(RunEvents):
        def progress(self, plan, progress):  # noqa: ANN001 - while the ranks run: every Ray process is up
            if not seen:
                mine = {p.pid for p in psutil.Process().children(recursive=True)} - before
                seen.extend(_listeners(mine))

    run = run_job(spec, out=tmp_path / "runs", events=Watch(), metrics=False)
    assert run.ok, run.data.get("failure")
    assert len(seen) >= 3  # gcs_server, raylet, the dashboard and its agent, the rank actors
    off_loopback = [addr for addr in seen if not addr.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:"))]
    assert off_loopback == [], seen
