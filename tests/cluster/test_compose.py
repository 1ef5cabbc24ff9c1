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


def _config(*args: str, token: str | None = "test-token", grafana_password: str | None = "test-password") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "GRAFANA_ADMIN_PASSWORD")}
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    if grafana_password is not None:
        env["GRAFANA_ADMIN_PASSWORD"] = grafana_password
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
    assert set(services) == {"ray-head", "ray-worker-1", "ray-worker-2", "prometheus", "grafana"}
    for name, svc in ((n, s) for n, s in services.items() if n.startswith("ray-")):
        assert svc["build"]["dockerfile"] == "Dockerfile", name
        assert svc["environment"]["RAY_AUTH_MODE"] == "token" and svc["environment"]["RAY_AUTH_TOKEN"] == "test-token"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    head = services["ray-head"]
    assert "--head" in head["command"] and "--dashboard-port=8265" in head["command"]
    assert [p.split("/")[0] for p in head["ports"]] == ["127.0.0.1:8265:8265"]  # dashboard on localhost only
    for worker in ("ray-worker-1", "ray-worker-2"):
        assert "--address=ray-head:6379" in services[worker]["command"] and "ports" not in services[worker]
    for name in ("ray-head", "ray-worker-1", "ray-worker-2"):  # the port compose.yml scrapes
        assert "--metrics-export-port=8080" in services[name]["command"], name
    assert (REPO / "Dockerfile").is_file()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".env", "runs", ".git"} <= set(ignored)


def test_compose_refuses_to_start_without_a_ray_token():
    done = _config("-q", token=None)
    assert done.returncode != 0 and "RAY_AUTH_TOKEN" in done.stderr


def _mounts(svc: dict) -> dict[str, str]:
    """container path -> source (a host path or a volume name), from `docker-compose config`."""
    out = {}
    for volume in svc.get("volumes", []):
        source, target = (volume.split(":")[:2]) if isinstance(volume, str) else (volume["source"], volume["target"])
        out[target] = source
    return out


def test_prometheus_and_grafana_provisioned_from_configs_on_localhost_only():
    done = _config()
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    services = config["services"]
    prom, graf, head = services["prometheus"], services["grafana"], services["ray-head"]
    assert [p.split("/")[0] for p in prom["ports"]] == ["127.0.0.1:9090:9090"]
    assert [p.split("/")[0] for p in graf["ports"]] == ["127.0.0.1:3000:3000"]

    # Prometheus reads configs/prometheus/compose.yml, which scrapes every Ray node of this file
    prom_mounts = _mounts(prom)
    assert os.path.realpath(prom_mounts["/etc/prometheus/prometheus.yml"]) == str(REPO / "configs/prometheus/compose.yml")
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    scrape = yaml.safe_load((REPO / "configs/prometheus/compose.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    ray_nodes = {name for name in services if name.startswith("ray-")}
    assert targets == {f"{name}:8080" for name in ray_nodes}
    assert all(services[name]["hostname"] == name for name in ray_nodes)

    # Grafana: provisioning and the gpulaunch dashboard from configs/grafana, Ray's generated
    # dashboards from the volume the head writes them to
    graf_mounts = _mounts(graf)
    assert os.path.realpath(graf_mounts["/etc/grafana/provisioning"]) == str(REPO / "configs/grafana/provisioning")
    dashboards = os.path.realpath(graf_mounts["/var/lib/grafana/dashboards/gpulaunch"])
    assert dashboards == str(REPO / "configs/grafana/dashboards") and (REPO / "configs/grafana/dashboards/gpulaunch.json").is_file()
    providers = yaml.safe_load((REPO / "configs/grafana/provisioning/dashboards/dashboards.yml").read_text())["providers"]
    assert {p["options"]["path"] for p in providers} == {"/var/lib/grafana/dashboards/gpulaunch", "/var/lib/grafana/dashboards/ray"}
    shared = graf_mounts["/var/lib/grafana/dashboards/ray"]
    head_env = head["environment"]
    assert _mounts(head)[head_env["RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"]] == shared
    assert config["volumes"][shared]["driver_opts"]["o"].startswith("uid=1000,")  # the head runs as uid 1000
    datasource = yaml.safe_load((REPO / "configs/grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == head_env["RAY_PROMETHEUS_HOST"] == "http://prometheus:9090"
    assert datasource["name"] == head_env["RAY_PROMETHEUS_NAME"]
    assert head_env["RAY_GRAFANA_HOST"] == "http://grafana:3000" and head_env["RAY_GRAFANA_IFRAME_HOST"] == "http://127.0.0.1:3000"
    assert graf["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "test-password"
    assert graf["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"  # anonymous: read only


def test_compose_refuses_to_start_without_a_grafana_password():
    done = _config("-q", grafana_password=None)
    assert done.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in done.stderr
