"""Mutation testing: hand-written small real bugs, run against the default suite (see run.py)."""
