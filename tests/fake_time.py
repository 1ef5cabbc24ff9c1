"""A clock a test owns, for code that reads its module's ``time``: the test asserts what the code
did when its timers ran out (which poll stopped, the reason, the state), never how long that took
on this machine. Install it on the module under test only::

    clock = FakeTime.install(monkeypatch, runloop)

``monotonic()`` and ``perf_counter()`` move only when the code sleeps (``sleep`` advances the clock
and returns at once, unless ``real_sleep``) or when the test calls ``advance``. ``time()`` is the
real wall clock plus what was advanced, so timestamps stay comparable with other modules'.
Anything else (``strftime``, ``CLOCK_BOOTTIME``, ...) is the real ``time`` module's.
"""

from __future__ import annotations

import time as _time
from types import ModuleType
from typing import Any, Callable

import pytest


class FakeTime:
    def __init__(self, start: float = 1000.0, *, real_sleep: bool = False, on_sleep: Callable[[int], None] | None = None) -> None:
        self.start = start
        self.now = start
        self.sleeps: list[float] = []  # every sleep the code asked for, in order
        self.real_sleep = real_sleep  # also sleep for real (the code waits on real processes)
        self.on_sleep = on_sleep  # called with the sleep's number (1, 2, ...) before it returns

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch, *modules: ModuleType, **kwargs: Any) -> FakeTime:
        clock = cls(**kwargs)
        for module in modules:
            monkeypatch.setattr(module, "time", clock)
        return clock

    @property
    def elapsed(self) -> float:
        """Seconds the code's clock moved since the start."""
        return self.now - self.start

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return _time.time() + self.elapsed

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if self.real_sleep:
            _time.sleep(seconds)
        self.now += max(0.0, seconds)
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)
