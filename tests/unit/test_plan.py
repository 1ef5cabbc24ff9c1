"""Planning is pure: spec x inventory -> ranks, devices, commands; impossible asks fail here."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from launcher.backends.torchrun import TorchrunEngine, agent_argv
from launcher.control.planning import make_plans, size_run
from launcher.stage.plan import NodeTarget, RankPlacement, place_ranks
from launcher.errors import PlanError
from launcher.protocol import WorkerConfig
from launcher.hardware.devices import discover
from launcher.spec.model import load_job

DATA = Path(__file__).parent / "data"


def node(name: str, gpus_csv: str | None = None, visible: str | None = None, cpus: int | None = None) -> NodeTarget:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    inv = discover(query=(lambda: (DATA / gpus_csv).read_text()) if gpus_csv else (lambda: None), env=env)
    if cpus is not None:
        from dataclasses import replace

        inv = replace(inv, cpu_count=cpus)
    return NodeTarget(name=name, address=f"10.0.0.{len(name)}", inventory=inv, python="/usr/bin/python3")


def job(tmp_path: Path, extra: str = "") -> object:
    path = tmp_path / "j.yaml"
    path.write_text("name: j\nentrypoint: launcher.workloads.matmul:run\n" + extra)
    return load_job(path)


def plans(tmp_path, extra, nodes):
    spec = job(tmp_path, extra)
    return make_plans(spec, nodes, size_run(spec, nodes), run_dir=tmp_path / "run", master_port=41234)


def test_gpu_node_gets_one_rank_per_gpu_on_its_own_device(tmp_path):
    (plan,) = plans(tmp_path, "", [node("gpu-a", "nvidia_smi_h100x4.csv")])
    assert plan.world_size == 4
    assert [r.device for r in plan.ranks] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert plan.pg_backend == "nccl" and plan.worker.pg_backend == "nccl"
    assert plan.worker.device_type == "cuda"


def test_cpu_node_uses_gloo_and_shares_the_cores(tmp_path):
    (plan,) = plans(tmp_path, "resources: {cpu_workers: 2}\n", [node("laptop", cpus=8)])
    assert [r.device for r in plan.ranks] == ["cpu", "cpu"]
    assert plan.pg_backend == "gloo"
    assert plan.worker.threads_per_worker == 4
    assert plan.nodes[0].env["OMP_NUM_THREADS"] == "4"


def test_two_nodes_number_ranks_host_by_host(tmp_path):
    (plan,) = plans(
        tmp_path,
        "resources: {nodes: 2, gpus_per_node: 2}\n",
        [node("a", "nvidia_smi_h100x4.csv"), node("bb", "nvidia_smi_h100x4.csv")],
    )
    assert [(r.rank, r.host, r.local_rank, r.device) for r in plan.ranks] == [
        (0, "a", 0, "cuda:0"),
        (1, "a", 1, "cuda:1"),
        (2, "bb", 0, "cuda:0"),
        (3, "bb", 1, "cuda:1"),
    ]
    assert plan.rendezvous.addr == "10.0.0.1"
    argv = agent_argv(plan, plan.nodes[1])
    assert "--node-rank=1" in argv and "--nnodes=2" in argv and "--master-addr=10.0.0.1" in argv
    assert "--master-port=41234" in argv and "--rdzv-backend=static" in argv


def test_scaling_makes_one_plan_per_world_size(tmp_path):
    sizes = [p.world_size for p in plans(tmp_path, "scaling: {workers: [1, 2, 4]}\n", [node("g", "nvidia_smi_h100x4.csv")])]
    assert sizes == [1, 2, 4]


def test_more_gpus_than_present_fails_before_spawning(tmp_path):
    with pytest.raises(PlanError, match=r"resources.gpus_per_node: 8 GPUs requested per node, but g has 2 visible"):
        plans(tmp_path, "resources: {gpus_per_node: 8}\n", [node("g", "nvidia_smi_h100x4.csv", visible="0,1")])


def test_cuda_demanded_on_a_cpu_node_fails(tmp_path):
    with pytest.raises(PlanError, match="'cuda' requested but laptop has no visible GPU"):
        plans(tmp_path, "resources: {device: cuda}\n", [node("laptop")])


def test_listed_world_sizes_beyond_the_slots_are_skipped_with_why_and_what_would_run_them(tmp_path):
    spec = job(tmp_path, "resources: {cpu_workers: 2}\nscaling: {workers: [1, 3]}\n")
    sizing = size_run(spec, [node("laptop")])
    assert sizing.world_sizes == (1,)
    (skipped,) = sizing.skipped
    assert skipped.world_size == 3
    assert skipped.describe() == (
        "world size 3 skipped: it needs 3 worker slot(s) per node but resources.cpu_workers gives 2; "
        "--set resources.cpu_workers=3 runs it on the CPU"
    )


def test_a_world_size_beyond_one_gpu_names_more_gpus_or_ranks_sharing_it(tmp_path):
    sizing = size_run(job(tmp_path, "scaling: {workers: [1, 2]}\n"), [node("g", "nvidia_smi_h100x4.csv", visible="0")])
    assert sizing.world_sizes == (1,)
    assert [s.world_size for s in sizing.skipped] == [2]
    assert sizing.skipped[0].reason == "needs 2 worker slot(s) per node but 1 GPU(s) give 1"
    assert sizing.skipped[0].remedy == "it runs where this node has 2 GPUs, or here with resources.ranks_per_gpu: 2 (ranks sharing a GPU, over gloo)"


def test_no_listed_world_size_fitting_is_one_error(tmp_path):
    with pytest.raises(PlanError, match=r"scaling.workers: no world size of \[3, 4\] fits: world size 3 needs 3 worker slot\(s\)"):
        plans(tmp_path, "resources: {cpu_workers: 2}\nscaling: {workers: [3, 4]}\n", [node("laptop")])


@pytest.mark.parametrize(
    "gpus, visible, expected",
    [(None, None, [1, 2]), ("nvidia_smi_h100x4.csv", "0", [1]), ("nvidia_smi_h100x4.csv", None, [1, 2, 4]),
     ("nvidia_smi_h100x4.csv", "0,1,2", [1, 2, 3])],
    ids=["cpu-2-workers", "one-gpu", "four-gpus", "three-gpus"],
)  # fmt: skip
def test_auto_world_sizes_are_powers_of_two_up_to_every_slot(tmp_path, gpus, visible, expected):
    sizing = size_run(job(tmp_path, "resources: {cpu_workers: 2}\nscaling: {workers: auto}\n"), [node("n", gpus, visible=visible)])
    assert list(sizing.world_sizes) == expected and sizing.skipped == ()


def test_auto_world_sizes_over_several_nodes_are_multiples_of_the_nodes(tmp_path):
    from launcher.stage.plan import auto_world_sizes

    assert auto_world_sizes(16, 2) == [2, 4, 8, 16]
    assert auto_world_sizes(6, 2) == [2, 4, 6]
    assert auto_world_sizes(1, 1) == [1]
    assert auto_world_sizes(6, 1) == [1, 2, 4, 6]


def test_ranks_that_share_a_gpu_run_on_gloo_each_on_the_gpu_of_its_pair(tmp_path):
    nodes = [node("g", "nvidia_smi_h100x4.csv", visible="0,1")]
    spec = job(tmp_path, "resources: {ranks_per_gpu: 2}\nscaling: {workers: auto}\n")
    sizing = size_run(spec, nodes)
    assert sizing.world_sizes == (1, 2, 4) and sizing.per_node == 4
    assert any("ranks_per_gpu: 2 ranks share each GPU" in n and "gloo over CUDA tensors" in n for n in sizing.notes)
    plan = make_plans(spec, nodes, sizing, run_dir=tmp_path / "run", master_port=41234)[-1]
    assert [r.device for r in plan.ranks] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert plan.pg_backend == "gloo" and plan.worker.ranks_per_gpu == 2
    assert [r.local_rank for r in plan.ranks] == [0, 1, 2, 3]


def test_ranks_per_gpu_means_nothing_on_the_cpu(tmp_path):
    (plan,) = plans(tmp_path, "resources: {cpu_workers: 2, ranks_per_gpu: 2}\n", [node("laptop", cpus=4)])
    assert plan.world_size == 2 and [r.device for r in plan.ranks] == ["cpu", "cpu"]
    assert plan.worker.ranks_per_gpu == 1 and plan.pg_backend == "gloo"


def test_several_nodes_need_a_cluster(tmp_path):
    with pytest.raises(PlanError, match="cluster"):
        plans(tmp_path, "resources: {nodes: 2}\n", [node("laptop")])


def test_rank_env_is_what_torchrun_gives_a_script(tmp_path):
    (plan,) = plans(tmp_path, "resources: {cpu_workers: 2}\nenv: {MY_API_TOKEN: hunter2}\n", [node("h")])
    env = plan.rank_env(plan.ranks[1])
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "41234"}.items():
        assert env[key] == value
    assert env["MY_API_TOKEN"] == "hunter2"  # the worker gets the real value ...
    assert plan.masked()["nodes"][0]["env"]["MY_API_TOKEN"] == "****"  # ... displays never do


def test_torchrun_command_is_plain_torchrun_with_the_same_arguments(tmp_path):
    (plan,) = plans(tmp_path, "", [node("h")])
    request = TorchrunEngine().launch_request(plan)
    assert request.backend == "torchrun" and request.commands[0].startswith("[h] $ torchrun ")
    cmd = shlex.split(request.commands[0].partition(" $ ")[2])
    assert cmd[0] == "torchrun" and cmd[1:] == list(agent_argv(plan, plan.nodes[0])[3:])
    assert "29500" not in " ".join(cmd)


def test_entrypoint_ranks_are_forked_from_a_forkserver_unless_the_spec_says_spawn(tmp_path):
    (plan,) = plans(tmp_path, "", [node("laptop", cpus=2)])
    assert "--start-method=forkserver" in agent_argv(plan, plan.nodes[0])
    assert plan.nodes[0].env["GPULAUNCH_STAGE_DIR"] == str(plan.stage_dir)
    (plan,) = plans(tmp_path, "start_method: spawn\n", [node("laptop", cpus=2)])
    assert "--start-method=spawn" in agent_argv(plan, plan.nodes[0])


def test_a_script_always_gets_a_fresh_interpreter(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nscript: train.py\n")
    spec, laptop = load_job(path), [node("laptop", cpus=2)]
    (plan,) = make_plans(spec, laptop, size_run(spec, laptop), run_dir=tmp_path / "run", master_port=41234)
    assert "--start-method=spawn" in agent_argv(plan, plan.nodes[0])


@pytest.mark.parametrize("value, threads", [("1", 1), (3, 3), ("4,2", None)])
def test_the_specs_omp_num_threads_wins_over_the_plans_share(tmp_path, value, threads):
    (plan,) = plans(tmp_path, f"resources: {{cpu_workers: 2}}\nenv: {{OMP_NUM_THREADS: {value!r}}}\n", [node("laptop", cpus=8)])
    assert plan.nodes[0].env["OMP_NUM_THREADS"] == str(value)  # what every rank's environment says ...
    # ... and what the worker sets torch to: the same count, or None (not a plain count: the
    # worker leaves torch to read OMP_NUM_THREADS itself) instead of the plan's share of 4
    assert plan.worker.threads_per_worker == threads


def test_the_timeouts_reach_the_worker(tmp_path):
    (plan,) = plans(tmp_path, "timeouts: {rendezvous_s: 7, collective_s: 900}\n", [node("laptop", cpus=2)])
    assert (plan.worker.rendezvous_timeout_s, plan.worker.collective_timeout_s) == (7, 900)
    (plan,) = plans(tmp_path, "", [node("laptop", cpus=2)])
    assert plan.worker.collective_timeout_s is None  # torch's default for the process-group backend
    assert WorkerConfig.from_json(plan.worker.to_json()) == plan.worker


def test_gpus_asked_for_on_a_cpu_only_node_run_on_the_cpu_and_say_so(tmp_path):
    spec = job(tmp_path, "resources: {gpus_per_node: 4, cpu_workers: 2}\n")
    laptop = [node("laptop", cpus=8)]
    sizing = size_run(spec, laptop)
    (plan,) = make_plans(spec, laptop, sizing, run_dir=tmp_path / "run", master_port=41234)
    assert [r.device for r in plan.ranks] == ["cpu", "cpu"]
    (note,) = sizing.notes
    assert note.startswith("resources.gpus_per_node is 4, but laptop has no visible GPU: running on the CPU")
    assert size_run(job(tmp_path, "resources: {gpus_per_node: auto}\n"), laptop).notes == ()
    gpu_box = size_run(spec, [node("g", "nvidia_smi_h100x4.csv")])
    assert gpu_box.notes == () and (gpu_box.device_type, gpu_box.per_node, gpu_box.world_sizes) == ("cuda", 4, (4,))


def test_the_ranks_get_the_resolved_params_the_dry_run_shows(tmp_path):
    (plan,) = plans(tmp_path, "params: {sizes: [64]}\n", [node("laptop", cpus=2)])
    # the workload's defaults filled in by the launcher, once: the ranks do not resolve them again
    assert plan.worker.params["sizes"] == [64] and "warmup" in plan.worker.params
    assert plan.masked()["params"] == dict(plan.worker.params)


def test_a_placed_stage_is_laid_out_by_the_planner_from_where_the_scheduler_put_the_ranks(tmp_path):
    (pool_plan,) = plans(tmp_path, "resources: {cpu_workers: 3}\n", [node("ray", cpus=8)])
    placed = place_ranks(
        pool_plan,
        [
            RankPlacement(0, "n-a", "host-a", "10.1.0.1", cpus=4, ifname="eth0", port=5555),
            RankPlacement(1, "n-b", "host-b", "10.1.0.2", cpus=6, ifname="eth1"),
            RankPlacement(2, "n-a", "host-a", "10.1.0.1", cpus=4, ifname="eth0"),
        ],
    )
    assert [(r.rank, r.node_rank, r.local_rank, r.host) for r in placed.ranks] == [
        (0, 0, 0, "host-a"), (1, 1, 0, "host-b"), (2, 0, 1, "host-a")
    ]
    assert [(n.host, n.nproc, n.threads) for n in placed.nodes] == [("host-a", 2, 2), ("host-b", 1, 6)]
    assert str(placed.rendezvous) == "10.1.0.1:5555"
    env = placed.rank_env(placed.ranks[2])
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "2", "0", "2")
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["OMP_NUM_THREADS"] == "2"
    assert placed.worker_for(placed.nodes[1]).threads_per_worker == 6


def test_placed_nodes_that_share_a_hostname_are_named_by_their_addresses(tmp_path):
    """Containers or namespaces on one machine: two Ray nodes, one hostname. Logs, reports and
    /metrics must still tell their ranks apart."""
    (pool_plan,) = plans(tmp_path, "resources: {cpu_workers: 3}\n", [node("ray", cpus=8)])
    placed = place_ranks(
        pool_plan,
        [RankPlacement(0, "n-a", "box", "10.1.0.1", cpus=4), RankPlacement(1, "n-b", "box", "10.1.0.2", cpus=4),
         RankPlacement(2, "n-c", "other", "10.1.0.3", cpus=4)],
    )  # fmt: skip
    assert [r.host for r in placed.ranks] == ["10.1.0.1", "10.1.0.2", "other"]
    assert [n.env["GPULAUNCH_HOST"] for n in placed.nodes] == ["10.1.0.1", "10.1.0.2", "other"]


def test_placed_gpus_are_each_nodes_granted_devices_with_every_rank_on_its_own(tmp_path):
    (pool_plan,) = plans(tmp_path, "", [node("g", "nvidia_smi_h100x4.csv")])
    placed = place_ranks(
        pool_plan,
        [RankPlacement(r, "n", "g", "10.1.0.1", cpus=16, gpu_ids=(gpu,)) for r, gpu in enumerate(["3", "1", "0", "2"])],
    )
    assert placed.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert [r.device for r in placed.ranks] == ["cuda:3", "cuda:1", "cuda:0", "cuda:2"]
    assert placed.rank_env(placed.ranks[0])["GPULAUNCH_GRANTED_GPU"] == "3"


def test_placed_ranks_that_share_gpus_are_neighbours_each_told_its_device(tmp_path):
    (pool_plan,) = plans(tmp_path, "resources: {ranks_per_gpu: 2}\n", [node("g", "nvidia_smi_h100x4.csv", visible="0,1")])
    # Ray's fractional GPUs: the scheduler chose each rank's GPU, not in rank order
    placed = place_ranks(
        pool_plan, [RankPlacement(r, "n", "g", "10.1.0.1", cpus=16, gpu_ids=(gpu,)) for r, gpu in enumerate(["1", "0", "1", "0"])]
    )
    assert placed.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    by_rank = {r.rank: r for r in placed.ranks}
    assert [by_rank[k].device for k in range(4)] == ["cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert [by_rank[k].local_rank for k in (1, 3, 0, 2)] == [0, 1, 2, 3]  # ranks sharing a GPU are neighbours
    assert placed.rank_env(by_rank[0])["GPULAUNCH_RANK_DEVICE"] == "cuda:1"


def test_world_sizes_none_of_which_splits_over_the_nodes_are_refused_from_the_spec_alone(tmp_path):
    from launcher.control.planning import check_node_split

    with pytest.raises(PlanError, match=r"no world size of \[1, 3\] divides over 2 nodes .* --set scaling.workers=auto"):
        check_node_split(job(tmp_path, "resources: {nodes: 2}\nscaling: {workers: [1, 3]}\n"))
    check_node_split(job(tmp_path, "resources: {nodes: 2}\nscaling: {workers: [1, 2]}\n"))  # 2 fits: 1 is skipped later
    check_node_split(job(tmp_path, "resources: {nodes: 2}\nscaling: {workers: auto}\n"))
    check_node_split(job(tmp_path, "resources: {nodes: 2}\n"))  # no scaling: every slot of every node, always fits


def test_a_world_size_that_does_not_split_over_the_nodes_is_skipped(tmp_path):
    spec = job(tmp_path, "resources: {nodes: 2, cpu_workers: 2}\nscaling: {workers: [1, 2, 4]}\n")
    sizing = size_run(spec, [node("a", cpus=4), node("b", cpus=4)])
    assert sizing.world_sizes == (2, 4)
    assert [(s.world_size, s.reason) for s in sizing.skipped] == [(1, "does not divide over 2 nodes")]


def test_unused_worker_slots_are_named_with_the_setting_that_decides(tmp_path):
    spec = job(tmp_path, "resources: {cpu_workers: 4}\nscaling: {workers: [1, 2]}\n")
    (note,) = size_run(spec, [node("laptop", cpus=8)]).notes
    assert "resources.cpu_workers give 4 worker slot(s), but scaling.workers [1, 2] decides" in note
    assert "--set scaling.workers=auto to use them all" in note
    assert size_run(job(tmp_path, "resources: {cpu_workers: 2}\nscaling: {workers: [1, 2]}\n"), [node("l", cpus=8)]).notes == ()


def test_straggler_settings_reach_the_run_loop_and_the_ranks(tmp_path):
    (plan,) = plans(tmp_path, "resources: {cpu_workers: 2}\n", [node("laptop", cpus=4)])
    assert plan.worker.time_ddp and (plan.stragglers.factor, plan.stragglers.hold_s) == (1.5, 5.0)
    (plan,) = plans(tmp_path, "resources: {cpu_workers: 2}\nmonitoring: {stragglers: false, straggler_factor: 2, straggler_hold_s: 1}\n",
                    [node("laptop", cpus=4)])
    assert not plan.worker.time_ddp and (plan.stragglers.factor, plan.stragglers.hold_s) == (2.0, 1.0)
    assert WorkerConfig.from_json(plan.worker.to_json()).time_ddp is False  # what worker.json carries
