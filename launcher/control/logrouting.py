"""Route the agents' merged output into per-rank log files and the console.

Every rank line arrives prefixed ``host:rank| `` (torchrun's log-line prefix template, set by the
plan), from a local pipe or through SSH alike. The router splits it back into
``logs/rank<k>.log`` in the run directory, echoes it as ``host:rank`` on the console, and picks
out the agent's machine-readable failure lines.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import IO, Callable, Iterable

from launcher.masking import redact
from launcher.protocol import AGENT_FAILURE_TAG, LOG_PREFIX_SEPARATOR

_RANK_LINE = re.compile(r"^(?P<host>[^\s|]+):(?P<rank>\d+)" + re.escape(LOG_PREFIX_SEPARATOR))

Echo = Callable[[str, str], None]  # (source like "host:3" or "agent host", text)


class LogRouter:
    def __init__(self, logs_dir: Path, echo: Echo | None = None, *, secrets: Iterable[str] = ()) -> None:
        self.logs_dir = logs_dir
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.secrets = tuple(secrets)  # masked in every log line and on the console
        self.agent_failures: list[dict] = []
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()
        self._threads: dict[str, list[threading.Thread]] = {}
        self._last_line: dict[str, float] = {}  # per source, when its last line arrived

    def follow(self, stream: IO[bytes], source_host: str) -> None:
        """Read ``stream`` to its end in a background thread."""
        thread = threading.Thread(target=self._pump, args=(stream, source_host), daemon=True, name=f"logs-{source_host}")
        self._last_line[source_host] = time.monotonic()
        thread.start()
        self._threads.setdefault(source_host, []).append(thread)

    def drain(self, source_host: str, idle_s: float) -> bool:
        """Wait until everything ``source_host`` wrote has been routed (its streams ended).

        An agent's last lines (its failure records) can still be in the pipe, behind the ranks'
        output, when the agent has exited; a failure read before they are routed would lose the
        rank that caused it. Gives up once nothing has arrived for ``idle_s``, because a stray
        child may hold the pipe open. True when every stream of the host ended.
        """
        threads = self._threads.get(source_host, [])
        while any(t.is_alive() for t in threads):
            if time.monotonic() - self._last_line.get(source_host, 0.0) > idle_s:
                return False
            for thread in threads:
                thread.join(0.05)
        return True

    def _pump(self, stream: IO[bytes], source_host: str) -> None:
        for raw in iter(stream.readline, b""):
            self._last_line[source_host] = time.monotonic()
            self.route(raw.decode("utf-8", errors="replace").rstrip("\n"), source_host)
        stream.close()

    def route(self, line: str, source_host: str) -> None:
        line = redact(line, self.secrets)
        match = _RANK_LINE.match(line)
        if match:
            text = line[match.end() :]
            self._write(f"rank{match['rank']}.log", text)
            if self.echo:
                self.echo(f"{match['host']}:{match['rank']}", text)
            return
        if line.startswith(AGENT_FAILURE_TAG):
            try:
                record = json.loads(line[len(AGENT_FAILURE_TAG) :])
            except ValueError:
                record = None
            if isinstance(record, dict):
                record["host"] = source_host
                with self._lock:
                    self.agent_failures.append(record)
                return
        self._write(f"agent-{source_host}.log", line)
        if self.echo and line.strip():
            self.echo(f"{source_host}:agent", line)

    def write_rank_line(self, rank: int, host: str, text: str) -> None:
        """For backends whose ranks' output does not come through an agent (e.g. Ray actors)."""
        self.route(f"{host}:{rank}{LOG_PREFIX_SEPARATOR}{text}", host)

    def _write(self, name: str, text: str) -> None:
        with self._lock:
            handle = self._files.get(name)
            if handle is None:
                handle = self._files[name] = open(self.logs_dir / name, "a", encoding="utf-8")  # noqa: SIM115
            handle.write(text + "\n")
            handle.flush()

    def close(self, timeout_s: float = 5.0) -> None:
        for threads in self._threads.values():
            for thread in threads:
                thread.join(timeout_s)
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()
