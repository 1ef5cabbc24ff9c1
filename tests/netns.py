"""Small helpers both namespace rigs use (tests/cluster's sshd hosts, tests/slurm's nodes)."""

from __future__ import annotations

import subprocess


def sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a command (``ip ...`` mostly); raise with its stderr when ``check`` and it failed."""
    done = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def netns_pids(ns: str) -> set[int]:
    """Every process in network namespace ``ns`` (empty once it is gone)."""
    done = sh("ip", "netns", "pids", ns, check=False)
    return {int(p) for p in done.stdout.split() if p.strip().isdigit()} if done.returncode == 0 else set()
