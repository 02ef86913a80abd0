"""Run the CLIs in subprocesses with a clean XLA_FLAGS (each run decides its own device count)."""

from __future__ import annotations

import os
import subprocess
import sys


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def run(args: list[str], tool: str = "jaxpar", timeout: float = 600, **env) -> subprocess.CompletedProcess:
    mod = {"jaxpar": "jaxpar.cli", "torchref": "torchref.cli"}[tool]
    return subprocess.run([sys.executable, "-m", mod, *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**env))
