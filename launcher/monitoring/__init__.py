"""Watching a live run: the listener the run loop feeds with every rank's beacons (``live``:
the live figures, stragglers and step rates) and the Prometheus endpoint with its file-based
discovery (``endpoint``). Fed by the control side; it imports nothing of the control side, the
engines, the rank runtime or the UI."""
