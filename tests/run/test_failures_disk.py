"""A write the run cannot make (README "Reliability": disk full, quota, file-size limit): one
`error:` line, exit 4, the completed checkpoints untouched, and `resume=true` goes on bit for bit.

Fault injection with the kernel's own refusal, no mocks: the run's process gets RLIMIT_FSIZE (with
SIGXFSZ ignored, a write past the limit fails with EFBIG, "File too large", errno 27), the same
failure path as ENOSPC through tensorstore/orbax and Python's file objects. The persistent XLA
cache is off in the limited runs (its entries are bigger than the limit).
Independent reference: the messages are written out by hand; the losses come from the run itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from support.cli_helpers import clean_env, run
from support.extras import require_mpiexec

ARGS = ["model=gpt2-tiny", "train.batch_size=2", "train.seq_len=32", "progress=none"]


# Sets the limit in a fresh interpreter that then execs the CLI: a preexec_fn would run Python in
# a child forked from this multithreaded (JAX) process, which can deadlock.
_LIMIT_THEN_EXEC = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                    "n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
                    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


def limited(args: list[str], max_file_bytes: int, tool: str = "jaxpar", **extra_env) -> subprocess.CompletedProcess:
    env = {k: v for k, v in clean_env().items() if not k.startswith("JAX_PERSISTENT_CACHE")
           and k != "JAX_COMPILATION_CACHE_DIR"} | extra_env
    return subprocess.run([sys.executable, "-c", _LIMIT_THEN_EXEC, str(max_file_bytes), "-m", f"{tool}.cli", *args],
                          capture_output=True, text=True, timeout=600, env=env)


def losses(out) -> dict[int, float]:
    rows = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows}


def small_text(root):
    text = root / "small.txt"
    text.write_text("".join("abcdefgh \n"[(i * 7919) % 10] for i in range(30000)))  # 27,000 train tokens
    return text


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A run of 2 steps with its checkpoint, on a small text (its token files stay far under the limits)."""
    root = tmp_path_factory.mktemp("disk")
    text = small_text(root)
    out = root / "run"
    r = run(["train", *ARGS, "train.steps=2", f"data={text}", f"out={out}"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(out / "ckpt")) == ["2"]
    return out


@pytest.fixture
def two_steps(two_step_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    return out


def test_a_checkpoint_that_cannot_be_written_is_one_error_line_and_resume_goes_on(two_steps):
    out = two_steps
    # gpt2-tiny's checkpoint files are 0.2-3 MB: every one of step 4's is refused.
    r = limited(["train", f"out={out}", "resume=true", "train.steps=4"], 100_000)
    assert r.returncode == 4, r.stderr[-3000:]
    assert r.stderr == (f"error: step 4: cannot write checkpoint {out}/ckpt/4: File too large (errno 27); "
                        "the last complete checkpoint is step 2: free space, then continue with resume=true\n")
    assert sorted(os.listdir(out / "ckpt")) == ["2"]  # the partial step 4 is removed, step 2 untouched
    failed = losses(out)
    assert sorted(failed) == [1, 2, 3, 4]

    r = run(["train", f"out={out}", "resume=true", "train.steps=4"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(out / "ckpt")) == ["2", "4"]
    assert losses(out) == failed  # steps 3-4 again from step 2's checkpoint: the same bits


def test_a_failed_steps_partial_dir_stays_removed_when_a_late_write_recreates_it(tmp_path, monkeypatch):
    """Orbax raises at the first refused write while the step's other tensorstore writes are still in
    flight; one of them re-creating its directory after the first removal left it on the full disk
    (the test above, on a loaded host). Stand-in: a save that refuses and re-creates the dir 0.3 s
    later; `Checkpointer.save` must return with no trace of step 3 once that has happened."""
    import errno
    import threading

    import jax.numpy as jnp

    from gpt2common.writes import WriteFailed
    from jaxpar.run.checkpoint import Checkpointer

    ck = Checkpointer(str(tmp_path))
    late = tmp_path / "ckpt" / "3.orbax-checkpoint-tmp" / "params.orbax-checkpoint-tmp" / "ocdbt.process_0" / "d"
    timer = threading.Timer(0.3, lambda: late.mkdir(parents=True, exist_ok=True))

    def refused(step, args=None, force=False):
        late.mkdir(parents=True)
        timer.start()
        raise ValueError("a tensorstore write failed") from OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(ck.mngr, "save", refused)
    with pytest.raises(WriteFailed) as e:
        ck.save(3, {"params": {"w": jnp.zeros(2)}}, {"step": 3})
    timer.join()
    ck.close()
    assert str(e.value) == f"cannot write checkpoint {tmp_path}/ckpt/3: File too large (errno 27)"
    assert os.listdir(tmp_path / "ckpt") == []


def test_a_metrics_line_that_cannot_be_written_is_one_error_line(two_steps):
    out = two_steps
    limit = os.path.getsize(out / "config.json") + 100  # config.json fits; metrics.jsonl reaches it by step 8
    r = limited(["train", f"out={out}", "resume=true", "train.steps=8"], limit)
    assert r.returncode == 4, r.stderr[-3000:]
    m = re.fullmatch(r"error: step (\d): cannot write (.+): File too large \(errno 27\); the last complete "
                     r"checkpoint is step 2: free space, then continue with resume=true\n", r.stderr)
    assert m and m[2] == f"{out}/metrics.jsonl", r.stderr
    assert os.path.getsize(out / "metrics.jsonl") == limit  # the failed step's line is torn at the limit
    kept = open(out / "metrics.jsonl").read().splitlines()[:-1]
    assert [json.loads(ln)["step"] for ln in kept] == list(range(1, int(m[1])))
    assert sorted(os.listdir(out / "ckpt")) == ["2"]


def test_a_config_that_cannot_be_rewritten_keeps_the_old_one(two_steps):
    """resume=true rewrites config.json (with the keys given) before training: a failed write
    leaves the run's old config in place, else the next resume could not read the run."""
    out = two_steps
    old = (out / "config.json").read_text()
    r = limited(["train", f"out={out}", "resume=true", "train.steps=8"], len(old) - 1)
    assert r.returncode == 4, r.stderr[-3000:]
    assert r.stderr == f"error: cannot write {out}/config.json: File too large (errno 27)\n"
    assert (out / "config.json").read_text() == old
    assert sorted(os.listdir(out)) == ["ckpt", "config.json", "data", "metrics.jsonl", "tb"]  # no .tmp left


@pytest.mark.parametrize("tool", ["jaxpar", "torchref"])
def test_data_that_cannot_be_prepared_is_one_error_line_and_no_half_file(tmp_path, tool):
    """The shared tokenizer step (gpt2common.data) writes train.bin (54,000 bytes) first."""
    out = tmp_path / "run"
    r = limited(["train"] + ["strategy=single"] * (tool == "torchref") + [*ARGS[:3], "train.steps=2",
                f"data={small_text(tmp_path)}", f"out={out}"], 1000, tool)
    assert r.returncode == 4, r.stderr[-3000:]
    assert r.stderr == f"error: cannot write {out}/data/train.bin: File too large (errno 27)\n"
    assert not out.exists()  # a start that fails before its first step leaves no directory behind


def test_torchref_initial_weights_that_cannot_be_written_are_one_error_line(tmp_path):
    """torchref writes the shared initial weights (safetensors, 1.85 MB) after the data (54 kB)."""
    out = tmp_path / "run"
    r = limited(["train", "strategy=single", *ARGS[:3], "train.steps=2", f"data={small_text(tmp_path)}",
                 f"out={out}"], 60_000, "torchref")
    assert r.returncode == 4, r.stderr[-3000:]
    assert r.stderr == f"error: cannot write {out}/init/model.safetensors: File too large (errno 27)\n"
    assert not out.exists()  # refused before any worker: the out it created goes (no .tmp left either)


# Metrics records with 30 extra numbers: TensorBoard's events (one record per number) outgrow
# metrics.jsonl, so when a metrics line is refused, TensorBoard's buffered events are refused too.
_TB_FULL = """
import os, resource, signal, sys
from gpt2common.writes import WriteFailed
from jaxpar.run.metrics import MetricsLogger
out = sys.argv[1]
log = MetricsLogger(out, 100, 0, progress="none")
rec = lambda n: {"step": n, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0, "mfu": 0.1,
                 **{f"k{i}": float(n * i) for i in range(30)}}
for n in range(1, 21):
    log.log(rec(n))
limit = os.path.getsize(os.path.join(out, "metrics.jsonl")) + 100
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    log.log(rec(21))
except WriteFailed as e:
    log.close()
    print(e)
"""


def test_tensorboard_on_a_full_disk_adds_nothing_to_the_one_line(tmp_path):
    """A real full disk: closing TensorBoard after the refused metrics line raised its own OSError
    (reported as "cannot write a file", no step, no path) and two more tracebacks at exit, from
    tensorboardX's atexit flush and its worker thread."""
    r = subprocess.run([sys.executable, "-c", _TB_FULL, str(tmp_path)], capture_output=True, text=True,
                       env=clean_env(), timeout=120)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == f"step 21: cannot write {tmp_path}/metrics.jsonl: File too large (errno 27)\n"
    assert len(open(tmp_path / "metrics.jsonl").read().splitlines()) == 21  # 20 lines and the torn one


def _private_tmpfs_works() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_real_full_disk_during_a_checkpoint_is_one_line(tmp_path):
    """A 7 MB tmpfs (a private mount namespace: nothing outlives the run) holds step 1's
    checkpoint, not step 2's (the last step: two_step_run's program, compiled once). RLIMIT_FSIZE
    fails every write of a step at once; a real full disk fails one while the step's other writes
    go on, and their callbacks printed 6 to 30 "RuntimeError: Event loop is closed" tracebacks
    before the one line."""
    if not _private_tmpfs_works():
        pytest.skip("needs `unshare -m` and mount (CAP_SYS_ADMIN) for a private tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    text = small_text(tmp_path)
    cmd = " ".join([f"mount -t tmpfs -o size=7m tmpfs {disk} &&", "exec", sys.executable, "-m", "jaxpar.cli", "train",
                    *ARGS, "train.steps=2", "train.ckpt_every=1", f"data={text}", f"out={disk}/run"])
    r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=600,
                       env=clean_env())
    assert (r.returncode, r.stderr) == (4, f"error: step 2: cannot write checkpoint {disk}/run/ckpt/2: No space left "
                                           "on device (errno 28); the last complete checkpoint is step 1: free "
                                           "space, then continue with resume=true\n")


def test_an_export_that_cannot_be_written_is_one_error_line(two_step_run, tmp_path):
    """`convert to_hf=`: safetensors' save_file raised its own error ("I/O error") past the CLI."""
    hf_dir = tmp_path / "hf"
    r = limited(["convert", f"checkpoint={two_step_run}", f"to_hf={hf_dir}"], 100_000)
    assert r.returncode == 4, r.stderr[-3000:]
    assert r.stderr == f"error: cannot write {hf_dir}/model.safetensors: File too large (errno 27)\n"
    assert os.listdir(hf_dir) == []  # no half-written weights, no .tmp


# one multi-process strategy by default (11 s each; they share the writer, torchref.worker)
@pytest.mark.parametrize("strategy,workers,world", [pytest.param("single", 1, 1, marks=pytest.mark.slow),
                                                    pytest.param("distributed-ps", 2, 2, marks=pytest.mark.slow),
                                                    ("horovod", 2, 2)])
def test_a_torchref_rank_that_cannot_append_its_metrics_is_one_error_line(tmp_path, strategy, workers, world):
    """The write fails in a worker process mid-run, not in the launcher: rank 0 appends metrics.jsonl
    each step. A 1-layer, 16-wide model keeps every file the launcher writes first (data 18 kB,
    weights 28 kB) under the limit, which metrics.jsonl (~180 bytes a step) reaches within 200 steps."""
    # mpiexec's ranks talk through UCX, whose shared-memory transport backs its segments with files far
    # over the limit (its own ftruncate fails first); its TCP transport keeps the limit on our files only.
    extra_env = {}
    if strategy == "horovod":
        require_mpiexec()
        extra_env = {"UCX_TLS": "self,tcp", "MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS": "1"}
    text = tmp_path / "t.txt"
    text.write_text("".join("abcdefgh \n"[(i * 7919) % 10] for i in range(10000)))
    out = tmp_path / "run"
    limit = 36_000
    r = limited(["train", f"strategy={strategy}", f"workers={workers}", "model=gpt2-tiny", "model.n_layer=1",
                 "model.n_embd=16", "model.n_head=2", "model.n_positions=32", "train.batch_size=2",
                 "train.seq_len=32", "train.steps=1000", "progress=none", f"data={text}", f"out={out}"],
                limit, "torchref", **extra_env)
    assert r.returncode == 4, r.stderr[-3000:]
    assert os.path.getsize(out / "metrics.jsonl") == limit  # the failed step's line is torn at the limit
    kept = open(out / "metrics.jsonl").read().splitlines()[:-1]
    assert [json.loads(ln)["step"] for ln in kept] == list(range(1, len(kept) + 1))
    others = "; stopped the other 1" if world > 1 else ""
    assert r.stderr == (f"error: strategy={strategy}: rank 0: step {len(kept) + 1}: cannot write {out}/metrics.jsonl: "
                        f"File too large (errno 27){others} (logs in {out}/logs)\n")
    assert not (out / "summary.json").exists()


def test_failure_line_names_the_file_of_a_storage_oserror_and_passes_the_rest_on():
    """Writes outside write_atomic (meta.json, the tokenizer, a full disk at any file) reach the CLIs
    as OSError; orbax's as a ValueError that carries tensorstore's `os_error_code`."""
    import errno

    from gpt2common.writes import WriteFailed, failure_line, write_errno

    full = OSError(errno.ENOSPC, "No space left on device", "/run/data/meta.json")
    assert failure_line(full) == "cannot write /run/data/meta.json: No space left on device (errno 28)"
    assert failure_line(OSError(errno.EDQUOT, "Disk quota exceeded")) == "cannot write a file: Disk quota exceeded (errno 122)"
    # any errno of a write is the storage's refusal: one line too, "use" for the rest
    assert failure_line(OSError(errno.EACCES, "Permission denied", "/run")) == "cannot use /run: Permission denied (errno 13)"
    assert failure_line(ValueError("no errno")) is None
    assert failure_line(WriteFailed("step 3: cannot write x: File too large (errno 27)")) == \
        "step 3: cannot write x: File too large (errno 27)"
    ts = ValueError('OUT_OF_RANGE: Error writing "wte/0.0": Failed writing: "/run/ckpt/4.orbax-checkpoint-tmp/d/1": '
                    "Failed to write 29088 bytes to file 31: No space left on device [os_error_code='28']")
    try:
        try:
            raise ts
        except ValueError as inner:
            raise RuntimeError("orbax wrapper") from inner
    except RuntimeError as outer:
        assert write_errno(outer) == errno.ENOSPC  # found through the cause chain
