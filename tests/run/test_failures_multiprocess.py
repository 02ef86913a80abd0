"""SIGTERM to ONE rank of a `jaxpar launch nprocs=2` job: the signalled rank must not go to
checkpoint while its peer waits in the next all-reduce (the job would hang). The stop flag is an input of the step, reduced across processes inside it, so both ranks
stop after the same step, write one checkpoint together and exit 0.

Race-free: the job runs for 10^5 steps, so the signal always finds it training.
Independent reference: the checkpoint dirs and metrics lines on disk."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support.cli_helpers import (
    children,
    clean_env,
    kill_rank1_of_bare_pair,
    listening,
    rank_of,
    run_bare_pair,
    wait_for_steps,
)

TRAIN = ["train", "model=gpt2-tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.seq_len=16",
         "train.batch_size=2", "mesh.data=2", "train.steps=100000", "train.eval_every=0", "progress=plain"]


def _steps(out) -> list[int]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(ln)["step"] for ln in f]


def _sigterm_one_rank(tmp_path, rank: int):
    out = tmp_path / f"sig{rank}"
    p = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "launch", "nprocs=2", "--", *TRAIN, f"out={out}"],
                         env=clean_env(JAXPAR_HEARTBEAT_TIMEOUT="20"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(out, p, min_steps=2)
        kids = {rank_of(c): c for c in children(p.pid)}
        os.kill(kids[rank], signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:  # a hung job: its ranks first (train.steps=10^5), or they outlive the test
            for c in children(p.pid):
                os.kill(c, signal.SIGKILL)
            p.kill()
    return out, p.returncode, stdout, stderr


def _check_stopped_together(out, rc, stdout, stderr, who):
    assert rc == 0, stderr[-3000:]
    m = re.search(rf"stopped by {who} after step (\d+); checkpoint saved to ", stdout)
    assert m, stdout[-2000:]
    k = int(m.group(1))
    assert _steps(out) == list(range(1, k + 1))  # metrics end at the agreed step
    assert sorted(os.listdir(out / "ckpt")) == [str(k)]  # one checkpoint, written by both ranks together
    assert {"params", "opt_state", "meta"} <= set(os.listdir(out / "ckpt" / str(k)))
    assert "error" not in stderr


def test_sigterm_to_rank1_stops_both_ranks_at_the_same_step(tmp_path):
    # rank 0 (the one that prints) learns of rank 1's signal from the step's own all-reduce
    _check_stopped_together(*_sigterm_one_rank(tmp_path, 1), "a signal to another process")


@pytest.mark.slow
def test_sigterm_to_rank0_stops_both_ranks_at_the_same_step(tmp_path):
    _check_stopped_together(*_sigterm_one_rank(tmp_path, 0), "SIGTERM")


@pytest.mark.slow
def test_a_rank_that_loses_its_peer_exits_with_one_error_line(tmp_path):
    """Bare processes (as srun/mpiexec start them), rank 1 killed: rank 0's next collective
    fails, and it leaves with one line instead of a traceback and an abort in JAX's exit handler."""
    from jaxpar.run.launch import free_port

    out, port = tmp_path / "bare", free_port()
    rc, err, elapsed = kill_rank1_of_bare_pair(
        [*TRAIN, f"out={out}"], out, min_steps=2,
        env_of_rank=lambda r: clean_env(JAXPAR_COORDINATOR=f"127.0.0.1:{port}", JAXPAR_NUM_PROCESSES="2",
                                        JAXPAR_PROCESS_ID=str(r), JAXPAR_HEARTBEAT_TIMEOUT="10"))
    assert rc == 3, err[-3000:]  # jaxpar.run.launch.LOST_PEER_EXIT
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and re.fullmatch(r"error: process 0 lost contact with its peers \(.+\); resume=true "
                                            r"continues from the last complete checkpoint", lines[0]), err[-3000:]
    assert elapsed < 30  # the failed collective, well inside the 10 s heartbeat + slack of a loaded host


def test_data_only_process_0_reads_fails_as_one_line_from_it(tmp_path):
    """Bare ranks (srun / mpiexec, no launcher precheck), data= missing: process 0 prints the one
    line and exits 2; the other learns of it at once and exits 2 quietly (it waited on process 0
    until a 30 s gloo timeout and a traceback before)."""
    codes, errs = run_bare_pair([*TRAIN, f"data={tmp_path / 'none.txt'}", f"out={tmp_path / 'run'}"], timeout=120)
    assert codes == [2, 2], errs
    assert errs == [f"error: data='{tmp_path / 'none.txt'}' does not exist\n", ""]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("env,level", [({}, "2"), ({"JAXPAR_COORDINATOR": "127.0.0.1:1", "JAXPAR_NUM_PROCESSES": "2"}, "3"),
                                       ({"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1"}, "3"),
                                       ({"OMPI_COMM_WORLD_SIZE": "2", "TF_CPP_MIN_LOG_LEVEL": "0"}, "0")])
def test_a_rank_of_a_job_keeps_xlas_error_logs_off_its_stderr(monkeypatch, capsys, env, level):
    """A rank of a multi-process job sets TF_CPP_MIN_LOG_LEVEL=3 before JAX loads: the coordination
    service's page of ERROR lines about a dead peer no longer precedes the one `lost contact` line
    (test below). A single process keeps 2 (no INFO / WARNING); the user's own setting wins."""
    from jaxpar import cli

    for k in ("TF_CPP_MIN_LOG_LEVEL", "JAXPAR_COORDINATOR", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["mesh", "mesh.data=x"]) == 2  # refused before anything starts
    assert capsys.readouterr().err.startswith("error: mesh.data=")
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == level


