"""Polling helpers the rigs and tests share: each caller raises its own error with its own context."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.2) -> T:
    """Call ``predicate`` until it returns something truthy or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() <= deadline:
        time.sleep(interval_s)
        value = predicate()
    return value


def wait_empty(read: Callable[[], T], timeout_s: float, interval_s: float = 0.1) -> T:
    """Call ``read`` until it returns something empty (no leftovers) or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = read()
    return value
