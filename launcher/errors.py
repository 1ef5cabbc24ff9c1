"""Exceptions that carry their exit code, so the CLI maps them without guessing."""

from __future__ import annotations

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class LauncherError(Exception):
    """Base class: a user-facing error with a one-line message and an exit code."""

    exit_code: int = EXIT_JOB_FAILED

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class SpecError(LauncherError):
    """The job spec, a config file or a flag is invalid. Holds every problem found."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class PlanError(LauncherError):
    """The spec is valid but cannot be placed on the available resources."""

    exit_code = EXIT_BAD_INPUT


class BackendError(LauncherError):
    """A backend could not start or talk to its processes."""

    exit_code = EXIT_JOB_FAILED
