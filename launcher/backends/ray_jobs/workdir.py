"""What a Ray submission ships as its job's working directory.

The spec's directory (or ``ray.working_dir``) is walked once: regular files only (a socket, a pipe,
a device or a broken link is skipped and named in one line), less what the launcher always leaves
out (caches, ``.git``, virtualenvs, run directories, the run's own ``--out``), what a ``.gitignore``
or ``.rayignore`` leaves out (in the directory, below it, and above it within its git repository)
and ``ray.excludes`` (gitignore patterns relative to the directory, as Ray's runtime_env
``excludes``). What is left must fit in ``ray.working_dir_max_mb``: a larger directory is refused
before anything is submitted, in one line naming its size, its largest parts and how to narrow it.
Only then are the files copied, beside the effective spec, into the folder Ray uploads.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from launcher.errors import EXIT_BAD_INPUT, LauncherError

# never shipped: caches, version control, virtualenvs, the launcher's run directories
DEFAULT_EXCLUDES = (
    "__pycache__/", "*.pyc", ".git/", ".hg/", ".venv/", "venv/", "*.egg-info/", "runs/",
    ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", ".ipynb_checkpoints/",
)  # fmt: skip
IGNORE_FILES = (".gitignore", ".rayignore")  # what Ray's own packaging honours, per directory
COUNT_LIMIT = 200_000  # entries: a directory far over the cap is not counted to its end
OVER_FACTOR = 10  # nor one past ten times the cap


def _pathspec(lines: Iterable[str]) -> Any:
    """Gitignore patterns, matched as Ray matches its runtime_env excludes (its own copy of pathspec)."""
    from ray._private.thirdparty.pathspec import PathSpec

    return PathSpec.from_lines("gitwildmatch", list(lines))


@dataclass(frozen=True)
class _Rule:
    """Gitignore patterns from one place, relative to the directory ``base`` (a path relative to
    the walk's top, "" for the top itself)."""

    base: str
    spec: Any

    def matches(self, path: str) -> bool:
        if self.base:
            if not path.startswith(self.base + "/"):
                return False
            path = path[len(self.base) + 1 :]
        return bool(path) and bool(self.spec.match_file(path))


def _ignore_rules(folder: Path, base: str) -> list[_Rule]:
    rules = []
    for name in IGNORE_FILES:
        try:
            text = (folder / name).read_text(errors="replace")
        except OSError:
            continue
        rules.append(_Rule(base, _pathspec(text.splitlines())))
    return rules


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


@dataclass(frozen=True)
class Shipment:
    """The files a Ray job's working directory holds: (path in it, the file here, bytes)."""

    root: Path
    files: tuple[tuple[str, Path, int], ...]
    skipped: tuple[str, ...]  # not regular files (sockets, pipes, devices, broken links), unreadable directories
    cap: int

    @property
    def total(self) -> int:
        return sum(size for _, _, size in self.files)

    def has(self, path: Path) -> bool:
        try:
            rel = path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return False
        return any(name == rel for name, _, _ in self.files)

    def describe(self) -> str:
        """One line: what goes, and what was skipped."""
        said = f"the Ray job's working dir: {len(self.files)} file(s), {_size(self.total)} from {self.root} (ray.working_dir_max_mb: {_size(self.cap)})"
        if self.skipped:
            shown = ", ".join(self.skipped[:3]) + (f" and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else "")
            said += f"; skipped {len(self.skipped)} that are not regular files (or cannot be read): {shown}"
        return said


def select(root: Path, *, excludes: Sequence[str] = (), out: Path | None = None, cap_bytes: int, label: str = "--address") -> Shipment:
    """The files of ``root`` a Ray job ships, or a LauncherError (exit 2, one line that starts
    with ``label``) when ``root`` is not a directory or what it would ship is over ``cap_bytes``."""
    root = Path(root)
    if not root.is_dir():
        raise LauncherError(f"{label}: ray.working_dir: {root} is not a directory; expected the directory the Ray job needs (its code)", exit_code=EXIT_BAD_INPUT)
    top, lead = _repository_top(root)
    rules = [_Rule(lead, _pathspec((*DEFAULT_EXCLUDES, *excludes, *_out_pattern(root, out))))]
    folder = root.resolve()
    while True:  # the .gitignore files above root, up to its repository's top
        base = folder.relative_to(top).as_posix() if folder != top else ""
        if folder != root.resolve():
            rules += _ignore_rules(folder, base)
        if folder == top:
            break
        folder = folder.parent
    files: list[tuple[str, Path, int]] = []
    skipped: list[str] = []
    total, walked, partial = 0, 0, False
    seen = {os.path.realpath(root)}
    stack: list[tuple[Path, str, list[_Rule]]] = [(root, "", rules + _ignore_rules(root, lead))]
    while stack and not partial:
        folder, rel_dir, active = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            skipped.append(f"{rel_dir or '.'}/ (unreadable)")
            continue
        for entry in entries:
            walked += 1
            if walked > COUNT_LIMIT or total > OVER_FACTOR * cap_bytes:
                partial = True
                break
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            path = f"{lead}/{rel}" if lead else rel  # as the rules see it: from the top
            try:
                mode = os.stat(entry.path).st_mode  # a link counts as what it points to
            except OSError:
                mode = 0  # a broken link
            if stat.S_ISDIR(mode):
                real = os.path.realpath(entry.path)
                if real in seen or any(r.matches(path + "/") or r.matches(path) for r in active):
                    continue
                seen.add(real)
                stack.append((Path(entry.path), rel, active + _ignore_rules(Path(entry.path), path)))
            elif any(r.matches(path) for r in active):
                continue
            elif not stat.S_ISREG(mode):
                skipped.append(rel)
            elif not os.access(entry.path, os.R_OK):
                skipped.append(f"{rel} (unreadable)")
            else:
                size = os.stat(entry.path).st_size
                files.append((rel, Path(entry.path), size))
                total += size
    shipment = Shipment(root, tuple(sorted(files)), tuple(sorted(skipped)), cap_bytes)
    if total > cap_bytes or partial:
        raise LauncherError(_too_big(shipment, partial, label), exit_code=EXIT_BAD_INPUT)
    return shipment


def _repository_top(root: Path) -> tuple[Path, str]:
    """The top of the git repository ``root`` is in (its .gitignore files above ``root`` count,
    as git counts them), or ``root`` itself; and ``root``'s path from that top."""
    resolved = root.resolve()
    for folder in (resolved, *resolved.parents):
        if (folder / ".git").exists():
            return folder, resolved.relative_to(folder).as_posix() if folder != resolved else ""
    return resolved, ""


def _out_pattern(root: Path, out: Path | None) -> list[str]:
    """The run directories' root (``--out``), when it is inside the shipped directory."""
    if out is None:
        return []
    try:
        rel = out.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return []
    return [f"/{rel}/"] if rel != "." else []


def _too_big(shipment: Shipment, partial: bool, label: str) -> str:
    parts: dict[str, int] = {}
    for rel, _, size in shipment.files:
        head, sep, _ = rel.partition("/")
        parts[head + sep] = parts.get(head + sep, 0) + size
    largest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    if shipment.total > shipment.cap:
        what = f"is {_size(shipment.total)}{' or more' if partial else ''}, over ray.working_dir_max_mb ({_size(shipment.cap)})"
    else:
        what = f"holds more than {COUNT_LIMIT} files"
    first = largest[0][0].rstrip("/") if largest else "data"
    return (
        f"{label}: the Ray job's working directory {shipment.root} {what}; largest: "
        f"{', '.join(f'{name} {_size(n)}' for name, n in largest) or 'none'}; leave them out with ray.excludes "
        f"(gitignore patterns, e.g. ray.excludes: [\"{first}\"]) or a .gitignore, or set ray.working_dir to the directory "
        "the job needs; nothing was submitted"
    )


def materialize(shipment: Shipment, dest: Path) -> None:
    """Copy the shipment's files into ``dest`` (the folder Ray uploads); a file that cannot be read
    any more is a one-line error (exit 2)."""
    for rel, src, _ in shipment.files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy(src, target)
        except OSError as exc:
            raise LauncherError(f"cannot ship {src} with the Ray job: {exc.strerror or exc}; nothing was submitted", exit_code=EXIT_BAD_INPUT) from None
