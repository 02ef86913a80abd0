"""Run the CLIs in subprocesses with a clean XLA_FLAGS (each run decides its own device count).

Every subprocess of one pytest run, on every xdist worker, shares a persistent XLA compilation
cache (a temporary dir the root conftest.py makes, removed at exit): tests that run the same
configuration several times (a reference run, an interrupted run and its resume) compile its
step once. A cache hit is the very executable a fresh compile would produce (the key covers the
HLO, the compile options and the backend), so results are unchanged; only the ~15 s compile of
gpt2-tiny's step on a loaded 2-core host goes.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time

# one for every worker of the run (the root conftest.py makes it); a dir of its own otherwise
_XLA_CACHE = os.environ.get("JAXPAR_TEST_XLA_CACHE") or tempfile.mkdtemp(prefix="jaxpar-test-xla-cache-")
if _XLA_CACHE != os.environ.get("JAXPAR_TEST_XLA_CACHE"):
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)


def clean_env(**extra) -> dict:
    # TF_CPP_MIN_LOG_LEVEL: the CLI's own choice (2, or 3 in a rank of a job), not one an in-process
    # CLI test left in this worker's environment
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL")}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": _XLA_CACHE,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"},
               **extra)
    return env


def run_worker(script: str, tmp_path, kind: str, *names: str) -> dict:
    """Run `script kind OUT.json names...` (a test file's worker mode) on 8 emulated CPU devices and
    return the JSON it wrote: tests that need a device count of their own run in a subprocess."""
    import json

    path = tmp_path / f"{kind}.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # LLVM optimisation level 0 cuts the workers' compile time (they compile many small steps and run
    # each a few times); it changes neither the SPMD partitioning nor the buffer assignment (compiled
    # temp bytes) under test, and every worker computes its reference under the same flags.
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, script, kind, str(path), *names], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(path.read_text())


def run_probe(code: str, arg, devices: int, timeout: float = 600):
    """Run `python -c code json(arg)` on `devices` emulated CPU devices (the count must be set before JAX
    starts, hence a subprocess; no compilation cache: probes read compiled executables' analyses) and
    return the JSON of the last line it prints."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: list[str], tool: str = "jaxpar", timeout: float = 600, **env) -> subprocess.CompletedProcess:
    mod = {"jaxpar": "jaxpar.cli", "torchref": "torchref.cli"}[tool]
    return subprocess.run([sys.executable, "-m", mod, *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**env))


def wait_for_steps(out, proc: subprocess.Popen, min_steps: int = 1, timeout: float = 300) -> None:
    """Block until `<out>/metrics.jsonl` holds `min_steps` complete lines, failing with the run's stderr
    if the process exits first or `timeout` seconds pass (a line counts once its newline is written)."""
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(path):
            with open(path) as f:
                if f.read().count("\n") >= min_steps:
                    return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"fewer than {min_steps} steps in {timeout} s"
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc), e.g. the ranks under `jaxpar launch`."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def rank_of(pid: int) -> int | None:
    """JAXPAR_PROCESS_ID of a running process, None if it has none (or is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"JAXPAR_PROCESS_ID"])
    except (OSError, KeyError, ValueError):
        return None


def run_bare_pair(argv: list[str], timeout: float = 120, **env) -> tuple[list[int], list[str]]:
    """Run `jaxpar <argv>` as two bare processes of one job on a free localhost port (as
    srun/mpiexec would start them, no launcher), `env` added to both; wait for both.
    Returns their (exit codes, stderrs), rank 0 first. No compilation cache unless `env` names one
    (a multi-process CPU job turns it off with a note: mesh._no_persistent_cache_across_cpu_processes).
    A pair still running after `timeout` seconds is killed and fails the test with both stderrs."""
    from jaxpar.run.launch import free_port

    base = clean_env(JAXPAR_COORDINATOR=f"127.0.0.1:{free_port()}", JAXPAR_NUM_PROCESSES="2",
                     **{"JAX_COMPILATION_CACHE_DIR": "", **env})
    procs = [subprocess.Popen([sys.executable, "-m", "jaxpar.cli", *argv], env={**base, "JAXPAR_PROCESS_ID": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
    deadline, errs = time.monotonic() + timeout, []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[1])
    except subprocess.TimeoutExpired:
        for q in procs:
            q.kill()
        errs += [q.communicate()[1] for q in procs[len(errs):]]
        tails = [f"rank {r} (exit {q.wait()}): {e[-1500:]!r}" for r, (q, e) in enumerate(zip(procs, errs))]
        raise AssertionError(f"the pair was still running after {timeout:g} s; " + "; ".join(tails)) from None
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    return [p.returncode for p in procs], errs


def kill_rank1_of_bare_pair(argv: list[str], out, env_of_rank, min_steps: int = 1,
                            timeout: float = 300) -> tuple[int, str, float]:
    """Start `jaxpar <argv>` as two bare processes (as srun/mpiexec would: `env_of_rank(r)` gives each
    its JAXPAR_* environment), SIGKILL rank 1 once `min_steps` steps are logged, and wait for rank 0.
    Returns rank 0's (exit code, stderr, seconds from the kill to its exit)."""
    procs = [subprocess.Popen([sys.executable, "-m", "jaxpar.cli", *argv], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env_of_rank(r)) for r in range(2)]
    try:
        wait_for_steps(out, procs[0], min_steps=min_steps, timeout=timeout)
        procs[1].kill()
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        return procs[0].returncode, err, time.monotonic() - t0
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on (Linux /proc: its fds' socket inodes
    looked up in /proc/net/tcp and tcp6, state 0A = LISTEN); '0.0.0.0' / '::' is every interface."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                addr = ipaddress.ip_address(raw)
                if addr.version == 6 and addr.ipv4_mapped:
                    addr = addr.ipv4_mapped
                found.add((str(addr), int(hexport, 16)))
    return found
