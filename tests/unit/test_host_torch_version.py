"""The host helper's preflight names the torch a host's interpreter would import without
importing ``importlib.metadata`` (a third of a login's CPU on the host): it must say what
``importlib.metadata`` says, and follow ``sys.path``'s order as it does."""

from __future__ import annotations

import sys
from importlib.metadata import version

from launcher.runtime.hostagent import torch_version


def test_it_agrees_with_importlib_metadata() -> None:
    assert torch_version() == version("torch")


def test_the_first_distribution_on_sys_path_wins_and_none_is_none(tmp_path, monkeypatch) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    (first / "torch-9.9.0+cu130.dist-info").mkdir(parents=True)
    (second / "torch-1.0.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), str(first), str(second)])
    assert torch_version() == "9.9.0+cu130"
    monkeypatch.setattr(sys, "path", [str(second)])
    assert torch_version() == "1.0.0"
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing")])
    assert torch_version() is None
