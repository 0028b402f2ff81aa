"""Experiment trackers shared by the Accelerate facade and ``ndparallel train`` (``trackers.py``),
and the trainer's fan-out to them (``run.py``)."""
