"""An elastic world (``resources.nodes: {min, max}`` or ``min..max``), planned: the spec's forms and
their mistakes, starting on fewer hosts than max, and a lost host with no spare left: the pool goes
on with the rest while ``min`` remain, and the next attempt's plan has fewer ranks in the stage's
own directory (where its checkpoints are)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.control.api import _plan_factory
from launcher.control.nodes import HostPool
from launcher.control.planning import size_run
from launcher.errors import PlanError, SpecError
from launcher.hardware.devices import discover
from launcher.spec.model import load_job
from launcher.spec.cluster import HostConfig
from launcher.stage.plan import NodeTarget


def node(name: str) -> NodeTarget:
    """A host of a cluster file (reached over SSH)."""
    inv = discover(query=lambda: None, env={})
    address = f"10.0.0.{name[-1]}"
    return NodeTarget(name=name, address=address, inventory=inv, python="/usr/bin/python3", ssh=HostConfig(name=name, address=address))


def job(tmp_path: Path, nodes: str, extra: str = ""):
    path = tmp_path / "j.yaml"
    path.write_text(f"name: j\nentrypoint: launcher.workloads.matmul:run\nresources:\n  nodes: {nodes}\n  cpu_workers: 2\n{extra}")
    return load_job(path)


@pytest.mark.parametrize("form", ["{min: 1, max: 3}", "1..3", "'1 .. 3'"])
def test_both_forms_mean_min_and_max(tmp_path, form):
    res = job(tmp_path, form).spec.resources
    assert (res.fewest_nodes, res.nodes, res.elastic) == (1, 3, True)


@pytest.mark.parametrize(
    ("form", "extra", "words"),
    [
        ("{min: 3, max: 2}", "", "nodes: min 3 is larger than max 2"),
        ("{min: 1}", "", "expected a count, {min: A, max: B} or 'A..B'"),
        ("{min: 1, max: 2, most: 3}", "", "expected a count"),
        ("1..2", "scaling: {workers: [2]}\n", "an elastic world ({min, max}) runs one stage"),
    ],
)
def test_bad_elastic_forms_name_the_field(tmp_path, form, extra, words):
    with pytest.raises(SpecError) as caught:
        job(tmp_path, form, extra)
    assert words in str(caught.value) and "j.yaml:" in str(caught.value)


def test_an_elastic_world_starts_on_as_many_hosts_as_it_has_within_min_and_max(tmp_path):
    spec = job(tmp_path, "2..4")
    assert size_run(spec, [node("h1"), node("h2"), node("h3")]).world_sizes == (6,)
    with pytest.raises(PlanError, match="2 to 4 node"):
        size_run(spec, [node("h1")])


def test_a_lost_host_goes_to_a_spare_first_then_the_world_shrinks_down_to_min(tmp_path):
    spec = job(tmp_path, "{min: 1, max: 2}")
    pool = HostPool.of(spec, [node("h1"), node("h2"), node("h3")])
    assert ([n.name for n in pool.active], [n.name for n in pool.spares], pool.fewest) == (["h1", "h2"], ["h3"], 1)
    assert pool.replace_lost({"h1"}) == "h1 lost: its ranks go to the spare host h3"
    assert "goes on with 1 host(s)" in pool.replace_lost({"h2"})
    assert [n.name for n in pool.active] == ["h3"]
    assert "the restart tries it again" in pool.replace_lost({"h3"})  # min reached: nothing to drop
    assert [n.name for n in pool.active] == ["h3"]


def test_a_fixed_world_never_shrinks(tmp_path):
    pool = HostPool.of(job(tmp_path, "2"), [node("h1"), node("h2")])
    assert "the restart tries it again" in pool.replace_lost({"h2"}) and len(pool.active) == 2


def test_in_a_fixed_world_a_host_lost_to_a_restart_stands_by_last(tmp_path):
    """The restart path's move, as the in-place one (``adopt``): the lost host (rebooted, or not)
    is the last spare, so a second loss still finds one; an elastic world does not keep it."""
    pool = HostPool.of(job(tmp_path, "2"), [node("h1"), node("h2"), node("h3")])
    assert pool.replace_lost({"h2"}) == "h2 lost: its ranks go to the spare host h3"
    assert ([n.name for n in pool.active], [n.name for n in pool.spares]) == (["h1", "h3"], ["h2"])
    assert pool.replace_lost({"h3"}) == "h3 lost: its ranks go to the spare host h2"
    assert ([n.name for n in pool.active], [n.name for n in pool.spares]) == (["h1", "h2"], ["h3"])
    elastic = HostPool.of(job(tmp_path, "{min: 1, max: 2}"), [node("h1"), node("h2"), node("h3")])
    elastic.replace_lost({"h2"})
    assert [n.name for n in elastic.spares] == []


def test_the_attempt_after_a_lost_host_has_fewer_ranks_in_the_stages_own_directory(tmp_path, monkeypatch):
    import launcher.control.api as api

    monkeypatch.setattr(api, "rendezvous_port", lambda nodes: 29500)
    spec = job(tmp_path, "1..2")
    pool = HostPool.of(spec, [node("h1"), node("h2")])
    sizing = size_run(spec, pool.active)
    make = _plan_factory(spec, pool, sizing.world_sizes[0], sizing, tmp_path / "run", "torchrun")
    first = make(0)
    assert (first.world_size, [n.host for n in first.nodes]) == (4, ["h1", "h2"])
    pool.replace_lost({"h1"})
    second = make(1)
    assert (second.world_size, [n.host for n in second.nodes]) == (2, ["h2"])
    assert second.paths.root == first.paths.root and second.paths.root.name == "world4"  # its checkpoints are there
    assert second.worker.checkpoint_dir == first.worker.checkpoint_dir
    assert [r.rank for r in second.ranks] == [0, 1] and second.rendezvous.addr == first.nodes[1].target.address


def test_a_min_larger_than_the_cluster_file_is_refused_before_any_host_is_contacted(tmp_path, capsys):
    from launcher.ui import cli

    cluster = tmp_path / "cluster.yaml"  # addresses nobody answers on: a login would hang for its timeout
    cluster.write_text("hosts:\n  - {name: a, address: 10.255.255.1}\n  - {name: b, address: 10.255.255.2}\n")
    spec = tmp_path / "j.yaml"
    spec.write_text("name: j\nentrypoint: launcher.workloads.matmul:run\nresources: {nodes: 3..4}\n")
    code = cli.main([str(spec), "--cluster", str(cluster), "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"resources.nodes: at least 3 (min) node(s) requested but {cluster} lists 2 host(s)" in err
    assert not (tmp_path / "runs").exists()


def test_a_host_moved_to_a_spare_in_place_is_the_pools_and_the_lost_one_the_last_spare(tmp_path, monkeypatch):
    """A lost host's ranks moved to a spare during an attempt (``on_spare``, the torchrun engine's
    recovery in place): the plans after it run on the spare, and the lost host stands by last."""
    import launcher.control.api as api
    from launcher.stage.plan import on_spare

    monkeypatch.setattr(api, "rendezvous_port", lambda nodes: 29500)
    spec = job(tmp_path, "2")
    pool = HostPool.of(spec, [node("h1"), node("h2"), node("h3"), node("h4")])
    sizing = size_run(spec, pool.active)
    make = _plan_factory(spec, pool, sizing.world_sizes[0], sizing, tmp_path / "run", "torchrun")
    first = make(0)
    assert [n.host for n in first.nodes] == ["h1", "h2"] and [(n.host, n.node_rank) for n in first.standby] == [("h3", -1), ("h4", -1)]
    moved = on_spare(first, 1)  # h2 lost: its node rank, its ranks, on h3; h2 the last to stand by
    assert [(n.host, n.node_rank, n.nproc) for n in moved.nodes] == [("h1", 0, 2), ("h3", 1, 2)]
    assert [(n.host, n.node_rank) for n in moved.standby] == [("h4", -1), ("h2", -1)]
    assert [r.host for r in moved.ranks] == ["h1", "h1", "h3", "h3"] and moved.nodes[1].env == first.standby[0].env
    again = on_spare(moved, 1)  # h3 lost too, in the same attempt: h4
    assert [n.host for n in again.nodes] == ["h1", "h4"] and [n.host for n in again.standby] == ["h2", "h3"]
    assert pool.adopt([n.host for n in again.nodes]) == "h2 lost: its ranks run on the spare host h4 from now on"
    assert ([n.name for n in pool.active], [n.name for n in pool.spares]) == (["h1", "h4"], ["h3", "h2"])
    assert [n.host for n in make(1).nodes] == ["h1", "h4"] and [n.host for n in make(1).standby] == ["h3", "h2"]
    assert pool.adopt(["h1", "h9"]) == "" and [n.name for n in pool.active] == ["h1", "h4"]  # not the pool's hosts: unchanged
