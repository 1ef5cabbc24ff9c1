"""A run's directory sent back over a Ray job's wire: the cluster side packs it as tagged,
checksummed base64 lines at the end of the wire (its own file, ``wirefile``: never the job's log,
which is for people); the submitting side unpacks it under ``--out``.

The run's record always travels, whatever its size: ``result.json``, the spec, every rank's report,
beacon and log, the plots. Only other large files (checkpoints, a job's own artifacts over
``MAX_BUNDLED_FILE``) stay on the cluster, listed in ``left_on_cluster.json``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
import tarfile
from pathlib import Path
from typing import Any

BUNDLE_TAG = "@gpulaunch-bundle "
BUNDLE_END = "@gpulaunch-bundle-end "
CHUNK = 16_000
MAX_BUNDLED_FILE = 1024**2  # larger artifacts (checkpoints) stay on the cluster instead of flooding the wire
LEFT_FILE = "left_on_cluster.json"
_RECORD_SUFFIXES = (".json", ".yaml", ".log", ".png")  # the run's record: sent back whatever its size


def _artifact(path: Path, max_file: int) -> bool:
    """A large file that is not part of the run's record: it stays on the cluster."""
    return path.suffix not in _RECORD_SUFFIXES and path.stat().st_size > max_file


def emit_bundle(run_dir: Path, write: Any = print, max_file: int = MAX_BUNDLED_FILE) -> list[str]:
    """Print ``run_dir`` (result.json, reports, logs, plots) as tagged base64 lines. Other files
    larger than ``max_file`` (checkpoints) stay on the cluster, listed in ``left_on_cluster.json``;
    the paths of those left behind are returned."""
    left = sorted(str(p) for p in run_dir.rglob("*") if p.is_file() and _artifact(p, max_file))
    if left:
        listing = {"host": socket.gethostname(), "files": [{"path": f, "bytes": Path(f).stat().st_size} for f in left]}
        (run_dir / LEFT_FILE).write_text(json.dumps(listing, indent=2))
    top = f"{run_dir.parent.name}/{run_dir.name}"
    skipped = {f"{top}/{Path(f).relative_to(run_dir).as_posix()}" for f in left}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(run_dir, arcname=top, filter=lambda info: None if info.name in skipped else info)
    data = base64.b64encode(buf.getvalue()).decode()
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [""]
    for i, chunk in enumerate(chunks):
        write(f"{BUNDLE_TAG}{i}/{len(chunks)} {chunk}")
    write(f"{BUNDLE_END}{hashlib.sha256(data.encode()).hexdigest()}")
    return left


class BundleLines:
    """The submitting side: keeps a log's bundle lines as they stream past."""

    def __init__(self) -> None:
        self.chunks: dict[int, str] = {}
        self.digest: str | None = None

    def take(self, line: str) -> bool:
        """True (and kept) for a bundle line; False for any other."""
        if line.startswith(BUNDLE_TAG):
            pos, _, chunk = line[len(BUNDLE_TAG) :].partition(" ")
            self.chunks[int(pos.partition("/")[0])] = chunk
            return True
        if line.startswith(BUNDLE_END):
            self.digest = line[len(BUNDLE_END) :].strip()
            return True
        return False

    def unpack(self, out: Path) -> Path | None:
        """The run directory unpacked under ``out``, or None if none came back whole."""
        data = "".join(self.chunks[i] for i in sorted(self.chunks))
        if not self.chunks or self.digest != hashlib.sha256(data.encode()).hexdigest():
            return None
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data)), mode="r:gz") as tar:
            names = tar.getnames()
            tar.extractall(out.resolve(), filter="data")
        top = Path(names[0].split("/")[0]) / names[0].split("/")[1]
        return (out / top).resolve()


def unpack_bundle(logs: str, out: Path) -> Path | None:
    """The run directory from a whole job log (``BundleLines`` over every line)."""
    bundle = BundleLines()
    for line in logs.splitlines():
        bundle.take(line)
    return bundle.unpack(out)
