"""The embedded Ray's Prometheus discovery file goes with it (no target left down), and a newer
Ray's is left alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")

from launcher.backends.ray import DISCOVERY_FILE, forget_discovery  # noqa: E402


def _session(root: Path, name: str) -> Path:
    session = root / name
    session.mkdir(parents=True)
    (session / DISCOVERY_FILE).write_text(json.dumps([{"labels": {"job": "ray"}, "targets": ["127.0.0.1:39965"]}]))
    return session


def test_the_link_to_a_finished_sessions_targets_is_removed(tmp_path):
    session = _session(tmp_path, "session_a")
    (tmp_path / DISCOVERY_FILE).symlink_to(session / DISCOVERY_FILE)
    assert forget_discovery(str(session)) is True
    assert not (tmp_path / DISCOVERY_FILE).is_symlink() and not (session / DISCOVERY_FILE).exists()


def test_a_newer_rays_link_is_left_alone(tmp_path):
    ours, newer = _session(tmp_path, "session_a"), _session(tmp_path, "session_b")
    (tmp_path / DISCOVERY_FILE).symlink_to(newer / DISCOVERY_FILE)
    assert forget_discovery(str(ours)) is False
    assert (tmp_path / DISCOVERY_FILE).resolve() == (newer / DISCOVERY_FILE).resolve()
    assert (newer / DISCOVERY_FILE).exists() and not (ours / DISCOVERY_FILE).exists()
