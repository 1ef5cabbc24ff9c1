"""docker-compose.yml: validated without a Docker engine (CI has none) by `docker-compose config`."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="needs docker-compose (apt-get install docker-compose)")


def _config(*args: str, token: str | None = "test-token") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    with tempfile.TemporaryDirectory() as tmp:  # an empty env file: a developer's .env must not leak in
        empty = os.path.join(tmp, "empty.env")
        open(empty, "w").close()
        return subprocess.run(["docker-compose", "--env-file", empty, "-f", str(REPO / "docker-compose.yml"), "config", *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_compose_file_is_valid():
    done = _config("-q")
    assert done.returncode == 0, done.stderr


def test_head_plus_two_workers_built_from_the_dockerfile_with_gpu_reservations():
    done = _config()
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    services = config["services"]
    assert set(services) == {"ray-head", "ray-worker-1", "ray-worker-2"}
    for name, svc in services.items():
        assert svc["build"]["dockerfile"] == "Dockerfile", name
        assert svc["environment"]["RAY_AUTH_MODE"] == "token" and svc["environment"]["RAY_AUTH_TOKEN"] == "test-token"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    head = services["ray-head"]
    assert "--head" in head["command"] and "--dashboard-port=8265" in head["command"]
    assert [p.split("/")[0] for p in head["ports"]] == ["127.0.0.1:8265:8265"]  # dashboard on localhost only
    for worker in ("ray-worker-1", "ray-worker-2"):
        assert "--address=ray-head:6379" in services[worker]["command"] and "ports" not in services[worker]
    assert (REPO / "Dockerfile").is_file()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".env", "runs", ".git"} <= set(ignored)


def test_compose_refuses_to_start_without_a_ray_token():
    done = _config("-q", token=None)
    assert done.returncode != 0 and "RAY_AUTH_TOKEN" in done.stderr
