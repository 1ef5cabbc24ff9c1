"""Secret masking, in one place: what counts as a secret and how it is hidden.

An env var whose *name* looks secret (``*TOKEN*``, ``*KEY*``, ``*PASSWORD*``, ...) has its value
shown as ``****`` wherever the launcher displays or stores an environment, and its value masked
in every log line, rank report and torchrun's own log copies. Standard library only.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MASK = "****"
MIN_SECRET_LEN = 4  # shorter values ("1", "on") would mask ordinary text


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """Env for display or storage: values of secret-looking names are masked."""
    return {k: (MASK if SECRET_NAME.search(k) else v) for k, v in env.items()}


def secret_values(env: Mapping[str, str]) -> tuple[str, ...]:
    """The values of secret-looking env names, longest first (so a value containing another is
    masked whole)."""
    found = {v for k, v in env.items() if SECRET_NAME.search(k) and isinstance(v, str) and len(v) >= MIN_SECRET_LEN}
    return tuple(sorted(found, key=len, reverse=True))


def redact(text: str, secrets: Iterable[str]) -> str:
    for value in secrets:
        if value in text:
            text = text.replace(value, MASK)
    return text


def redact_document(document: Any, secrets: tuple[str, ...]) -> Any:
    """A JSON-able document (a rank report: exception messages, results) with secrets masked;
    the same object when nothing needed masking."""
    if not secrets:
        return document
    text = json.dumps(document, default=str)
    masked = redact(text, tuple(json.dumps(v)[1:-1] for v in secrets))  # as they appear in JSON
    return document if masked == text else json.loads(masked)


def scrub_files(root: Path, secrets: tuple[str, ...]) -> None:
    """Mask secret values in files written outside the launcher's log router (torchrun's raw
    copies of the logs); best effort."""
    if not secrets or not root.is_dir():
        return
    for path in root.rglob("*"):
        try:
            if not path.is_file():
                continue
            text = path.read_text(errors="replace")
            masked = redact(text, secrets)
            if masked != text:
                tmp = path.with_name(f".{path.name}.scrub")
                tmp.write_text(masked)
                os.replace(tmp, path)
        except OSError:
            continue
