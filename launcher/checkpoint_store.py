"""A stage's checkpoint directory on disk: complete checkpoints, their manifests, what a load may trust.

Standard library only: the rank runtime saves and loads through it (``launcher.runtime.checkpoint``)
and the launcher checks a directory with it before anything starts (``launch``, ``launch resume``).

Layout: ``<root>/step-000000040/`` holds the checkpoint's files and ``manifest.json`` (the step, the
job it belongs to, each file's size and SHA-256). A checkpoint is written under a temporary name
(``.partial-step-...``) and renamed once its files and manifest are on disk, so a directory named
``step-*`` is complete by construction: a process killed mid-write leaves only a ``.partial-*``
directory, which no load ever reads. A ``step-*`` directory whose manifest does not parse, whose
files differ from their digests, or that another job wrote is an error naming its path, never a
silent fresh start.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
STATE_FILE = "state.pt"  # a replicated checkpoint: one torch.save file
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
PARTIAL_PREFIX = ".partial-"


class CheckpointError(Exception):
    """A checkpoint that must not be loaded, or a directory that cannot hold one: one line, its path."""


def job_identity(name: str, program: str, args: tuple[str, ...] = ()) -> str:
    """What a checkpoint must carry to be this job's: its name and its program (entrypoint or
    script and arguments), not its params, so a run may change a learning rate or its epochs and
    still resume, while another job's directory is refused."""
    blob = json.dumps([name, program, list(args)]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class FileDigest:
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint says of itself."""

    step: int
    job: str
    job_identity: str
    format: str  # "torch": one torch.save file of rank 0's (replicated) state; "dcp": torch.distributed.checkpoint shards
    world_size: int
    saved_at: float
    run_id: str = ""
    attempt: int = 0
    files: Mapping[str, FileDigest] = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["files"] = {name: asdict(d) for name, d in self.files.items()}
        return data

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        path = folder / MANIFEST
        try:
            data = json.loads(path.read_text())
            files = {str(name): FileDigest(int(d["bytes"]), str(d["sha256"])) for name, d in data.pop("files").items()}
            known = {k: data[k] for k in ("step", "job", "job_identity", "format", "world_size", "saved_at", "run_id", "attempt", "version") if k in data}
            manifest = cls(files=files, **known)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {folder}: no {MANIFEST}; expected one in every step-* directory (delete the directory to drop it)") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {path}: corrupted manifest ({type(exc).__name__}: {exc}); delete {folder} to drop it") from None
        if manifest.format not in ("torch", "dcp") or not isinstance(manifest.step, int):
            raise CheckpointError(f"checkpoint {path}: corrupted manifest (format {manifest.format!r}, step {manifest.step!r}); delete {folder} to drop it")
        return manifest


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def partial_dir(root: Path, step: int, writer: str) -> Path:
    """Where a checkpoint is written before it is complete; ``writer`` tells concurrent writers apart."""
    return root / f"{PARTIAL_PREFIX}step-{step:09d}-{writer}"


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-*`` directory under ``root``, oldest first (none when ``root`` does not exist)."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), Path(e.path)) for e in entries if e.is_dir() and (m := _STEP_DIR.match(e.name))]
    return sorted(found)


def file_digest(path: Path) -> FileDigest:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
            size += len(chunk)
    return FileDigest(size, digest.hexdigest())


def digest_of(payload: bytes) -> FileDigest:
    """The digest of bytes in memory, as ``file_digest`` gives a file's."""
    return FileDigest(len(payload), hashlib.sha256(payload).hexdigest())


def write_manifest(folder: Path, manifest: Manifest) -> None:
    path = folder / MANIFEST
    with open(path, "w") as handle:
        json.dump(manifest.to_dict(), handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_path(path: Path) -> None:
    """A file's bytes, or a folder's entries, on disk before this returns."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial: Path, final: Path) -> bool:
    """Make a written checkpoint complete: one rename. False when another writer published the
    same step first (a filesystem every host shares); its copy stays and ours goes."""
    fsync_path(partial)
    try:
        os.rename(partial, final)
    except OSError:
        if final.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
            return False
        raise
    fsync_path(final.parent)
    return True


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; older ones go (a concurrent pruner's too)."""
    for _step, folder in complete_steps(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(folder, ignore_errors=True)


def drop_partials(root: Path) -> None:
    """Remove what writers killed mid-write left behind (called when no one writes: at a load)."""
    for entry in root.glob(f"{PARTIAL_PREFIX}*") if root.is_dir() else ():
        shutil.rmtree(entry, ignore_errors=True)


def check_owner(folder: Path, manifest: Manifest, identity: str) -> None:
    """Raise unless the checkpoint in ``folder`` is this job's (``job_identity``)."""
    if identity and manifest.job_identity != identity:
        raise CheckpointError(
            f"checkpoint {folder}: written by another job ({manifest.job!r}, identity {manifest.job_identity}, not {identity}); "
            "expected this job's checkpoints there: use another checkpoint.dir or delete it"
        )


def check_files(folder: Path, manifest: Manifest) -> None:
    """Raise unless every file of the checkpoint matches its digest."""
    for name, expected in manifest.files.items():
        path = folder / name
        try:
            got = file_digest(path)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: cannot read it ({exc.strerror or exc}); delete {folder} to drop the checkpoint") from None
        if got != expected:
            raise CheckpointError(
                f"checkpoint {path}: {got.bytes} bytes, sha256 {got.sha256[:12]}..., but its manifest says {expected.bytes} bytes, "
                f"{expected.sha256[:12]}...; delete {folder} to drop the checkpoint"
            )


def latest(root: Path, identity: str, *, verify_files: bool = True) -> tuple[Manifest, Path] | None:
    """The newest complete checkpoint under ``root`` if it is this job's (and, with
    ``verify_files``, intact); None if there is none. Raises ``CheckpointError`` for one that is
    not to be trusted (see the module): never a silent fresh start."""
    steps = complete_steps(root)
    if not steps:
        return None
    folder = steps[-1][1]
    manifest = Manifest.read(folder)
    check_owner(folder, manifest, identity)
    if verify_files:
        check_files(folder, manifest)
    return manifest, folder


def check_writable(root: Path) -> None:
    """Raise unless checkpoints can be written under ``root`` (created if missing)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f"{PARTIAL_PREFIX}probe-{os.getpid()}-{time.monotonic_ns()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise CheckpointError(f"checkpoint.dir {root}: not writable ({exc.strerror or exc}); expected a directory this user can write") from None
