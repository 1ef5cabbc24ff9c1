"""Helpers for the fault-injection tests: write a spec for ``faulty.py``, launch it as a real
``python -m launcher`` process, find its run directory, wait for its workers, and check the
process table. Every process a test starts is ended by pid in ``Launched.close``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO, pids_mentioning

ENTRY = "tests.integration.faulty:run"
MEASURED: dict[str, float] = {}  # figures the tests measured, printed at the end of the session


def write_spec(tmp_path: Path, name: str = "faulty", **fields: Any) -> Path:
    spec: dict[str, Any] = {
        "name": name,
        "entrypoint": ENTRY,
        "resources": {"cpu_workers": 2},
        # the gloo timeout is an hour: only fail-fast teardown can end a blocked collective
        "timeouts": {"rendezvous_s": 3600, "run_s": 600},
        "env": {"PYTHONPATH": pythonpath()},
    }
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    if "script" in spec:
        spec.pop("entrypoint")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def pythonpath(*front: str | Path, base: str | None = None) -> str:
    """A child's PYTHONPATH: ``front``, then the repository, then the caller's own entries (``base``,
    default this process's PYTHONPATH), each once. Prepend, never replace: where packages come
    through PYTHONPATH (a GPU machine's wheels in /tmp/site: benchmarks/gpu_session.sh), a child
    without them cannot import the launcher."""
    caller = os.environ.get("PYTHONPATH", "") if base is None else base
    entries = [str(p) for p in front] + [str(REPO)] + caller.split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def child_env(*front: str | Path) -> dict[str, str]:
    """This process's environment for a child ``python -m launcher``: the repository (and
    ``front``) prepended to the caller's PYTHONPATH, which it keeps."""
    return {**os.environ, "PYTHONPATH": pythonpath(*front), "PYTHONUNBUFFERED": "1"}


class Launched:
    """``python -m launcher SPEC --out OUT`` running in the background."""

    def __init__(self, spec: Path, out: Path, *extra: str) -> None:
        self.out = out
        self.log = open(out.parent / f"{out.name}-launcher.log", "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", str(spec), "--out", str(out), *extra],
            cwd=REPO,
            env=child_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run_dir(self, timeout_s: float = 60) -> Path:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [p for p in self.out.glob("*/*") if p.is_dir()]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no run directory under {self.out} after {timeout_s}s:\n{self.output()}")

    def wait_running(self, ranks: int, timeout_s: float = 120) -> dict[int, int]:
        """Wait until every rank reports phase 'running'; return rank -> worker pid."""
        run_dir = self.run_dir(timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = {}
            for path in run_dir.glob("world*/progress/rank*.json"):
                try:
                    data = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if data.get("phase") == "running":
                    pids[int(path.stem[4:])] = int(data["pid"])
            if len(pids) == ranks:
                return pids
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited ({self.proc.returncode}) before its ranks ran:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"ranks not running after {timeout_s}s:\n{self.output()}")

    def wait(self, timeout_s: float = 180) -> int:
        return self.proc.wait(timeout=timeout_s)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def close(self) -> None:
        """Finalizer: the launcher and anything still mentioning the run directory, by pid."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        kill_pids(pids_mentioning(str(self.out)))
        self.log.close()


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_no_pids(text: str, timeout_s: float) -> tuple[list[int], float]:
    """Wait until no live process mentions ``text``; return (survivors, seconds waited)."""
    t0 = time.monotonic()
    left = pids_mentioning(text)
    while left and time.monotonic() - t0 < timeout_s:
        time.sleep(0.02)
        left = pids_mentioning(text)
    return left, time.monotonic() - t0


def describe(pids: list[int]) -> str:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            out.append(f"{pid}: (gone)")
    return "\n".join(out)


def result_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "result.json").read_text())


def record(name: str, seconds: float) -> None:
    MEASURED[name] = round(seconds, 3)
    print(f"measured: {name} = {seconds:.2f}s")
