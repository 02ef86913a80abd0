"""torchref's out dir: a finished run or a foreign dir is refused, never
overwritten; an unfinished run's leftovers may be run over. In-process, no training.
Independent reference: the files on disk and hand-written messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxpar.config import ConfigError
from torchref.launch import check_out


def test_finished_run_is_refused_and_left_alone(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        check_out(tmp_path)
    assert str(e.value) == f"out={str(tmp_path)!r} holds a finished torchref run (summary.json); choose another out"
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_foreign_dir_is_refused_unfinished_run_is_accepted(tmp_path):
    for name in ("metrics.jsonl", "job.json", "config.json"):
        (tmp_path / name).write_text("{}")
    for name in ("procs", "logs", "data"):
        (tmp_path / name).mkdir()
    (tmp_path / "grads_step1.safetensors").write_bytes(b"")
    check_out(tmp_path)  # a crashed run: no summary.json
    (tmp_path / "ckpt").mkdir()  # e.g. a jaxpar run dir
    with pytest.raises(ConfigError) as e:
        check_out(tmp_path)
    assert str(e.value) == (f"out={str(tmp_path)!r} is not empty and not a torchref run dir (holds ckpt); "
                            "choose another out")
    check_out(Path(tmp_path / "new" / "run"))  # missing dirs are fine


def test_a_run_over_an_unfinished_runs_leftovers_starts_clean(tmp_path):
    """`prepare` (everything before the ranks start) removes what a crashed attempt left: the
    metrics are appended to by the new run's writer, so a stale line would become its step 1."""
    from torchref.config import resolve_ref
    from torchref.launch import prepare

    out = tmp_path / "run"
    (out / "procs").mkdir(parents=True)
    (out / "procs" / "rank0.json").write_text("{}")
    (out / "logs").mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n')
    (out / "grads_step1.safetensors").write_bytes(b"")
    (tmp_path / "text.txt").write_text("some text to train on. " * 100)
    cfg, ref = resolve_ref(["model=gpt2-tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                            "train.seq_len=16", f"data={tmp_path / 'text.txt'}", f"out={out}", "strategy=single"])
    prepare(cfg, ref)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "data", "init", "job.json"]


# --- how a dead rank is reported: the zygote's exit status, its root cause, the launcher's line.
# In-process: real child processes for the wait statuses, a stand-in zygote reply for the launcher.


def test_wait_status_of_a_signal_is_negative_and_of_an_exit_its_code():
    """torchref.zygote._code: -N for a process killed by signal N (the OOM killer's SIGKILL), the
    exit code otherwise. Reference: the signal sent and the code `sh` exits with."""
    import os
    import signal
    import subprocess

    from torchref.zygote import _code

    p = subprocess.Popen(["sleep", "30"])
    os.kill(p.pid, signal.SIGKILL)
    _, killed = os.waitpid(p.pid, 0)
    q = subprocess.Popen(["sh", "-c", "exit 17"])
    _, exited = os.waitpid(q.pid, 0)
    assert (_code(killed), _code(exited)) == (-9, 17)


def test_the_root_cause_is_a_rank_that_did_not_exit_1():
    """Ranks that lose a peer in a collective exit 1 (an exception): among deaths seen together the
    report names one that exited otherwise (a signal, its own code), else the lowest rank."""
    from torchref.zygote import _root_cause

    assert _root_cause({0: 1, 1: 17}, window_s=0) == {"status": "died", "rank": 1, "code": 17}
    assert _root_cause({0: 1, 2: -9, 1: 1}, window_s=0) == {"status": "died", "rank": 2, "code": -9}
    assert _root_cause({2: 1, 1: 1}, window_s=0) == {"status": "died", "rank": 1, "code": 1}


class _Zygote:
    """Stands in for the warm fork server: takes the request, answers `reply`."""

    def __init__(self, reply: str):
        import io

        self.stdin, self.replies = io.StringIO(), io.StringIO(reply + "\n")


def _run_forked_with(monkeypatch, tmp_path, reply: str):
    import json
    from types import SimpleNamespace

    from torchref import launch

    z = _Zygote(json.dumps(reply))
    monkeypatch.setattr(launch, "_zygote", lambda: (z, z.replies))
    job = SimpleNamespace(out=str(tmp_path), ref=SimpleNamespace(strategy="distributed-ps"))
    launch.run_forked(job, 2)


def test_a_rank_killed_by_a_signal_is_named_with_that_signal(monkeypatch, tmp_path):
    from torchref.config import WorkerDied

    with pytest.raises(WorkerDied) as e:
        _run_forked_with(monkeypatch, tmp_path, {"status": "died", "rank": 1, "code": -9})
    assert str(e.value) == (f"strategy=distributed-ps: process rank 1 of 2 died (signal 9); stopped the other 1 "
                            f"(logs in {tmp_path}/logs)")


def test_a_storage_failure_on_the_last_rank_is_reported_as_one(monkeypatch, tmp_path):
    """The launcher looks for the storage line in every rank's log, the last one included."""
    from gpt2common.writes import WriteFailed

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.log").write_text("Traceback ...\nRuntimeError: peer gone\n")
    (tmp_path / "logs" / "rank1.log").write_text("Traceback ...\nstorage failure: step 3: cannot write /x: "
                                                 "No space left on device (errno 28)\n")
    with pytest.raises(WriteFailed) as e:
        _run_forked_with(monkeypatch, tmp_path, {"status": "died", "rank": 0, "code": 1})
    assert str(e.value) == ("strategy=distributed-ps: rank 1: step 3: cannot write /x: No space left on device "
                            f"(errno 28); stopped the other 1 (logs in {tmp_path}/logs)")


def test_a_rank_killed_by_a_signal_is_a_death_and_the_others_are_stopped(monkeypatch, tmp_path):
    """torchref.zygote.serve with real forked ranks (stand-in bodies): rank 1 SIGKILLs itself (the
    OOM killer), rank 0 would finish 5 s later with exit 0 and a marker file. Reference: the signal
    sent; rank 0 is stopped before it writes its marker."""
    import os
    import signal
    import sys
    import time
    import warnings

    from torchref import launch, runtime, zygote

    def body(job, rank, world):  # plain system calls only: the test process may hold JAX's threads
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(5)
        os.close(os.open(tmp_path / "rank0_finished", os.O_CREAT | os.O_WRONLY))
        os._exit(0)

    monkeypatch.setattr(launch, "_child", body)
    monkeypatch.setattr(runtime.Job, "from_json", staticmethod(lambda s: None))
    (tmp_path / "job.json").write_text("{}")
    r, w = os.pipe()  # an idle stdin: the launcher is still there
    reply_r, reply_w = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(r))
    try:
        with warnings.catch_warnings():  # JAX's fork warning, where an earlier test started JAX: the
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)  # children run no JAX code
            res = zygote.serve(str(tmp_path / "job.json"), 2, reply_w)
    finally:
        for fd in (w, reply_r, reply_w):
            os.close(fd)
    assert res == {"status": "died", "rank": 1, "code": -9}
    assert not zygote._children and not (tmp_path / "rank0_finished").exists()


