"""The Ray Jobs API, as the submitter uses it: a client with the cluster's token, one-line errors,
a job's status, a stop that waits, and the job's log followed as it grows.

Token auth (``RAY_AUTH_TOKEN`` / ``~/.ray/auth_token``) is honoured, never switched off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from launcher.errors import EXIT_BAD_INPUT, LauncherError

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
POLL_S = 0.5
RAY_LOGGER = "ray"
RAY_LOG_FILE = "ray-submit.log"  # in the run directory: what Ray's client said while the run was submitted


def honour_token_auth() -> None:
    """Use Ray's token if the user has one and did not choose a mode (the launcher never disables it)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def check_address(address: str | None) -> str:
    address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or ""
    if not address.startswith(("http://", "https://")):
        shown = repr(address) if address else "nothing"
        raise LauncherError(
            f"--address: expected the Ray dashboard's http://HOST:8265 address (Ray Jobs API), got {shown}", exit_code=EXIT_BAD_INPUT
        )
    return address.rstrip("/")


def client(address: str | None) -> Any:
    """A JobSubmissionClient, or a one-line error (exit 2) when the cluster cannot be reached."""
    address = check_address(address)
    honour_token_auth()
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise LauncherError("--address needs Ray: pip install 'gpulaunch[ray]'", exit_code=EXIT_BAD_INPUT) from None
    # after the import: importing Ray configures its logger (INFO, to the console)
    logging.getLogger(RAY_LOGGER).setLevel(logging.ERROR)
    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # noqa: BLE001 - connection, auth and version errors all end here
        raise LauncherError(f"cannot use the Ray cluster at {address}: {one_line(exc)}", exit_code=EXIT_BAD_INPUT) from None


class _FolderMadeFileHandler(logging.FileHandler):
    """A log file made (with its folder) on the first record only."""

    def _open(self) -> Any:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


@contextlib.contextmanager
def ray_logs_into(path: Path) -> Iterator[None]:
    """Ray's own client-side lines (``Uploading package ...``, ``Creating a file package ...``)
    into ``path`` instead of the console; on the console only its errors. As it was, after."""
    logger = logging.getLogger(RAY_LOGGER)
    saved_level, saved_propagate, saved = logger.level, logger.propagate, [(h, h.level) for h in logger.handlers]
    handler = _FolderMadeFileHandler(path, delay=True, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for existing, level in saved:
        existing.setLevel(max(level, logging.ERROR))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # nor through the root logger's handlers
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(saved_level)
        logger.propagate = saved_propagate
        for existing, level in saved:
            existing.setLevel(level)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if "401" in text or "Unauthorized" in text or "authentication" in text.lower():
        return "authentication failed (set RAY_AUTH_TOKEN or ~/.ray/auth_token to the cluster's token)"
    if "Connection refused" in text or "Failed to connect" in text or "ConnectionError" in type(exc).__name__:
        return "connection refused (is the Ray head running and the dashboard on that port?)"
    return (text or type(exc).__name__)[:300]


def status(jobs: Any, job_id: str) -> str:
    value = jobs.get_job_status(job_id)
    return str(getattr(value, "value", value))


def stop_and_wait(jobs: Any, job_id: str, timeout_s: float = 60.0) -> str:
    """Ask the job to stop and wait up to ``timeout_s`` for it to end; its status then."""
    try:
        jobs.stop_job(job_id)
    except Exception as exc:  # noqa: BLE001
        raise LauncherError(f"cannot stop Ray job {job_id}: {one_line(exc)}") from None
    deadline = time.monotonic() + timeout_s
    now = status(jobs, job_id)
    while now not in TERMINAL and time.monotonic() < deadline:
        time.sleep(POLL_S)
        now = status(jobs, job_id)
    return now


class LogTail:
    """A job's log as it grows, whole lines at a time: streamed (the Jobs API's websocket tail, in
    a thread) so that a long job's log is not fetched whole at every look; read again once at the
    end, so that nothing the stream missed is lost; polled where the stream cannot be had."""

    def __init__(self, jobs: Any, job_id: str) -> None:
        self.jobs, self.job_id = jobs, job_id
        self._chunks: list[str] = []
        self._lock = threading.Lock()
        self._partial = ""
        self._seen = 0  # characters of the log taken so far
        self._streaming = True
        self._thread = threading.Thread(target=self._stream, daemon=True, name="gpulaunch-ray-log")
        self._thread.start()

    def _stream(self) -> None:
        async def tail() -> None:
            async for chunk in self.jobs.tail_job_logs(self.job_id):
                with self._lock:
                    self._chunks.append(chunk)

        try:
            asyncio.run(tail())
        except Exception:  # noqa: BLE001 - no websocket through this proxy, a dropped connection: poll instead
            self._streaming = False

    def lines(self, final: bool = False) -> list[str]:
        if final:
            self._thread.join(timeout=5.0)
            self._take(self._whole_log())  # whatever the stream missed
        elif not self._streaming and not self._chunks:
            self._take(self._whole_log())
        with self._lock:
            text, self._chunks = "".join(self._chunks), []
        self._seen += len(text)
        *complete, self._partial = (self._partial + text).split("\n")
        if final and self._partial:
            complete.append(self._partial)
            self._partial = ""
        return complete

    def _whole_log(self) -> str:
        try:
            return str(self.jobs.get_job_logs(self.job_id))
        except Exception:  # noqa: BLE001 - the head is gone: what came so far is all there is
            return ""

    def _take(self, log: str) -> None:
        """The part of the whole log beyond what was taken (and is still to take) so far."""
        with self._lock:
            pending = sum(len(c) for c in self._chunks)
            if len(log) > self._seen + pending:
                self._chunks.append(log[self._seen + pending :])
