"""Optional extras the tests need, checked one way everywhere.

A machine installed with the README's command (`pip install -e ".[torch,mpi,tensorboard,dev]"`)
skips nothing. Without an extra, a test skips and the reason names the extra to install. One
half-installed case fails instead of skipping: mpi4py present (the [mpi] extra was asked for) but
no `mpiexec` on PATH, which would otherwise silently drop every horovod / mpiexec test.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest

MPIEXEC_MISSING = ("mpi4py is installed but `mpiexec` is not on PATH, so the horovod / mpiexec tests cannot run: "
                   "pip install mpich (the [mpi] extra: pip install -e '.[mpi]') or put an MPI's mpiexec on PATH")


def require_mpiexec() -> None:
    """Skip (naming the [mpi] extra) without mpi4py; fail with a clear message if mpiexec is missing."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs the [mpi] extra (mpi4py + mpich): pip install -e '.[mpi]'")
    if shutil.which("mpiexec") is None:
        pytest.fail(MPIEXEC_MISSING, pytrace=False)

