"""Load a benchmark script (benchmarks/<name>.py, not a package) as a module for its tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported once per call. Registered in sys.modules (its dataclasses
    resolve annotations through it). A script sets XLA_FLAGS / JAX_PLATFORMS defaults for its own
    runs at import: this process's environment is put back as it was."""
    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return mod
