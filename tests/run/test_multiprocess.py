"""Multi-process on one machine (CPU, gloo collectives).

* `jaxpar launch nprocs=2` with 2 emulated devices per process gives the same losses as one
  process with 4 devices; only process 0 writes metrics; the checkpoint is written once,
  collectively.
* A rank that dies makes the job exit with an error within a bounded time (launcher and,
  slow, bare processes relying on the coordination-service heartbeat).
* (slow) `mpiexec -n 2 jaxpar train ...` (mpich wheel) matches too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support.cli_helpers import children, kill_rank1_of_bare_pair, rank_of, wait_for_steps
from support.extras import require_mpiexec

from jaxpar.tolerances import MULTIPROCESS_VS_SINGLE

TRAIN = ["train", "model=gpt2-tiny", "mesh.data=2", "mesh.fsdp=2", "train.batch_size=8", "train.seq_len=32",
         "precision=fp32", "train.eval_every=0", "progress=plain"]


def _env(**extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXPAR_HEARTBEAT_TIMEOUT="10", **extra)
    env.pop("XLA_FLAGS", None)
    return env


def _losses(run_dir, key: str = "loss") -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(ln)[key] for ln in f if ln.strip()]


@pytest.fixture(scope="module")
def single_4dev_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "run"
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", *TRAIN, "train.steps=3", f"out={out}"],
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def single_4dev(single_4dev_run):
    return _losses(single_4dev_run)


@pytest.fixture(scope="module")
def single_4dev_grad_norms(single_4dev_run):
    return _losses(single_4dev_run, "grad_norm")


def test_launch_2proc_x_2dev_equals_1proc_x_4dev(tmp_path, single_4dev, single_4dev_grad_norms):
    out = tmp_path / "mp"
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", "launch", "nprocs=2", "--", *TRAIN, "train.steps=3",
                        f"out={out}"], env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(out)
    assert len(losses) == 3  # one line per step: only process 0 writes metrics
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, single_4dev)]
    assert max(rel) <= MULTIPROCESS_VS_SINGLE["loss"], (losses, single_4dev)
    # gradients, not only losses: each step's pre-clip global grad norm (a wrong cross-process
    # average moves it by >= 50% while AdamW keeps the loss close)
    gn = _losses(out, "grad_norm")
    gn_rel = [abs(a - b) / b for a, b in zip(gn, single_4dev_grad_norms)]
    assert max(gn_rel) <= MULTIPROCESS_VS_SINGLE["grad_norm"], (gn, single_4dev_grad_norms)
    # logs: the header and step lines come once (process 0), not once per process
    assert r.stdout.count("jaxpar train: gpt2-tiny") == 1
    assert r.stdout.count("step      3/3") == 1
    assert "4 devices / 2 processes" in r.stdout
    # collective checkpoint: one complete step-3 checkpoint holding params and opt_state
    ck = out / "ckpt" / "3"
    assert {"params", "opt_state", "meta"} <= set(os.listdir(ck))
    assert sorted(os.listdir(out / "ckpt")) == ["3"]


@pytest.mark.slow
def test_dead_rank_stops_the_job_via_launcher(tmp_path):
    out = tmp_path / "dead"
    p = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "launch", "nprocs=2", "grace=5", "--", *TRAIN,
                          "train.steps=100000", f"out={out}"], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(out, p, timeout=240)
        kids = {rank_of(c): c for c in children(p.pid)}
        os.kill(kids[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 137
    # The launcher names the root cause either way. Rank 0 leaves by itself (exit 3) if a Gloo
    # collective fails within the settle window (SETTLE_S = 3 s); otherwise the launcher stops it.
    # On the 2-core AMD host rank 0 mostly gets no Gloo error (bare pairs: 5 of 6 were aborted by
    # the coordination heartbeat after 7-9.5 s, 1 left in 0.1 s), so this ending is the usual one
    # there (3 of 3 runs, load 1.5-15); the lost-peer line stays pinned by test_failures_multiprocess.
    lost = "error: process 0 lost contact with its peers" in err
    assert (lost and "error: process 1 exited with code 137\n" in err) or \
        (not lost and "error: process 1 exited with code 137; stopping processes 0\n" in err), err[-3000:]
    assert elapsed < 15  # the settle window (3 s), SIGTERM, then SIGKILL after grace=5 s
    assert all(not os.path.exists(f"/proc/{c}") or open(f"/proc/{c}/stat").read().split()[2] == "Z"
               for c in kids.values())


@pytest.mark.slow
def test_dead_rank_without_launcher_survivor_errors_out(tmp_path):
    """Bare processes (as srun/mpiexec would start them): the heartbeat (10 s here) ends the survivor."""
    out = tmp_path / "bare"
    port = __import__("jaxpar.run.launch", fromlist=["x"]).free_port()
    rc, _, elapsed = kill_rank1_of_bare_pair(
        [*TRAIN, "train.steps=100000", f"out={out}"], out, timeout=240,
        env_of_rank=lambda r: _env(JAXPAR_COORDINATOR=f"127.0.0.1:{port}", JAXPAR_NUM_PROCESSES="2",
                                   JAXPAR_PROCESS_ID=str(r)))
    assert rc != 0
    assert elapsed < 90, elapsed


@pytest.mark.slow
def test_mpiexec_2proc_equals_single(tmp_path, single_4dev):
    require_mpiexec()
    out = tmp_path / "mpi"
    r = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "jaxpar.cli", *TRAIN, "train.steps=3",
                        f"out={out}"], env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(out)
    assert len(losses) == 3
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, single_4dev)) <= MULTIPROCESS_VS_SINGLE["loss"]
