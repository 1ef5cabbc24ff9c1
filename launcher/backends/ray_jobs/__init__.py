"""Ray Jobs: a run submitted to an existing Ray cluster through its Jobs API, and followed live.

    client.py  the Jobs API as the submitter uses it: token auth, one-line errors, status, stop, the log streamed
    bundle.py  the run directory sent back through the job's log (its record always; large artifacts stay)
    submit.py  the submitter: submit, follow over the remote-run wire, stop, status, logs, the result
"""

from launcher.backends.ray_jobs.submit import RayJobsSubmitter

__all__ = ["RayJobsSubmitter"]
