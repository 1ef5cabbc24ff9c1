"""What a stage does about what goes wrong: the failure classes a restart is for, and the restart,
hang and straggler policies a stage's plan carries (``StagePlan.restart``, ``.hang``, ``.stragglers``).

The policies carry values, never defaults: every default is the spec's (``launcher.spec.model``),
and ``control.planning`` builds each policy from the spec it loaded. Standard library only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureClass(str, enum.Enum):
    """What kind of failure ended an attempt: what ``restart_on`` chooses among."""

    JOB_ERROR = "job_error"  # an exception raised by the job's own code
    OOM = "oom"  # the kernel's OOM killer, or the device out of memory
    HOST_LOST = "host_lost"  # an SSH host, a Slurm node that stopped answering
    RANK_LOST = "rank_lost"  # a rank killed by a signal, or that exited without an exception; a Ray actor that died
    HANG = "hang"  # no progress for timeouts.hang_s
    RENDEZVOUS = "rendezvous"  # the ranks could not meet (store, timeout) before the job ran
    TIMEOUT = "timeout"  # timeouts.run_s ran out
    STOPPED = "stopped"  # Ctrl-C, SIGTERM, launch stop: never restarted
    PREEMPTED = "preempted"  # stopped after a notice the job saved for: ``launch resume`` continues it

    @classmethod
    def restartable(cls) -> tuple["FailureClass", ...]:
        """Every class a restart can be for ("all" in restart_on): not a user's stop."""
        return tuple(c for c in cls if c not in (cls.STOPPED, cls.PREEMPTED))


@dataclass(frozen=True)
class HangPolicy:
    """When a stage counts as hung (``hang_s`` without progress; None: never) and what follows
    (spec: ``timeouts.hang_s``, ``timeouts.on_hang``)."""

    hang_s: float | None
    on_hang: str | None  # "stop" | "restart" | None: as the restart policy says


@dataclass(frozen=True)
class RestartPolicy:
    """Which failures a stage restarts for, how often, and a stop notice's grace (spec:
    ``max_restarts``, ``restart_on``, ``timeouts.on_hang``, ``preemption.grace_s``)."""

    max_restarts: int
    restart_on: frozenset[FailureClass]
    stop_grace_s: float

    @classmethod
    def of(cls, max_restarts: int, restart_on: tuple[str, ...], on_hang: str | None, stop_grace_s: float) -> "RestartPolicy":
        classes = set(FailureClass.restartable() if "all" in restart_on else (FailureClass(c) for c in restart_on))
        if on_hang == "restart":
            classes.add(FailureClass.HANG)
        elif on_hang == "stop":
            classes.discard(FailureClass.HANG)
        return cls(max_restarts, frozenset(classes), stop_grace_s)


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank counts as a straggler: its own work per step above ``factor`` times its peers'
    median for ``hold_s`` seconds in a row (spec: ``monitoring.straggler_factor``,
    ``monitoring.straggler_hold_s``), by more than the machine's noise: at least
    ``MIN_EXCESS_S``, and ``NOISE_K`` times the rank's own step-to-step spread (a rank that a busy
    CPU delays now and then has a wide spread; one that is slower every step, a narrow one). A
    figure is judged once it covers ``WARM_STEPS`` steps: a run's first steps (allocations, lazy
    initialisation) say nothing about a rank's pace."""

    factor: float
    hold_s: float
    MIN_EXCESS_S = 0.001  # below a millisecond a ratio says nothing a user can act on
    NOISE_K = 3.0
    WARM_STEPS = 20  # the rank's work clock's window (launcher.runtime.workclock.RECENT_STEPS)
