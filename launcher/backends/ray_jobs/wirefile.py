"""The remote-run wire of a Ray job on its own channel, so that the job's log stays for people.

Inside the job, the launcher writes the wire (``launcher.stage.wire``: rank lines, every event as
a tagged line, and at the end the run directory as a bundle) into a file of its own beside the
driver's log, ``gpulaunch-wire-<submission id>.log`` in the Ray log directory of the driver's node,
and writes the job's log for people: rank lines, the launcher's words, each stage and the outcome
(``JobLogEvents``), no tagged line. The submitting side streams that file through the dashboard's
log API (the same dashboard, token and address as the Jobs API), whole lines as they come, and
reads it whole once the job has ended, so that nothing the stream missed is lost.

A driver whose output is not a Ray job's log file (nothing to put the file beside) writes the wire
into its output as a Slurm job does; the submitting side then reads the job's log at the end.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any, TextIO

from launcher.stage.engine import FinishedRun
from launcher.stage.watch import PlainEvents

WIRE_PREFIX = "gpulaunch-wire-"
DRIVER_LOG_PREFIX = "job-driver-"  # Ray's name for a submitted job's log: job-driver-<submission id>.log
STREAM_INTERVAL_S = 0.2  # how often the node's agent looks for new bytes of the file
WAKE_S = 0.5  # how often the streaming thread looks whether it should stop
RETRY_S = 0.5


def wire_file_name(submission_id: str) -> str:
    return f"{WIRE_PREFIX}{submission_id}.log"


# --- inside the job -----------------------------------------------------------------------------------


def driver_wire_path(fd: int = 1) -> Path | None:
    """The wire file beside this driver's own log (``fd`` is the job's log file: Ray's job
    supervisor opens it for the driver's output), or None where the output is something else."""
    try:
        log = Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
    name = log.name
    if not (name.startswith(DRIVER_LOG_PREFIX) and name.endswith(".log") and log.is_file()):
        return None
    return log.with_name(wire_file_name(name[len(DRIVER_LOG_PREFIX) : -len(".log")]))


def open_wire() -> TextIO | None:
    """The wire file, opened for appending whole lines; None: the wire goes into the job's output."""
    path = driver_wire_path()
    if path is None:
        return None
    try:
        return open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - the launcher inside closes it at its end
    except OSError:
        return None


class JobLogEvents(PlainEvents):
    """The job's log as people read it (the dashboard's Logs pane, ``launch logs``): rank lines as
    ``host:rank text``, the launcher's words, each stage and the outcome; no progress, no tagged
    line, and not the cluster's result path (the run directory goes back to the submitting side)."""

    def finished(self, result: FinishedRun) -> None:
        failure = result.data.get("failure") or {}
        self._print(f"{result.data.get('job')}: {result.status}" + (f": {failure.get('summary')}" if failure else ""))


# --- the submitting side ------------------------------------------------------------------------------


class WireTail:
    """A Ray job's wire file as it grows, whole lines at a time: streamed in a thread from the
    driver's node through the dashboard (``/api/v0/logs/stream``, from the file's first byte; a
    dropped stream is opened again and skips what came), and read whole once at the end."""

    def __init__(self, jobs: Any, job_id: str) -> None:
        self.jobs, self.job_id = jobs, job_id
        self.filename = wire_file_name(job_id)
        self.found = False  # the file was there (the driver writes its wire into it)
        self._node: str | None = None
        self._data = bytearray()  # received, not taken yet
        self._received = 0  # bytes of the file received so far
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._final = False
        self._thread = threading.Thread(target=self._follow, daemon=True, name="gpulaunch-ray-wire")
        self._thread.start()

    # the stream, in its thread -------------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._stop.is_set():
            node = self._driver_node()
            if node is not None:
                try:
                    asyncio.run(self._stream(node))
                except Exception:  # noqa: BLE001 - no file yet, a dropped connection: open it again
                    pass
            self._stop.wait(RETRY_S)

    def _driver_node(self) -> str | None:
        """The node the job's driver runs on (known once it runs)."""
        if self._node is None:
            try:
                self._node = getattr(self.jobs.get_job_info(self.job_id), "driver_node_id", None) or None
            except Exception:  # noqa: BLE001 - the head is busy or gone: asked again
                return None
        return self._node

    def _params(self, node: str, media: str) -> dict[str, str]:
        params = {"node_id": node, "filename": self.filename, "lines": "-1"}
        return {**params, "interval": str(STREAM_INTERVAL_S)} if media == "stream" else params

    async def _stream(self, node: str) -> None:
        import aiohttp

        ssl = _aiohttp_ssl(getattr(self.jobs, "_verify", True))
        url = f"{self.jobs._address}/api/v0/logs/stream"  # noqa: SLF001 - the client's own address, token and cookies
        async with aiohttp.ClientSession(headers=self.jobs._headers, cookies=self.jobs._cookies) as session:  # noqa: SLF001
            async with session.get(url, params=self._params(node, "stream"), ssl=ssl) as answer:
                if answer.status != 200:
                    return  # not written yet
                self.found = True
                skip = self._received  # a stream opened again starts at the file's first byte
                while not self._stop.is_set():
                    try:
                        chunk = await asyncio.wait_for(answer.content.readany(), WAKE_S)
                    except asyncio.TimeoutError:
                        continue
                    if not chunk:
                        return
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                    if chunk:
                        self._add(chunk)

    def _add(self, chunk: bytes) -> None:
        with self._lock:
            self._data += chunk
            self._received += len(chunk)

    # the follower's side ---------------------------------------------------------------------------------
    def lines(self, final: bool = False) -> list[str]:
        """The whole lines since the last call; ``final`` (the job has ended): the rest of the
        file, read whole, and the stream closed."""
        if final and not self._final:
            self.close()
            self._final = True
            whole = self._whole_file()
            if whole is not None:
                self.found = True
                with self._lock:
                    if len(whole) > self._received:
                        self._data += whole[self._received :]
                        self._received = len(whole)
        with self._lock:
            cut = len(self._data) if final else self._data.rfind(b"\n") + 1
            taken = bytes(self._data[:cut])
            del self._data[:cut]
        text = taken.decode("utf-8", errors="replace")
        return text.split("\n")[:-1] if text.endswith("\n") else (text.split("\n") if text else [])

    def _whole_file(self) -> bytes | None:
        import requests

        node = self._driver_node()
        if node is None:
            return None
        verify = getattr(self.jobs, "_verify", True)
        try:
            answer = requests.get(
                f"{self.jobs._address}/api/v0/logs/file", params=self._params(node, "file"),  # noqa: SLF001
                headers=self.jobs._headers, cookies=self.jobs._cookies, timeout=120, verify=verify,  # noqa: SLF001
            )  # fmt: skip
        except requests.RequestException:
            return None
        return answer.content if answer.status_code == 200 else None

    def close(self) -> None:
        """Stop streaming (within ``WAKE_S``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


def _aiohttp_ssl(verify: Any) -> Any:
    """The Jobs client's ``verify`` (True, False or a CA bundle's path) as aiohttp's ``ssl``."""
    if verify is True:
        return None  # aiohttp's default: verified
    if verify is False:
        return False
    import ssl

    return ssl.create_default_context(cafile=str(verify))
