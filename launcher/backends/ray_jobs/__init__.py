"""Ray Jobs: a run submitted to an existing Ray cluster through its Jobs API, and followed live.

    client.py    the Jobs API as the submitter uses it: token auth, one-line errors, status, stop, the log streamed,
                 Ray's own client lines into the run directory's ray-submit.log
    workdir.py   what the job's working directory ships: regular files, .gitignore / ray.excludes, a size cap
    wirefile.py  the remote-run wire on its own file beside the job's log (which stays for people), streamed back
    bundle.py    the run directory sent back at the end of the wire (its record always; large artifacts stay)
    submit.py    the submitter: submit, follow over the remote-run wire, stop, status, logs, the result
    inside.py    the launcher inside the Ray job (``python -m launcher.control.submitted ray SPEC RUN_ID``)
"""

from launcher.backends.ray_jobs.submit import RayJobsSubmitter

__all__ = ["RayJobsSubmitter"]
