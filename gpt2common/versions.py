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
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
    if dist == "torch":
        version = _torch_build(version)
    return version


def _torch_build(version: str) -> str:
    """torch's own `__version__`, which names the build (`2.13.0+cu130`, `2.13.0+cpu`): PyPI's CUDA wheel
    records plain `2.13.0` in its metadata, and the build is what a bug report needs. Read as text from
    `torch/version.py` (a generated one-line assignment), so torch is not imported."""
    try:
        text = metadata.distribution("torch").locate_file("torch/version.py").read_text()
    except OSError:
        return version
    for line in text.splitlines():
        if line.startswith("__version__ = "):
            return line.split("=", 1)[1].strip().strip("'\"") or version
    return version


def version_line(tool: str) -> str:
    """e.g. `jaxpar 0.1.0 (python 3.11.7, jax 0.10.2, jaxlib 0.10.2, flax ..., optax ..., orbax-checkpoint ...)`."""
    stack = ", ".join(f"{d} {installed(d)}" for d in STACKS[tool])
    return f"{tool} {installed(DIST)} (python {platform.python_version()}, {stack})"
