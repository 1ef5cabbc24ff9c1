"""A detached run's controller over SSH, from wherever ``launch`` runs: start it on the cluster's
controller host, ask how it is, follow its output, stop it, bring its run directory home.

The run loop of ``launch JOB --cluster FILE --detach`` lives on the controller host (the cluster
file's ``controller:``, else its first host), as ``python -m launcher.control.detached_controller run
RUN_DIR`` in a session of its own, its output (the remote-run wire, ``launcher.stage.wire``) in
``RUN_DIR/controller.log``. Everything here is one plain ``ssh`` to that host running
``python -m launcher.control.detached_controller CMD RUN`` with the cluster file's own options: the answers
are one JSON line, or, for ``follow``, the log's lines and then one end line. Nothing listens
anywhere: the controller's ``/metrics`` stays on the controller's loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Mapping

from launcher.backends.ssh.command import SshError, _explain_failure, ssh_argv
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.stage.engine import Detacher, JobInfo

if TYPE_CHECKING:
    from launcher.spec.cluster import HostConfig

CONTROLLER_MODULE = "launcher.control.detached_controller"
END_TAG = "@gpulaunch-detached "  # the follower's last line: how the controller ended (never a wire line)
CALL_TIMEOUT_S = 60.0


def _remote(host: HostConfig, *args: str) -> list[str]:
    return ssh_argv(host, [host.python, "-m", CONTROLLER_MODULE, *args])


def call(host: HostConfig, *args: str, stdin: str | None = None, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
    """``python -m launcher.control.detached_controller ARGS`` on ``host``: its one JSON answer (the last
    line of its output). A refusal there (an unknown run) is a LauncherError with its words."""
    try:
        done = subprocess.run(_remote(host, *args), input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise LauncherError(f"{host.name}: no answer in {timeout_s:.0f} s to `{' '.join(args[:1])}`", exit_code=EXIT_BAD_INPUT) from None
    except OSError as exc:
        raise LauncherError(f"cannot run the ssh client: {exc}", exit_code=EXIT_BAD_INPUT) from None
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    data: Any = None
    if lines:
        with contextlib.suppress(ValueError):
            data = json.loads(lines[-1])
    if isinstance(data, dict) and "error" in data:
        raise LauncherError(f"{host.name}: {data['error']}", exit_code=int(data.get("exit_code") or EXIT_BAD_INPUT))
    if done.returncode != 0 or not isinstance(data, dict):
        raise LauncherError(f"{host.name}: {_explain_failure(host, done.returncode, done.stderr or done.stdout)}", exit_code=EXIT_BAD_INPUT)
    return data


def start(host: HostConfig, payload: dict[str, Any]) -> dict[str, Any]:
    """Make the run directory on ``host`` and start the controller there, in a session of its
    own; returns once it runs (its pid, the run directory)."""
    return call(host, "start", stdin=json.dumps(payload))


def resume(host: HostConfig, run: str) -> dict[str, Any]:
    """Start the controller of ``run`` again, resuming its run from its last checkpoints."""
    return call(host, "resume", run)


def info(host: HostConfig, run: str, *, probe: str | None = None) -> dict[str, Any]:
    """What the controller host has of ``run``: its run directory, the controller's pid, whether
    it lives, its exit code and result status once ended."""
    return call(host, "status", run, *(("--probe", probe) if probe else ()))


def job_info(host: HostConfig, run: str) -> JobInfo:
    return as_job_info(host, info(host, run))


def as_job_info(host: HostConfig, data: dict[str, Any]) -> JobInfo:
    state = str(data.get("state") or "UNKNOWN")
    meta = {"host": host.name, "run_dir": str(data.get("run_dir", "")), "pid": str(data.get("pid", ""))}
    if data.get("exit_code") is not None:
        meta["exit_code"] = str(data["exit_code"])
    return JobInfo(str(data.get("run_id", "")), state, state != "RUNNING", str(data.get("message", "")), meta, "launch (detached)")


def stop(host: HostConfig, run: str, *, wait_s: float) -> JobInfo:
    """SIGTERM to the controller (it stops the run on every host, as a foreground launcher does
    on SIGTERM, and writes its result); waits until it has ended."""
    data = call(host, "stop", run, "--wait-s", f"{wait_s:g}", timeout_s=wait_s + 60.0)
    return as_job_info(host, data)


@contextlib.contextmanager
def following(host: HostConfig, run: str, *, wait: bool) -> Iterator[Iterator[str]]:
    """The controller's output lines (the wire) from its start, through one ssh connection; with
    ``wait``, on until the controller has ended. The last line is the end line (``END_TAG``).
    Leaving the block (Ctrl-C included) ends the ssh client, and with it the follower there (its
    stdin closes); the controller is not touched."""
    proc = subprocess.Popen(
        _remote(host, "follow", run, *(("--wait",) if wait else ())),
        stdin=subprocess.PIPE,  # the follower's lifeline: it ends when this side does
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,  # Ctrl-C is this process's to handle
    )

    def lines() -> Iterator[str]:
        assert proc.stdout is not None
        for raw in proc.stdout:
            yield raw.rstrip("\n")
        code = proc.wait()
        if code != 0:
            err = proc.stderr.read() if proc.stderr is not None else ""
            last = [ln for ln in err.splitlines() if ln.strip()]
            with contextlib.suppress(ValueError, IndexError):
                refused = json.loads(last[-1])
                if isinstance(refused, dict) and "error" in refused:
                    raise LauncherError(f"{host.name}: {refused['error']}", exit_code=EXIT_BAD_INPUT)
            raise LauncherError(f"{host.name}: {_explain_failure(host, code, err)}", exit_code=EXIT_BAD_INPUT)

    try:
        yield lines()
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def end_of(line: str) -> dict[str, Any] | None:
    """The follower's end line, parsed (None for any other line)."""
    if not line.startswith(END_TAG):
        return None
    try:
        data = json.loads(line[len(END_TAG) :])
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def fetch(host: HostConfig, run: str, out: Path, *, say: Callable[[str], None]) -> Path:
    """Bring the run directory home, into ``out/<job>/<run-id>``: one tar stream over ssh,
    unpacked beside it and then put in its place (what was fetched before is replaced). A
    directory that is the controller's own (a shared filesystem) is left as it is."""
    probe = secrets.token_hex(8)
    data = info(host, run, probe=probe)
    remote_dir = Path(str(data["run_dir"]))
    dest = out.resolve() / remote_dir.parent.name / remote_dir.name
    seen = dest / "detached" / "fetch-probe"
    if seen.is_file() and seen.read_text().strip() == probe:
        say(f"{dest} is the controller's own run directory (a shared filesystem): nothing to copy")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".fetch-{remote_dir.name}-", dir=dest.parent))
    try:
        tar = ssh_argv(host, ["tar", "-C", str(remote_dir.parent), "-cf", "-", remote_dir.name])
        with subprocess.Popen(tar, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) as remote:
            done = subprocess.run(["tar", "-xf", "-", "-C", str(partial)], stdin=remote.stdout, capture_output=True, check=False)
            err = remote.stderr.read().decode(errors="replace") if remote.stderr is not None else ""
            remote.wait(timeout=3600)
        got = partial / remote_dir.name
        if remote.returncode != 0 or done.returncode != 0 or not got.is_dir():
            why = _explain_failure(host, remote.returncode, err) if remote.returncode else done.stderr.decode(errors="replace").strip()
            raise LauncherError(f"launch fetch {run}: could not copy {host.name}:{remote_dir}: {why}", exit_code=EXIT_BAD_INPUT)
        (got / "detached" / "fetch-probe").unlink(missing_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(got, dest)
    except SshError as exc:
        raise LauncherError(f"launch fetch {run}: {exc}", exit_code=EXIT_BAD_INPUT) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


class SshDetacher(Detacher):
    """The torchrun engine's run loop on a cluster file's controller host, reached over SSH: the
    registry's detacher for ``launch --cluster FILE --detach`` (``launcher.backends.detacher``)."""

    engine = "torchrun"

    def start(self, host: HostConfig, payload: Mapping[str, Any]) -> Mapping[str, Any]:
        return start(host, dict(payload))

    def resume(self, host: HostConfig, run: str) -> Mapping[str, Any]:
        return resume(host, run)

    def job_info(self, host: HostConfig, run: str) -> JobInfo:
        return job_info(host, run)

    def stop(self, host: HostConfig, run: str, *, wait_s: float) -> JobInfo:
        return stop(host, run, wait_s=wait_s)

    def following(self, host: HostConfig, run: str, *, wait: bool) -> ContextManager[Iterator[str]]:
        return following(host, run, wait=wait)

    def end_of(self, line: str) -> dict[str, Any] | None:
        return end_of(line)

    def fetch(self, host: HostConfig, run: str, out: Path, *, say: Callable[[str], None]) -> Path:
        return fetch(host, run, out, say=say)
