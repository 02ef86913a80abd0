"""What the GPU lane (tests/gpu/, `python -m pytest -m gpu`) shares: whether a GPU is here, the
skip every file takes without one, and the environments of the subprocesses it starts.

The lane runs unpinned (conftest.py lifts the CPU pin for a marker expression naming gpu), so jax
starts on the GPU where there is one. Its subprocesses get `gpu_env()` (jax's own platform choice,
no memory preallocation: pytest's workers, the CLI runs and torch share one GPU) or `cpu_env()`
(the CPU pin, for the CPU side of a GPU-vs-CPU check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.cli_helpers import clean_env


def no_gpu_reason() -> str | None:
    """None where jax's default backend is a GPU; else why the lane cannot run here."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        return "JAX_PLATFORMS=cpu pins this run to the CPU (the GPU lane is `python -m pytest -m gpu`)"
    import jax

    backend = jax.default_backend()
    if backend != "gpu":
        kinds = ", ".join(sorted({d.device_kind for d in jax.devices()}))
        return f"no GPU here: jax's default backend is {backend} ({kinds})"
    return None


def require_gpu() -> None:
    """Skip the calling test file's tests where there is no GPU: call it from a module-scoped autouse
    fixture, so the skip is reported once per file at that fixture's line."""
    __tracebackhide__ = True
    reason = no_gpu_reason()
    if reason is not None:
        pytest.skip(reason)


def require_torch_cuda() -> None:
    __tracebackhide__ = True
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} has no CUDA here")


def gpu_env(**extra) -> dict:
    """A subprocess environment that lets jax take the GPU (the CLI's own choice on a GPU machine)."""
    env = {k: v for k, v in clean_env().items() if k != "JAX_PLATFORMS"}
    env.update({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, **extra)
    return env


def cpu_env(**extra) -> dict:
    return clean_env(**extra)


# gpt2-tiny through the CLI, small enough for a few seconds a run
TINY = ["model=gpt2-tiny", "train.batch_size=8", "train.seq_len=64", "train.eval_every=0", "progress=none",
        "train.log_every=1"]


def jaxpar(args: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m jaxpar.cli ARGS` in `env`; asserts exit 0 (showing stderr's tail otherwise)."""
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
