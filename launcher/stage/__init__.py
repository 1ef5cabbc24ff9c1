"""The stage seam: what the control side and the engines both read, importing neither.

    plan.py        StagePlan and its nodes and ranks (made by control.planning, run by engines)
    events.py      what ranks tell the run loop while they run (typed events, one queue)
    logrouting.py  a stage's output on the launching machine: log files, console, rank events
    watch.py       what a run tells whoever watches it (RunEvents: console, metrics, the wire)
    engine.py      the two interfaces: StageEngine (one stage -> a handle) and Submitter (a whole run)
    wire.py        the remote-run wire: a submitted run's events, one format, one parser, one follow loop
"""
