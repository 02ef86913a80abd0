"""Suite-wide setup for tests/ and parity_tests/: the CPU pin and the hypothesis profiles.

CPU pin: the default suite runs on the CPU backend wherever it runs, a GPU machine included.
Its tests compare against CPU-derived numbers, read CPU HLO, and emulate CPU devices
(`--xla_force_host_platform_device_count`, which GPU backends ignore), so `JAX_PLATFORMS=cpu` is
set here, before any test module imports jax (jax reads it when it first loads), and every
subprocess that inherits this environment is pinned too. The GPU lane (`python -m pytest -m gpu`,
tests/gpu/) is the one run that leaves jax's own platform choice (the GPU where there is one):
`pytest_configure` undoes the pin when the marker expression selects `gpu`.

Compilation cache: the test processes of one pytest run (every xdist worker) and the CLI
subprocesses they start share one persistent XLA cache (a temporary dir made here, before the
workers start, and removed at exit; tests/support/cli_helpers.py hands it to the subprocesses), so
a configuration that tests in several files run is compiled once per run rather than once per
worker or per test. A hit is the executable a fresh compile would give (the key covers the HLO,
the compile options and the backend), and it keeps its memory and cost analyses.

`ci` (default): every property test draws the same examples on every run (`derandomize`), so a
landing is never decided by a lucky draw and a failure reproduces from the commit alone.
`explore` (`HYPOTHESIS_PROFILE=explore python -m pytest ...`): fresh random draws each run, with
hypothesis' example database, to hunt for new counterexamples; pin what it finds with `@example`.
"""

import os
import re

from hypothesis import settings

_USER_PLATFORMS = os.environ.get("JAX_PLATFORMS")
os.environ["JAX_PLATFORMS"] = "cpu"


def selects_gpu_lane(markexpr: str) -> bool:
    """Whether `-m markexpr` can select tests marked gpu: it names `gpu` other than as `not gpu`
    ("gpu", "gpu and not slow": yes; the default "not slow and not gpu", "": no)."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None


XLA_CACHE_ENV = "JAXPAR_TEST_XLA_CACHE"


def pytest_configure(config):
    if not os.environ.get(XLA_CACHE_ENV):  # the controller (or a -n 0 run); workers inherit it
        import atexit
        import shutil
        import tempfile

        os.environ[XLA_CACHE_ENV] = tempfile.mkdtemp(prefix="jaxpar-test-xla-cache-")
        atexit.register(shutil.rmtree, os.environ[XLA_CACHE_ENV], ignore_errors=True)
    import jax  # configuring the cache starts no backend: the GPU lane below may still change platforms

    jax.config.update("jax_compilation_cache_dir", os.environ[XLA_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if not selects_gpu_lane(config.getoption("markexpr", "")):
        return
    # pytest's workers and the lane's subprocesses share one GPU: no process takes 75% of it up front
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if _USER_PLATFORMS is None:
        del os.environ["JAX_PLATFORMS"]
    else:
        os.environ["JAX_PLATFORMS"] = _USER_PLATFORMS
    jax.config.update("jax_platforms", _USER_PLATFORMS)  # no backend has started yet


settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