@pytest.mark.slow
def test_a_peer_dead_before_the_first_step_leaves_no_coordination_logs(tmp_path):
    """Bare ranks, rank 1 SIGKILLed once its step is compiled (before the first step): rank 0's
    first-step barrier fails at the heartbeat timeout and it exits 3 with the `lost contact` line
    as its last, without the coordination service's ERROR lines (10 before). JAX's client may
    still print its own FATAL line first from its error-polling thread (about half the tries);
    no Python hook can stop it (jaxlib's missed-heartbeat callback takes no Python function)."""
    codes, (err, _) = run_bare_pair([*TRAIN, f"out={tmp_path / 'bare'}"], JAXPAR_HEARTBEAT_TIMEOUT="2",
                                    JAXPAR_FAULT_SIGNAL="SIGKILL@0@1")
    assert codes == [3, -signal.SIGKILL], err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert re.fullmatch(r"error: process 0 lost contact with its peers \(.*heartbeat.*\); resume=true continues "
                        r"from the last complete checkpoint", lines[-1]), err[-3000:]
    assert not [ln for ln in lines if re.match(r"[EW]\d{4} ", ln)], err[-3000:]


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("when", ["starting", pytest.param("training", marks=pytest.mark.slow)])
def test_ranks_die_with_a_killed_launcher(tmp_path, when):
    """kill -9 of `jaxpar launch` (no chance to stop anyone): its ranks, just started or
    training, are gone within 5 s (before: they trained on under init for as long as they ran);
    every checkpoint step they leave is complete."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "launch", "nprocs=2", "--", *TRAIN,
                          "train.ckpt_every=1", f"out={out}"], env=clean_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    ranks = []
    try:
        deadline = time.monotonic() + 60
        while len(ranks) < 2:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
            ranks = children(p.pid)
            time.sleep(0.05)
        if when == "training":
            wait_for_steps(out, p, min_steps=2)
        p.kill()
        p.wait()
        t0 = time.monotonic()
        while any(_alive(r) for r in ranks) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert not [r for r in ranks if _alive(r)]
    finally:
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
    if when == "training":
        steps = sorted(int(n) for n in os.listdir(out / "ckpt") if n.isdigit())
        assert steps and all({"params", "opt_state", "meta"} <= set(os.listdir(out / "ckpt" / str(k))) for k in steps)


def test_the_coordinator_listens_on_the_address_it_is_given(tmp_path):
    """`jaxpar launch` gives its ranks 127.0.0.1:PORT: rank 0's coordination service listens
    there and on no other interface (JAX's default binds [::], every interface)."""
    from jaxpar.run.launch import free_port

    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "launch", "nprocs=2", f"port={port}", "--", *TRAIN,
                          f"out={tmp_path / 'run'}"], env=clean_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline, found = time.monotonic() + 120, set()
        while not any(pt == port for _, pt in found):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
            time.sleep(0.1)
            kids = {rank_of(c): c for c in children(p.pid)}
            if 0 in kids:
                found = listening(kids[0])
        assert {a for a, pt in found if pt == port} == {"127.0.0.1"}
        assert {a for a, _ in found} == {"127.0.0.1"}, found
    finally:
        p.kill()  # its ranks die with it
        p.wait()


def test_a_peer_lost_during_a_checkpoint_is_one_line(tmp_path):
    """Rank 1 dies (SIGKILL) once step 2's metrics are written, before its share of step 2's
    checkpoint: rank 0's save fails in orbax's all-gather with a gloo ValueError, which was a
    40-line traceback and then JAX's abort; now the one "lost contact" line, exit 3, and the
    failed step never listed."""
    out = tmp_path / "run"
    codes, (err, _) = run_bare_pair([*TRAIN, "train.ckpt_every=2", f"out={out}"], JAXPAR_FAULT_SIGNAL="SIGKILL@2@1")
    assert codes == [3, -signal.SIGKILL], err[-3000:]
    assert re.fullmatch(r"error: process 0 lost contact with its peers \(.*Gloo.*\); resume=true continues from "
                        r"the last complete checkpoint\n", err), err[-3000:]
    assert [n for n in os.listdir(out / "ckpt") if n.isdigit()] == []


def test_the_compilation_cache_is_off_in_a_multi_process_cpu_job(tmp_path):
    """With JAX_COMPILATION_CACHE_DIR set, the second run of a 2-process CPU job hung for good on jax
    0.12.1 (both ranks in step 1's device_get, running the step process 0 had written to the cache on
    the first run). The cache is off in such a job: nothing is written to it, so nothing is read from
    it, and process 0 says so in one line."""
    cache, out = tmp_path / "xla-cache", tmp_path / "run"
    codes, (err0, err1) = run_bare_pair([*TRAIN, "train.steps=2", f"out={out}"], timeout=90,
                                        JAX_COMPILATION_CACHE_DIR=str(cache))
    assert codes == [0, 0], (err0[-2000:], err1[-2000:])
    assert err0 == (f"note: the compilation cache ({cache}) is off in a multi-process CPU job (jax 0.12.1 hangs "
                    "running a program read from it)\n") and err1 == "", (err0, err1)
    assert _steps(out) == [1, 2]
    assert not cache.exists() or list(cache.iterdir()) == []
