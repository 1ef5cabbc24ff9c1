"""The cluster file and the ssh command line, without any network (pure, fast)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.backends.ssh import remote_agent_command, ssh_argv
from launcher.backends.torchrun import agent_argv
from launcher.protocol import HOST_ANSWER_TAG as JSON_TAG
from launcher.spec.cluster import load_cluster
from launcher.hardware.devices import NodeInventory
from launcher.errors import SpecError
from launcher.control.planning import plan_stage
from launcher.stage.plan import NodeTarget
from launcher.spec.model import load_job
from tests.conftest import REPO

NASTY = "x; rm -rf ~ $(reboot) `id` 'q' \"d\" \\ \n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_example_cluster_file_is_valid():
    cluster = load_cluster(REPO / "configs" / "cluster.example.yaml")
    a, b = cluster.hosts
    assert (a.name, a.address, a.user, a.port, a.gpus, a.ifname) == ("gpu-a", "10.0.0.11", "ubuntu", 22, "auto", "eth0")
    assert b.ifname == "ens5" and b.python == a.python  # per-host override; inherited default
    assert a.key == str(Path("~/.ssh/id_ed25519").expanduser())


def test_relative_key_is_relative_to_the_cluster_file(tmp_path):
    cluster = load_cluster(_write(tmp_path, "defaults: {key: keys/id}\nhosts: [{address: 10.0.0.1}]\n"))
    (host,) = cluster.hosts
    assert host.key == str(tmp_path / "keys" / "id") and host.name == "10.0.0.1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hosts:\n  - name: a\n    adress: 10.0.0.1\n", ["cluster.yaml:3: hosts.0.adress: unknown key, did you mean 'address'?",
                                                       "cluster.yaml:2: hosts.0.address: required field is missing"]),
        ("hosts:\n  - {name: a, address: h, port: 99999}\n", ["cluster.yaml:2: hosts.0.port: expected less than or equal to 65535 (got 99999)"]),
        ("defaults:\n  gpus: some\nhosts:\n  - {address: h}\n  - {address: i}\n",
         ["cluster.yaml:2: defaults.gpus: expected 'auto' or a valid integer", "(got 'some')"]),
        ("hosts:\n  - {address: h, ifname: 'eth0; reboot'}\n", ["cluster.yaml:2: hosts.0.ifname: expected text matching"]),
        ("hosts:\n  - {address: h, strict_host_key_checking: no}\n", ["hosts.0.strict_host_key_checking: expected 'yes' or 'accept-new'"]),
        ("host:\n  - {address: h}\n", ["cluster.yaml:1: host: unknown key, did you mean 'hosts'?", "hosts: expected a non-empty list"]),
        ("hosts: []\n", ["cluster.yaml:1: hosts: expected a non-empty list of hosts"]),
        ("hosts:\n  - {name: a, address: h}\n  - {name: a, address: i}\n", ["hosts: host names must be unique", "repeated: a"]),
        ("hosts:\n  - {address: h, ssh_options: {'Bad Key': x}}\n", ["hosts.0.ssh_options: expected ssh option names"]),
    ],
)
def test_bad_cluster_files_name_file_line_field_and_expectation(tmp_path, text, expected):
    with pytest.raises(SpecError) as info:
        load_cluster(_write(tmp_path, text))
    assert info.value.exit_code == 2
    message = str(info.value)
    for part in expected:
        assert part in message, message
    # a bad value inherited from `defaults` is reported once, not once per host
    assert message.count("gpus") <= 1


def test_missing_cluster_file_is_a_one_line_error(tmp_path):
    with pytest.raises(SpecError, match="no such cluster file"):
        load_cluster(tmp_path / "nope.yaml")


def test_cli_reports_a_bad_cluster_file_with_exit_2(tmp_path):
    bad = _write(tmp_path, "hosts:\n  - {address: h, prot: 22}\n")
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "jobs/matmul_scaling.yaml", "--cluster", str(bad)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "cluster.yaml:2: hosts.0.prot: unknown key, did you mean 'port'?" in done.stderr
    assert "Traceback" not in done.stderr


def _plan(tmp_path: Path, nodes: int = 2):
    cluster = load_cluster(
        _write(
            tmp_path,
            "defaults: {user: ops, port: 2222, key: /k/id, known_hosts: /k/known, strict_host_key_checking: 'yes', "
            "python: '/opt/my env/bin/python'}\nhosts:\n  - {name: a, address: 10.0.0.1, ifname: eth1}\n"
            "  - {name: b, address: 10.0.0.2, ssh_options: {ProxyJump: jump}}\n",
        )
    )
    inv = NodeInventory(hostname="x", cpu_count=4)
    targets = [NodeTarget(h.name, h.address, inv, h.python, h.ifname, ssh=h) for h in cluster.hosts[:nodes]]
    job = load_job(REPO / "jobs" / "matmul_scaling.yaml", ["resources.nodes=2", "entrypoint=tests.integration.faulty:run",
                                                          f"params.note={NASTY!r}", f"env.GL={NASTY!r}"])
    return plan_stage(job, targets, 2, "cpu", run_dir=tmp_path / "runs; rm -rf ~" / "r'1", master_port=29999, backend="torchrun")


def test_ssh_command_uses_safe_options_and_quotes_every_argument(tmp_path):
    plan = _plan(tmp_path)
    node = plan.nodes[1]
    argv = remote_agent_command(node.target.ssh, plan.stage_dir, agent_argv(plan, node))
    assert argv[0] == "ssh" and "-T" in argv and "-tt" not in argv and "-t" not in argv
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    for wanted in ("BatchMode=yes", "StrictHostKeyChecking=yes", "UserKnownHostsFile=/k/known", "ConnectTimeout=10",
                   "ServerAliveInterval=5", "IdentitiesOnly=yes", "ProxyJump=jump"):
        assert wanted in opts
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "ops" and argv[argv.index("-i") + 1] == "/k/id"
    dest = argv.index("--")
    assert argv[dest + 1] == "10.0.0.2" and len(argv) == dest + 3  # one remote command string
    remote = shlex.split(argv[-1])  # what the remote POSIX shell will parse
    assert remote[:4] == ["exec", "/opt/my env/bin/python", "-m", "launcher.runtime.hostagent"]
    assert remote[remote.index("--") + 1 :] == list(agent_argv(plan, node))  # the torchrun agent argv, intact
    assert str(plan.stage_dir) in remote  # the odd run dir survives as one word
    assert NASTY not in argv[-1] and "GL" not in argv[-1]  # spec values never reach a command line


def test_remote_command_is_data_for_a_real_shell(tmp_path):
    """Run the exact remote string through /bin/sh with python replaced by printf: the shell
    must hand every word back unchanged (no command substitution, no word splitting)."""
    words = ["exec", "printf", "%s\\n", NASTY, "$(touch pwned)", "a b"]
    (cmd,) = ssh_argv(type("H", (), {"strict_host_key_checking": "yes", "connect_timeout_s": 1, "ssh_config": None,
                                   "known_hosts": None, "key": None, "ssh_options": {}, "port": 22, "user": None,
                                   "destination": "h"})(), words[1:])[-1:]
    done = subprocess.run(["/bin/sh", "-c", cmd], cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout.split("\n")[:-1] == [*NASTY.split("\n"), "$(touch pwned)", "a b"]
    assert not (tmp_path / "pwned").exists()


def test_host_side_helpers_answer_in_json(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "launcher.runtime.hostagent", "preflight", "--ifname", "lo", "--bind", "127.0.0.1"],
        capture_output=True, text=True, cwd=REPO,
    )
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith(JSON_TAG))
    import json

    data = json.loads(line[len(JSON_TAG) :])
    assert data["ifname_present"] is True and data["torch"] and data["port"] > 0 and data["bind_error"] is None
    assert data["inventory"]["cpu_count"] >= 1


def test_a_stage_session_reuses_the_hosts_connection(tmp_path):
    """The agent's ssh command names the host's control socket and never becomes a master: it is a
    session over the preflight's connection, not a new login; the remote side is quoted as before."""
    from launcher.backends.ssh import HostLink

    plan = _plan(tmp_path)
    node = plan.nodes[1]
    link = HostLink(node.target.ssh, tmp_path / "sockets" / "1")
    argv = link.session_argv(["/opt/my env/bin/python", "-m", "launcher.runtime.hostagent", "agent", "--", NASTY])
    dest = argv.index("--")
    assert argv[dest - 4 : dest] == ["-S", str(tmp_path / "sockets" / "1"), "-o", "ControlMaster=no"]
    assert "-M" not in argv and argv[dest + 1] == "10.0.0.2" and len(argv) == dest + 3
    assert shlex.split(argv[-1])[-1] == NASTY  # still one quoted word for the remote shell
