"""The checks any run makes on `out=` before its first byte, and that first write; shared by
`jaxpar train` (jaxpar/run/rundir.py adds its own resume rules) and `torchref train`."""

from __future__ import annotations

import os

from gpt2common.grammar import ConfigError


def check_writable(out: str, key: str = "out") -> None:
    """ConfigError unless `out` is (or can be created as) a writable directory. Writes nothing."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={out!r} exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}={out!r} cannot be created: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={out!r} cannot be created or written: {parent!r} is not writable")


def make_out(out: str) -> None:
    """The run's first write; a filesystem refusal (read-only, /proc, ...) is a one-line error."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out={out!r} cannot be created ({e.strerror})") from None