# --- a step whose loss or gradient norm is not finite: every strategy stops there, as jaxpar does.
# lr=1e6 turns the tiny model's loss into NaN at step 2 (it trained on to "final_loss": NaN, exit 0).
BLOWUP = ["model=gpt2-tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.seq_len=16",
          "train.batch_size=4", "train.steps=6", "train.lr=1e6", "train.warmup_steps=0"]


@pytest.mark.parametrize("strategy", [
    ["strategy=distributed-ps", "workers=2"],  # DDP (single's loop): every rank stops at the same step
    ["strategy=horovod-amp", "workers=2", "amp.dtype=fp16"],  # mpiexec; GradScaler: the loss alone decides
    ["strategy=single-ps", "workers=2"],  # the server stops; its workers lose it
    ["strategy=single-ps", "workers=2", "ps.async=true"],
], ids=lambda a: "-".join(x.split("=")[1] for x in a))
def test_a_nonfinite_step_stops_every_strategy_with_one_line(tmp_path, strategy):
    import json
    import re

    from support.cli_helpers import run

    r = run(["train", *BLOWUP, *strategy, f"out={tmp_path / 'run'}"], tool="torchref")
    assert r.returncode == 2, r.stderr[-3000:]
    m = re.fullmatch(rf"error: {strategy[0]}: step (\d+): non-finite loss or gradient norm \(loss=nan, "
                     r"grad_norm=(\S+)\); the update was not applied and the run stopped; lower train\.lr\n", r.stderr)
    assert m, r.stderr[-3000:]
    bad = int(m.group(1))
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the steps before it were logged, finite; the non-finite one was not applied, so not logged
    assert 2 <= bad <= 6 and [row["step"] for row in rows] == list(range(1, bad))
    assert all(row["loss"] == row["loss"] for row in rows)  # no NaN among them
    assert not (tmp_path / "run" / "summary.json").exists() and not (tmp_path / "run" / "hf").exists()


def test_check_finite_boundaries():
    from torchref.rank_exit import NonFinite, check_finite

    check_finite(1, 5.5, 1e38)
    check_finite(1, 0.0, float("inf"), norm_counts=False)  # a GradScaler step it skips itself
    for loss, norm, counts in ((float("nan"), 1.0, True), (float("inf"), 1.0, False), (1.0, float("nan"), True),
                               (-float("inf"), 1.0, True), (1.0, float("inf"), True)):
        with pytest.raises(NonFinite) as e:
            check_finite(7, loss, norm, norm_counts=counts)
        assert str(e.value) == (f"step 7: non-finite loss or gradient norm (loss={loss}, grad_norm={norm}); the update "
                                "was not applied and the run stopped; lower train.lr")
