"""`jaxpar --version` and `torchref --version`: the project's version and its stack's, read from
the installed distributions' metadata. Nothing is imported, so the line comes fast and also
where jax or torch fails to start (the case a bug report needs it for)."""

from __future__ import annotations

import platform
from importlib import metadata

DIST = "jaxpar"  # the distribution that installs jaxpar, torchref and gpt2common (pyproject.toml)
STACKS = {"jaxpar": ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"),
          "torchref": ("torch", "mpi4py", "numpy")}


def installed(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_line(tool: str) -> str:
    """e.g. `jaxpar 0.1.0 (python 3.11.7, jax 0.10.2, jaxlib 0.10.2, flax ..., optax ..., orbax-checkpoint ...)`."""
    stack = ", ".join(f"{d} {installed(d)}" for d in STACKS[tool])
    return f"{tool} {installed(DIST)} (python {platform.python_version()}, {stack})"
