"""Slurm: the same spec as one batch job (sbatch + one srun step per node + torchrun).

    commands.py  Slurm's client commands, run with timeouts and parsed
    script.py    the allocation the spec asks for, the sbatch script, each node's srun line (pure)
    submit.py    the submitter, outside the job: preflight, submit, follow the job over the wire, cancel
    jobs.py      a job by its id: status, logs, stop (``launch status|logs|stop JOB_ID``)
    outcome.py   the run's record once the job ended, and why in Slurm's words (the results layer makes the result)
    backend.py   the srun engine, inside the job: the allocation's nodes, an srun step per node, a lost node named
    inside.py    the launcher inside the job: ``python -m launcher.control.submitted slurm RUN_DIR``, a requeued job resumed
"""
