"""``launch`` in the launching host's namespace on a pseudo-terminal, as a user at a terminal runs
it (rich draws its live progress line only there), with its live ``/metrics`` scraped from that
namespace."""

from __future__ import annotations

import os

import re
import shlex
import subprocess
import sys
import threading
from typing import Mapping

from tests.cluster.conftest import REPO, NetnsCluster
from tests.integration.faultkit import pythonpath

SCRAPE = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class TerminalRun:
    """``launch`` in the launching host's namespace on a pseudo-terminal (``script``), as a user
    at a terminal runs it: rich draws the live line there. Its output is read as it comes."""

    def __init__(self, cluster: NetnsCluster, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.cluster = cluster
        command = shlex.join([sys.executable, "-m", "launcher", *args])
        self.proc = subprocess.Popen(
            cluster.ns_cmd("script", "-qfec", command, "/dev/null"),
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "TERM": "xterm", "COLUMNS": "200", "LINES": "50", "PYTHONPATH": pythonpath(),
                 "GPULAUNCH_PROM_SD_DIR": os.environ["GPULAUNCH_PROM_SD_DIR"], **(env or {})},
        )  # fmt: skip
        self.text = ""
        self.last_scrape = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for chunk in iter(lambda: self.proc.stdout.read1(4096), b""):  # type: ignore[union-attr]
            self.text += ANSI.sub("", chunk.decode(errors="replace").replace("\r", "\n"))

    def metrics_url(self) -> str | None:
        found = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", self.text)
        return found.group(1) if found else None

    def scrape(self) -> dict[tuple[str, str], dict[str, float]]:
        """metric name -> {(rank, node): value} of the live endpoint, read from the launching host."""
        url = self.metrics_url()
        assert url, self.text[-2000:]
        done = subprocess.run(self.cluster.ns_cmd(sys.executable, "-c", SCRAPE, url), capture_output=True, text=True, timeout=30)
        self.last_scrape = done.stdout  # the exposition as Prometheus reads it, for a test's log
        out: dict = {}
        for m in re.finditer(r'^(gpulaunch_\w+)\{([^}]*)\} (\S+)$', done.stdout, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if "rank" in labels:
                out.setdefault(m.group(1), {})[(labels["rank"], labels.get("node", ""))] = float(m.group(3))
        return out

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code
