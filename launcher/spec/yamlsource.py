"""Safe YAML loading that remembers where every value came from (file and line).

Validation errors are only useful when they point at the line to fix, so the loader composes
the node tree itself and records a location for each dotted path while building plain data.
Only ``yaml.SafeLoader`` is ever used: a spec can never construct arbitrary Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import SpecError

PathKey = tuple[Any, ...]


@dataclass(frozen=True)
class Location:
    file: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass
class SourcedData:
    """Plain data from YAML plus the location of every path in it."""

    data: Any
    locations: dict[PathKey, Location] = field(default_factory=dict)
    origin: Location = Location("<memory>")

    def locate(self, path: PathKey) -> Location:
        """The location of ``path``, or of its nearest ancestor that has one."""
        for end in range(len(path), -1, -1):
            found = self.locations.get(tuple(path[:end]))
            if found is not None:
                return found
        return self.origin


def read_text(path: Path, *, what: str = "file") -> str:
    """Read a UTF-8 file, turning every OS-level problem into a one-line SpecError."""
    if not path.exists():
        raise SpecError([f"{path}: no such {what}"])
    if path.is_dir():
        raise SpecError([f"{path}: is a directory, expected a YAML {what}"])
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError([f"{path}: cannot read: {exc.strerror}"]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([f"{path}: not UTF-8 text (byte {exc.start}); save the {what} as UTF-8"]) from None


def load_yaml(path: Path, *, what: str = "file") -> SourcedData:
    """Load one YAML document with the safe loader, keeping line numbers per path."""
    text = read_text(path, what=what)
    name = str(path)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise SpecError([f"{name}: empty file, expected a YAML mapping"])
        _refuse_alias_bombs(node, name)
        problems: list[str] = []
        locations: dict[PathKey, Location] = {}
        _index(node, (), name, locations, problems)
        if problems:
            raise SpecError(problems)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise SpecError([f"{name}{line}: YAML syntax error: {exc.problem or exc.context}"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"{name}: YAML error: {exc}"]) from None
    finally:
        loader.dispose()
    return SourcedData(data, locations, Location(name, 1))


# A spec is a few hundred values; aliases may repeat parts of it, but a document whose aliases
# expand to millions ("billion laughs": 400 bytes, nine levels of `&a [*a, *a, ...]`) is refused
# before anything walks the expansion, so every spec is judged within a second.
MAX_EXPANDED_VALUES = 100_000


def _refuse_alias_bombs(root: yaml.Node, file: str) -> None:
    """Count the values the document expands to, each distinct node once (memoised): linear in
    the file's size whatever its aliases do."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = 1  # a recursive alias counts once, not forever
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(item) for item in node.value)
        else:
            total = 1
        sizes[id(node)] = total
        if total > MAX_EXPANDED_VALUES:
            raise SpecError([f"{file}:{node.start_mark.line + 1}: YAML aliases expand this document to more than "
                             f"{MAX_EXPANDED_VALUES:,} values; expected a job spec (write the values out, or use fewer aliases)"])
        return total

    size(root)


def _index(node: yaml.Node, path: PathKey, file: str, out: dict[PathKey, Location], problems: list[str]) -> None:
    out.setdefault(path, Location(file, node.start_mark.line + 1))
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            if key in seen:
                dotted = ".".join(str(p) for p in (*path, key))
                problems.append(f"{file}:{key_node.start_mark.line + 1}: {dotted}: duplicate key")
            seen.add(key)
            here = (*path, key)
            out[here] = Location(file, key_node.start_mark.line + 1)
            _index(value_node, here, file, out, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index(item, (*path, i), file, out, problems)


def deep_merge(base: SourcedData, top: SourcedData) -> SourcedData:
    """``top`` over ``base``: mappings merge key by key, everything else is replaced."""

    replaced: list[PathKey] = []

    def merge(a: Any, b: Any, at: PathKey) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            merged = dict(a)
            for key, value in b.items():
                merged[key] = merge(a[key], value, (*at, key)) if key in a else value
            return merged
        replaced.append(at)
        return b

    data = merge(base.data, top.data, ())
    # what ``top`` replaced is gone: the base file's lines under it must not be blamed
    kept = {p: at for p, at in base.locations.items() if not any(p[: len(r)] == r and p != r for r in replaced)}
    return SourcedData(data, {**kept, **top.locations}, top.origin)


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, creating intermediate mappings (for ``--set``)."""
    keys = dotted.split(".")
    cursor = data
    for key in keys[:-1]:
        child = cursor.get(key)
        if not isinstance(child, dict):
            child = {}
            cursor[key] = child
        cursor = child
    cursor[keys[-1]] = value
