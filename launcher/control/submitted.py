"""The entrypoint of a run submitted to a cluster: ``python -m launcher.control.submitted NAME
ARGS...``, run by the scheduler's job, where NAME is a submitter of the registry
(``launcher.backends``) and ARGS what its inside half takes (``Submitter.run_inside``).

On the cluster the submitter's inside half runs the same ``run_job`` (passed in from here: a
submitter imports nothing of the control side) with the engine connected to that cluster, and every
event of the run goes over the remote-run wire (``launcher.stage.wire``) to the launch that
submitted it. No engine is named here: the registry says which submitters there are.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Sequence

from launcher.errors import EXIT_BAD_INPUT

# what the launcher needs on the cluster, checked before anything else is imported there
NEEDED = ("yaml", "pydantic", "rich", "matplotlib", "psutil", "prometheus_client", "torch")


def missing_dependencies(extra: Sequence[str] = ()) -> list[str]:
    return [name for name in (*NEEDED, *extra) if importlib.util.find_spec(name) is None]


def lacking(extra: Sequence[str], install: str = "gpulaunch") -> int | None:
    """One line, and exit 2, when this interpreter cannot run the launcher."""
    missing = missing_dependencies(extra)
    if not missing:
        return None
    print(
        f"error: the cluster's Python ({sys.executable}) lacks {', '.join(missing)}: install gpulaunch's "
        f"dependencies there (pip install '{install}' with the nodes' torch build), then submit again",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_BAD_INPUT


def main(argv: Sequence[str]) -> int:
    missing = lacking(())
    if missing is not None:
        return missing
    from launcher import backends

    names = backends.submitter_names()
    if argv and argv[0] in names:
        cls = backends.submitter_class(argv[0])
        missing = lacking(cls.needs, f"gpulaunch[{','.join(cls.needs)}]" if cls.needs else "gpulaunch")
        if missing is not None:
            return missing
        from launcher.control.api import run_job

        code = cls.run_inside(argv[1:], run_job)
        if code is not None:
            return code
    forms = " | ".join(f"{name} {backends.submitter_class(name).usage}".rstrip() for name in names)
    print(f"usage: python -m launcher.control.submitted {forms}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
