"""One `launch` on the launching host runs, watches and stops a job across three SSH hosts.

Real sshd processes in real network namespaces, real torchrun agents, gloo across veths; each
host's run directory is its own (the launcher brings every report back). One SSH login per host
per run, however many stages. Every test ends by checking that no process is left in any
namespace (`ip netns pids`), the launcher's SSH connections (ControlMasters) included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from launcher.backends.ssh import _socket_dir
from launcher.procutil import cmdline, pid_alive
from tests.cluster.conftest import REPO, NetnsCluster, netns_pids, sh

pytestmark = pytest.mark.slow

TINY = [
    "--set", "resources.nodes=3", "--set", "resources.cpu_workers=1", "--set", "scaling=null",
    "--set", "params.sizes=[64]", "--set", "params.iters=3", "--set", "params.warmup=1",
]
# Spec values a shell would act on; they must arrive as data.
NASTY = "x; touch {p}/pwned1; $(touch {p}/pwned2) `touch {p}/pwned3` ' \" \\"


def assert_clean(cluster: NetnsCluster, timeout_s: float = 60.0) -> None:
    left = cluster.wait_clean(timeout_s)  # a hang guard: the launcher stopped them before it exited
    assert not left, "processes left behind:\n" + cluster.describe(left)


def ssh_masters(cluster: NetnsCluster) -> set[int]:
    """The launcher's SSH connections (ControlMaster processes) alive in the launching namespace."""
    return {pid for pid in netns_pids(cluster.cli_ns) if "ControlMaster=yes" in cmdline(pid)}


def control_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("gl-ssh-*")) | set(Path("/tmp").glob("gl-ssh-*"))


@pytest.fixture(scope="module")
def matmul_run(netns_cluster, tmp_path_factory):
    """A scaling run over two stages (world 3, then world 6) on the three hosts."""
    tmp = tmp_path_factory.mktemp("matmul3")
    cfg = netns_cluster.cluster_yaml(tmp / "cluster.yaml")
    nasty = NASTY.format(p=tmp)
    out = netns_cluster.out_dir("matmul3")
    logins = [netns_cluster.logins(h) for h in netns_cluster.hosts]
    # a temp dir of this run's own, where the launcher puts its control sockets' directory: runs
    # of other tests (other pytest-xdist workers) cannot show up in it
    socket_root = Path(tempfile.mkdtemp(prefix="glsock-", dir="/tmp"))
    t0 = time.monotonic()
    done = netns_cluster.launch(
        "jobs/matmul_scaling.yaml", "--cluster", str(cfg), "--out", str(out), *TINY,
        "--set", "scaling.workers=[3,6]", "--set", "resources.cpu_workers=2",
        "--set", "entrypoint=tests.cluster.noted_matmul:run", "--set", f"env.PYTHONPATH={REPO}",
        "--set", f"params.note={json.dumps(nasty)}", "--set", f"env.GL_PROBE={json.dumps(nasty)}",
        env={"TMPDIR": str(socket_root)},
    )
    elapsed = time.monotonic() - t0
    logins = [netns_cluster.logins(h) - n for h, n in zip(netns_cluster.hosts, logins)]
    run_dirs = list((out / "matmul_scaling").iterdir()) if (out / "matmul_scaling").exists() else []
    left = set(socket_root.glob("gl-ssh-*"))
    shutil.rmtree(socket_root, ignore_errors=True)
    return done, run_dirs, tmp, nasty, elapsed, logins, left


