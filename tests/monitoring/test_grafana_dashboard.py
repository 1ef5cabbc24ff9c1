"""configs/grafana: the dashboard JSON and its provisioning files, checked structurally (the queries
themselves run on a real Prometheus in test_prometheus_scrape.py)."""

from __future__ import annotations

import json
import re

import yaml

from launcher import metric_names as me
from tests.conftest import REPO

GRAFANA = REPO / "configs" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "gpulaunch.json"


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def datasource() -> dict:
    (ds,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    return ds


def targets(dash: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_is_grafana_json_with_a_stable_uid_and_no_overlapping_panels():
    dash = load()
    assert dash["uid"] == "gpulaunch" and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        assert p["targets"], p["title"]


def test_panels_cover_step_rate_step_time_stragglers_and_restarts_of_both_sources():
    dash = load()
    exprs = [t["expr"] for _, t in targets(dash)]
    used = {name for e in exprs for name in re.findall(r'\(ray_\)\?(gpulaunch_[a-z_]+)', e)}
    exported = {m.exported for m in me.METRICS} | {me.STEP_SECONDS.exported + "_bucket"}
    assert used <= exported, used - exported  # only names that exist
    for must in ("gpulaunch_steps_total", "gpulaunch_step_time_seconds", "gpulaunch_straggler", "gpulaunch_restarts_total",
                 "gpulaunch_rank_work_seconds", "gpulaunch_step_seconds_bucket"):
        assert must in used, must
    for e in exprs:
        # every metric is selected under both names: the endpoint's and Ray's (ray_ in front), but
        # for Ray's step counter, the step rate's fallback where no endpoint reports the gauge
        assert not re.search(r"\bgpulaunch_[a-z_]+\{", e), e
        for exact in re.findall(r'__name__="([^"]+)"', e):
            assert exact == "ray_gpulaunch_steps_total" and e.index(exact) > e.index(" or "), e
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        assert 'gpulaunch_job=~"$gpulaunch_job"' in e and 'run_id=~"$run_id"' in e, e
        assert re.search(r'\bjob\s*=', e) is None, e  # the scrape job's label is not the job's name
        if "rate(" in e:
            assert "[$__rate_interval]" in e, e
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for word in ("step rate", "step time", "straggler", "restarts"):
        assert word in titles, word


def test_datasource_uid_matches_the_provisioned_one():
    dash, ds = load(), datasource()
    assert ds["type"] == "prometheus" and ds["uid"] == "gpulaunch-prometheus" and ds["name"] == "Prometheus"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    var = variables["datasource"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    assert var["current"]["value"] == ds["uid"] and var["current"]["text"] == ds["name"]
    for panel, target in targets(dash):
        for ref in (panel["datasource"], target["datasource"]):
            assert ref == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    for name in ("gpulaunch_job", "run_id", "world_size"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}"
        assert v["definition"].startswith('label_values({__name__=~"(ray_)?gpulaunch_steps_total"')
        assert v["definition"].endswith(f", {name})") and v["includeAll"] and v["allValue"] == ".*"


def test_provisioning_files_point_at_the_dashboard_directory():
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    assert providers["apiVersion"] == 1
    by_name = {p["name"]: p for p in providers["providers"]}
    assert by_name["gpulaunch"]["type"] == "file" and by_name["gpulaunch"]["options"]["path"] == "/var/lib/grafana/dashboards/gpulaunch"
    assert datasource()["url"] == "http://prometheus:9090"  # docker-compose.yml's service
    assert [p.name for p in (GRAFANA / "dashboards").iterdir()] == ["gpulaunch.json"]


STEP_RATE_PANELS = ("Step rate per rank", "Slowest rank, steps/s")
GAUGE = '{__name__=~"(ray_)?gpulaunch_steps_per_second", gpulaunch_job=~"$gpulaunch_job", run_id=~"$run_id", world_size=~"$world_size"}'
RAY_COUNTER_RATE = 'rate({__name__="ray_gpulaunch_steps_total", gpulaunch_job=~"$gpulaunch_job", run_id=~"$run_id", world_size=~"$world_size"}[$__rate_interval])'


def test_step_rates_read_the_endpoints_gauge_not_a_rate_of_its_counter():
    """rate() over the endpoint's counter under-reads until the run is as old as the window (a
    benchmark run rarely is a minute old) and swings by half over a few scrapes (the count moves by
    whole beacons): the step-rate panels read the endpoint's own steps/s, per rank, folded as every
    panel folds ranks; Ray's counter only stands in for ranks no endpoint reports (``or``)."""
    dash = load()
    key = "max by (gpulaunch_job, run_id, world_size, rank)"
    per_rank = f"{key} ({GAUGE}) or {key} ({RAY_COUNTER_RATE})"
    panels = {p["title"]: p for p in dash["panels"]}
    assert [t["expr"] for t in panels["Step rate per rank"]["targets"]] == [per_rank]
    assert [t["expr"] for t in panels["Slowest rank, steps/s"]["targets"]] == [f"min by (gpulaunch_job, run_id, world_size) ({per_rank})"]
    for panel, target in targets(dash):
        # no rate of the endpoint's counter anywhere (the histogram's buckets come from Ray alone)
        assert not re.search(r"(rate|increase)\(\{__name__=~\"\(ray_\)\?gpulaunch_steps_total", target["expr"]), panel["title"]
        if panel["title"] in STEP_RATE_PANELS:
            assert "gpulaunch_steps_per_second" in panel["description"], panel["title"]
