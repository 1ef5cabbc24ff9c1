"""The Slurm backend: the same spec as one batch job (sbatch + one srun step per node + torchrun).

    commands.py  Slurm's client commands, run with timeouts and parsed
    script.py    the allocation the spec asks for, the sbatch script, each node's srun line (pure)
    submit.py    outside: preflight, submit, follow the job, cancel it
    outcome.py   the run's result once the job ended (written here if the launcher inside could not)
    backend.py   inside the job: the allocation's nodes, an srun step per node, a lost node named
    events.py    the launcher inside -> the job's output file -> the console outside
    jobs.py      launch status|logs|stop JOB_ID for a Slurm job id

The launcher inside the job is ``python -m launcher.control.submitted slurm RUN_DIR``.
"""

from __future__ import annotations

from launcher.backends.slurm.backend import SlurmBackend
from launcher.backends.slurm.jobs import TERMINAL, job_info, job_logs, stop_job

__all__ = ["TERMINAL", "SlurmBackend", "job_info", "job_logs", "stop_job"]