def test_job_runs_across_three_hosts_with_ranks_host_by_host(matmul_run, netns_cluster):
    done, run_dirs, _, _, elapsed, _, _ = matmul_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = run_dirs
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "succeeded" and result["world_sizes"] == [3, 6]
    for world, per_host in ((3, 1), (6, 2)):
        ranks = sorted((r for r in result["ranks"] if r["world_size"] == world), key=lambda r: r["rank"])
        expected = [(k, f"h{k // per_host + 1}", k // per_host, k % per_host) for k in range(world)]
        assert [(r["rank"], r["host"], r["node_rank"], r["local_rank"]) for r in ranks] == expected
        for r in ranks:
            assert r["status"] == "ok" and r["device"] == "cpu"
            assert len(r["metrics"]["times_ms"]["matmul/64"]) == result["params"]["trials"]  # one time per trial
            report = json.loads((run_dir / f"world{world}" / "reports" / f"rank{r['rank']}.json").read_text())
            assert report["host"] == r["host"]
    print(f"3-host matmul job, 2 stages: {elapsed:.1f}s end to end")  # noqa: T201 - shown with -s


def test_one_ssh_login_per_host_per_run(matmul_run, netns_cluster):
    """The preflight's login is the run's only one on each host: the port, both stages'
    directories and agents, and the reports all reuse it; the control socket's directory is gone."""
    done, _, _, _, _, logins, new_dirs = matmul_run
    assert done.returncode == 0
    assert logins == [1, 1, 1], f"SSH logins per host for one two-stage run: {logins}"
    assert not new_dirs, f"control socket directories left: {new_dirs}"


def test_reports_come_back_from_hosts_that_share_no_filesystem(matmul_run, netns_cluster):
    """Each host wrote its ranks' reports into its own (private) run directory; the launcher's
    copy has them all, and the launching host's files were never seen by the hosts."""
    done, run_dirs, _, _, _, _, _ = matmul_run
    assert done.returncode == 0
    (run_dir,) = run_dirs
    h2 = netns_cluster.hosts[1]
    there = netns_cluster.on_host(h2, "ls", str(run_dir / "world6" / "reports")).stdout.split()
    assert there == ["rank2.json", "rank3.json"], there  # h2's own ranks only
    assert netns_cluster.on_host(h2, "test", "-e", str(run_dir / "spec.yaml")).returncode != 0
    assert sorted(p.name for p in (run_dir / "world6" / "reports").glob("rank*.json")) == [f"rank{k}.json" for k in range(6)]


def test_spec_values_reach_ranks_as_data_never_shell(matmul_run):
    done, run_dirs, tmp, nasty, _, _, _ = matmul_run
    assert done.returncode == 0
    assert not list(tmp.glob("pwned*")), "a spec value was run by a shell"
    worker = json.loads((run_dirs[0] / "world3" / "worker.json").read_text())
    assert worker["params"]["note"] == nasty
    result = json.loads((run_dirs[0] / "result.json").read_text())
    assert sorted(r["host"] for r in result["ranks"] if r["world_size"] == 3 and r["result"]["note"] == nasty) == ["h1", "h2", "h3"]
    spec = (run_dirs[0] / "spec.yaml").read_text()
    assert "GL_PROBE" in spec


def test_matmul_run_leaves_no_process_on_any_host(matmul_run, netns_cluster):
    assert_clean(netns_cluster)


# ------------------------------------------------------------------------ failure and teardown

SCRIPT = """\
import json, os, sys, time
from pathlib import Path
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"hello from rank {rank} on {os.environ['GPULAUNCH_HOST']}", flush=True)
out = Path(os.environ["GL_OUT"])
info = {"pid": os.getpid(), "host": os.environ["GPULAUNCH_HOST"], "probe": os.environ["GL_PROBE"],
        "argv": sys.argv[1:], "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
(out / f".rank{rank}.tmp").write_text(json.dumps(info))
os.replace(out / f".rank{rank}.tmp", out / f"rank{rank}.json")
dist.barrier()
time.sleep(600)
"""


@pytest.fixture
def sleeper_job(netns_cluster, tmp_path):
    """A script-mode job whose three ranks write their pid, then sleep until stopped."""
    (tmp_path / "pids").mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    nasty = NASTY.format(p=tmp_path)
    spec = {
        "name": "sleeper",
        "script": "train.py",
        "args": [nasty, "--flag"],
        "resources": {"nodes": 3, "cpu_workers": 1},
        "env": {"GL_OUT": str(tmp_path / "pids"), "GL_PROBE": nasty},
        "timeouts": {"rendezvous_s": 60, "run_s": 300},
        # not what these tests check (tests/cluster/test_network_check.py does): on a machine whose two
        # cores are saturated, three namespace hosts' veth links measure 3-7 Gbit/s by turns, and
        # a link under half the median in both looks stops the run before it starts
        "preflight": {"network": False},
    }
    (tmp_path / "sleeper.yaml").write_text(json.dumps(spec))  # JSON is YAML
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml")
    return tmp_path, cfg, nasty


def _start_sleeper(cluster: NetnsCluster, tmp: Path, cfg: Path) -> tuple[subprocess.Popen, dict[int, dict]]:
    proc = cluster.popen_launch(
        str(tmp / "sleeper.yaml"), "--cluster", str(cfg), "--out", str(runs_of(cluster, tmp)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 90
    infos: dict[int, dict] = {}
    while len(infos) < 3:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0]
            raise AssertionError(f"ranks did not all start (exit {proc.returncode}):\n{out[-4000:]}")
        for rank in range(3):
            path = tmp / "pids" / f"rank{rank}.json"
            if rank not in infos and path.exists():
                infos[rank] = json.loads(path.read_text())
        time.sleep(0.1)
    return proc, infos


def runs_of(cluster: NetnsCluster, tmp: Path) -> Path:
    """The test's ``--out``: private to each host, like the rest of the run root."""
    return cluster.out_dir(tmp.name)


def _netns_of(pid: int) -> str:
    return sh("ip", "netns", "identify", str(pid), check=False).stdout.strip()


def test_killed_rank_on_one_host_stops_every_host_within_seconds(netns_cluster, sleeper_job, clean_after):
    tmp, cfg, nasty = sleeper_job
    proc, infos = _start_sleeper(netns_cluster, tmp, cfg)
    try:
        # Each rank really runs in its own host's namespace, got its env and args as data.
        for rank, host in enumerate(netns_cluster.hosts):
            assert infos[rank]["host"] == host.name and _netns_of(infos[rank]["pid"]) == host.ns
            assert infos[rank]["probe"] == nasty and infos[rank]["argv"] == [nasty, "--flag"]
            assert infos[rank]["ifname"] == "eth0"
        victim = infos[1]["pid"]
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # a hang guard: the others sleep for ever, so only the launcher's fail-fast ends the run
        out, _ = proc.communicate(timeout=120)
        stop_s = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(tmp.glob("pwned*")), "a spec value was run by a shell"
    assert proc.returncode == 1, out[-4000:]
    assert "rank 1 on h2" in out and "SIGKILL" in out, out[-3000:]
    assert "h2:1 hello from rank 1 on h2" in out  # logs stream back prefixed host:rank
    (run_dir,) = (runs_of(netns_cluster, tmp) / "sleeper").iterdir()
    result = json.loads((run_dir / "result.json").read_text())
    root = result["failure"]["root_cause"]
    assert (root["host"], root["rank"], root["signal"]) == ("h2", 1, "SIGKILL"), result["failure"]
    for rank in range(3):
        log = (run_dir / "world3" / "logs" / f"rank{rank}.log").read_text()
        assert f"hello from rank {rank}" in log
    assert_clean(netns_cluster)
    print(f"rank kill -> launcher exit: {stop_s:.2f}s")  # noqa: T201


def test_ctrl_c_on_the_launcher_stops_every_host(netns_cluster, sleeper_job, clean_after):
    tmp, cfg, _ = sleeper_job
    proc, _ = _start_sleeper(netns_cluster, tmp, cfg)
    masters = ssh_masters(netns_cluster)
    assert len(masters) == 3, masters  # one connection per host
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)  # a hang guard: the ranks sleep for ever
        stop_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]  # the orderly stop of SIGINT, not a kill
    assert not [pid for pid in masters if pid_alive(pid)], "an SSH master outlived the run"
    assert_clean(netns_cluster)
    print(f"Ctrl-C -> launcher exit: {stop_s:.2f}s")  # noqa: T201


def test_killed_launcher_leaves_nothing_on_any_host(netns_cluster, sleeper_job, clean_after):
    """SIGKILL gives the launcher no chance to clean up: the ssh clients' stdin (the lifeline)
    closes with it, each remote wrapper stops its agent and ranks, and the ssh clients exit."""
    tmp, cfg, _ = sleeper_job
    proc, infos = _start_sleeper(netns_cluster, tmp, cfg)
    masters = ssh_masters(netns_cluster)
    assert len(masters) == 3, masters
    t0 = time.monotonic()
    proc.kill()
    proc.communicate(timeout=30)
    left = netns_cluster.wait_clean()  # a hang guard: without their lifelines the ranks would sleep for ever
    gone_s = time.monotonic() - t0
    assert not left, "processes left behind:\n" + netns_cluster.describe(left)
    assert not [pid for pid in masters if pid_alive(pid)], "an SSH master outlived the launcher"
    # The masters removed their sockets on the way out; the empty directory goes at the next start.
    dirs = [d for d in control_dirs() if d.name.startswith(f"gl-ssh-{proc.pid}-")]
    assert all(not any(d.iterdir()) for d in dirs), dirs
    _socket_dir().rmdir()
    assert not [d for d in dirs if d.exists()], dirs
    print(f"launcher SIGKILL -> every host clean: {gone_s:.2f}s")  # noqa: T201


def test_dry_run_prints_quoted_ssh_commands(netns_cluster, tmp_path):
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml")
    done = netns_cluster.launch("jobs/matmul_scaling.yaml", "--cluster", str(cfg), "--dry-run", "--json", *TINY, "--out", str(tmp_path / "r w"))
    assert done.returncode == 0, done.stderr
    (plan,) = json.loads(done.stdout)
    assert [n["host"] for n in plan["nodes"]] == ["h1", "h2", "h3"]
    assert plan["rendezvous"].startswith("10.231.7.11:")
    assert not (tmp_path / "r w").exists()  # nothing was started or created
    # --preflight: every host logged in to and planned on what it has (the port picked there)
    checked = netns_cluster.launch("jobs/matmul_scaling.yaml", "--cluster", str(cfg), "--dry-run", "--preflight", "--json", *TINY,
                                   "--out", str(tmp_path / "r w"))  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    (plan,) = json.loads(checked.stdout)
    assert [n["host"] for n in plan["nodes"]] == ["h1", "h2", "h3"] and plan["rendezvous"].startswith("10.231.7.11:")
    assert not (tmp_path / "r w").exists()
    assert_clean(netns_cluster)
