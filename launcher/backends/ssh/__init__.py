"""Several servers over SSH: the torchrun engine's way to remote hosts, through the OpenSSH client.

One connection per host per run. The preflight logs in to every host once, in parallel, as an
SSH ControlMaster whose own session is the host's helper (``python -m launcher.runtime.hostagent
serve``): the preflight, the rendezvous port, each stage's directory and ``worker.json``, a signal
to the stage's ranks, and the files left on the host at the end are requests to that helper, one
JSON line each way, with no new login and no new interpreter. Each stage's agent runs in a session
multiplexed over the same connection (``ssh -S SOCKET``), its stdin the agent's lifeline (see
``launcher.runtime.hostagent``) and its output the stage's live channel: rank lines, and the
beacons and reports the agent forwards. The control sockets live in a private directory (0700)
that is removed, with every master process, when the run ends (``connection_scope``).

The helper writes a heartbeat line every second and the launcher pings the helper and every
agent's lifeline every second. A host whose connection closes, or that says nothing for
``heartbeat_timeout_s`` (default 5 s), is lost: the backend stops the stage at once, names the
host, and fetches nothing from it; a host that hears nothing from the launcher for as long stops
its agent and ranks by itself.

Every remote command is built with ``shlex.join`` so that no spec value is ever parsed by a shell
(spec values travel in ``worker.json`` and on stdin).

    command.py    the ssh command: options, quoting, what a failure means
    link.py       one connection per host per run (ControlMaster + the host's helper), heartbeats, loss
    transport.py  the torchrun engine's transport: agents in multiplexed sessions, signals, missed reports
    preflight.py  every host checked in parallel before anything starts
"""

from launcher.backends.ssh.command import SshError, heartbeat_timeout, remote_agent_command, ssh_argv, ssh_base_argv
from launcher.backends.ssh.link import HostLink, HostLinks, _parallel, _socket_dir, connection_scope, current_links
from launcher.backends.ssh.preflight import (
    HostReport, PreflightError, PreflightOutcome, check_host, local_torch_version, preflight, preflight_hosts, preflight_reports, remote_free_port,
)  # fmt: skip
from launcher.backends.ssh.transport import SshTransport

__all__ = [
    "HostLink", "HostLinks", "HostReport", "PreflightError", "SshError", "SshTransport", "_parallel", "_socket_dir", "check_host",
    "connection_scope", "current_links", "heartbeat_timeout", "local_torch_version", "preflight", "PreflightOutcome", "preflight_hosts", "preflight_reports",
    "remote_agent_command", "remote_free_port", "ssh_argv", "ssh_base_argv",
]  # fmt: skip
