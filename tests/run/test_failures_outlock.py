"""One writer per run dir: a run holds `<out>/.lock` (flock) for its lifetime; a second
`jaxpar train`, a `resume=true`, a `jaxpar launch` of either, a `convert hf=` and a `torchref
train` into a held out are refused with one line naming the holder's pid, exit 2, nothing
touched; the lock is stale once its holder dies; readers (eval; inspect, which writes nothing)
work on a held out.

Independent reference: the holder's pid from the test's own Popen, file contents snapshotted by
hand before and after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support.cli_helpers import clean_env, run

from gpt2common.outdir import LOCK_FILE, check_free, hold
from jaxpar import config as C
from jaxpar.config import ConfigError

TINY = ["model=gpt2-tiny", "train.seq_len=16", "train.batch_size=2", "train.eval_every=0", "progress=plain"]
HOLD = "import sys, time; from gpt2common.outdir import hold; hold(sys.argv[1]); print('held', flush=True); time.sleep(600)"


def snapshot(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


def refusal(out, pid) -> str:
    return (f"error: out={str(out)!r} is in use by a running process (pid {pid}); wait for it to finish, "
            "stop it, or choose another out")


@pytest.fixture
def held(tmp_path):
    """A run dir (config.json, a metrics line) held by another process: (out, holder Popen)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(C.dumps(C.resolve(TINY)))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=clean_env())
    assert p.stdout.readline() == "held\n"
    yield out, p
    p.kill()
    p.wait()


@pytest.mark.parametrize("argv", [
    ["train", *TINY, "train.steps=2"],
    ["train", *TINY, "resume=true"],
    ["launch", "nprocs=2", "--", "train", *TINY, "resume=true"],
])
def test_a_held_out_refuses_a_second_jaxpar_writer(held, argv):
    out, holder = held
    before = snapshot(out)
    r = run([*argv, f"out={out}"], timeout=60)
    assert (r.returncode, r.stderr) == (2, refusal(out, holder.pid) + "\n")
    assert snapshot(out) == before


def test_a_held_out_refuses_convert_hf(held, tmp_path):
    """`convert hf= out=` writes a run dir too: into an out a run has just taken (nothing but the
    lock written yet), refused like a second train."""
    from gpt2common import hf
    from gpt2common.model import ModelConfig
    from jaxpar.models import gpt2

    out, holder = held
    for name in ("config.json", "metrics.jsonl"):
        (out / name).unlink()
    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    hf.save_hf(str(tmp_path / "hf"), mc, gpt2.init_params(mc, 0))
    r = run(["convert", f"hf={tmp_path / 'hf'}", f"out={out}"], timeout=60)
    assert (r.returncode, r.stderr) == (2, refusal(out, holder.pid) + "\n")
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]


def test_inspect_of_a_held_out_still_works(held):
    """inspect (train dry_run=true) writes nothing into out: not a writer, not refused."""
    from gpt2common.grammar import parse_kv
    from jaxpar.run.rundir import resolve_train

    out, holder = held
    before = snapshot(out)
    r = run(["inspect", *TINY, "train.steps=2", f"out={out}"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert snapshot(out) == before
    kv = parse_kv([*TINY, f"out={out}"])
    assert resolve_train({**kv, "dry_run": "true"}, None).dry_run
    with pytest.raises(ConfigError, match=rf"\(pid {holder.pid}\)"):
        resolve_train(kv, None)


def test_a_held_out_refuses_torchref_train(held):
    out, holder = held
    (out / "config.json").unlink()  # a torchref run's leftovers: otherwise refused as foreign, not as held
    (out / "job.json").write_text("{}")
    before = snapshot(out)
    r = run(["train", "strategy=single", "model=gpt2-tiny", "train.seq_len=16", "train.steps=1", f"out={out}"],
            tool="torchref", timeout=120)
    assert (r.returncode, r.stderr.strip().splitlines()) == (2, [refusal(out, holder.pid)])
    assert snapshot(out) == before


def test_a_dead_holders_lock_is_stale(held):
    out, holder = held
    with pytest.raises(ConfigError, match=rf"\(pid {holder.pid}\)"):
        hold(str(out))
    holder.kill()
    holder.wait()
    assert (out / LOCK_FILE).read_text() == f"{holder.pid}\n"  # left behind by kill -9, and ignored:
    check_free(str(out))
    lock = hold(str(out))
    assert (out / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    check_free(str(out))  # the holder itself may check its out again (torchref's prepare does)
    lock.release()
    assert not (out / LOCK_FILE).exists()
    # a resume into it gets past the lock to the run dir's own rules
    r = run(["train", *TINY, "resume=true", f"out={out}"], timeout=60)
    assert r.stderr == f"error: resume=true but out={str(out)!r} holds no complete checkpoint (start it over " \
                       "without resume=true)\n"


def test_a_dir_holding_only_a_stale_lock_counts_as_empty(tmp_path, capsys):
    """kill -9 before a run's first write but after its lock: the dir is a fresh run's, not the
    leftovers of a failed one, and `convert hf=` may write into it."""
    from gpt2common import hf
    from gpt2common.model import ModelConfig
    from jaxpar import cli
    from jaxpar.models import gpt2
    from jaxpar.run.rundir import check_out_dir

    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text("123\n")  # no live holder
    assert check_out_dir(C.resolve([*TINY, f"out={out}"]), lambda _: None) == (None, False)
    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    hf.save_hf(str(tmp_path / "hf"), mc, gpt2.init_params(mc, 0))
    assert cli.main(["convert", f"hf={tmp_path / 'hf'}", f"out={out}"]) == 0, capsys.readouterr().err
    assert (out / "config.json").exists() and (out / "ckpt" / "0").is_dir()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
def test_a_running_run_holds_its_out_and_readers_still_work(tmp_path):
    """A real run stops itself (SIGSTOP) after step 2's metrics, with step 1 checkpointed: a second
    train is refused naming its pid, eval reads its checkpoint; continued, it finishes untouched."""
    out = tmp_path / "run"
    args = [*TINY, "train.steps=3", "train.ckpt_every=1", f"out={out}"]
    p = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "train", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=clean_env(JAXPAR_FAULT_SIGNAL="SIGSTOP@2"))
    try:
        deadline = time.monotonic() + 120
        while _state(p.pid) != "T":
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
            time.sleep(0.1)
        assert (out / LOCK_FILE).read_text() == f"{p.pid}\n"
        r = run(["train", *TINY, "train.steps=3", f"out={out}"], timeout=60)
        assert (r.returncode, r.stderr) == (2, refusal(out, p.pid) + "\n")
        r = run(["eval", f"checkpoint={out}", f"data={out / 'data'}", "eval.windows=2"], timeout=120)
        assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == 2 * 16, r.stderr
        os.kill(p.pid, signal.SIGCONT)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    finally:
        if p.poll() is None:
            p.kill()
    assert [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(os.listdir(out / "ckpt")) == ["2", "3"] and not (out / LOCK_FILE).exists()


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    """Some network mounts refuse flock (ENOLCK): a warning, not a refusal of every run there."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "run"
    lock = hold(str(out))
    check_free(str(out))
    assert capsys.readouterr().err == (f"warning: out={str(out)!r} cannot be locked (No locks available); a "
                                       "second run into it would not be detected\n")
    assert (out / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    lock.release()
    assert not out.exists()  # created by hold, left empty: removed


def test_a_release_between_a_starters_open_and_flock_never_gives_two_holders(tmp_path, monkeypatch):
    """The race forced in one process: B opens `.lock` (the holder A's file), and before B's flock
    A releases (unlinks the file, unlocks) and C takes the out (a new `.lock`, locked). B's flock
    then succeeds on A's unlinked file: B must see that the path is another inode now, take the
    path's file and be refused by C's lock. Comparing anything but the inode (st_dev is the same
    for every file of the dir) would let B write beside C."""
    import fcntl

    out = str(tmp_path / "run")
    a = hold(out)
    real = fcntl.flock
    taken = {}

    def flock(fd, op):
        if not taken and op & fcntl.LOCK_EX:  # B's first flock, on A's file: A goes, C comes first
            taken["a_file"] = os.fstat(fd).st_ino
            a.release()
            monkeypatch.setattr(fcntl, "flock", real)
            taken["c"] = hold(out)
            monkeypatch.setattr(fcntl, "flock", flock)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    try:
        with pytest.raises(ConfigError) as e:
            hold(out)  # B
        assert str(e.value) == refusal(out, os.getpid())[len("error: "):]
        c = taken["c"]
        assert os.fstat(c.fd).st_ino == os.stat(os.path.join(out, LOCK_FILE)).st_ino != taken["a_file"]
        assert open(os.path.join(out, LOCK_FILE)).read() == f"{os.getpid()}\n"  # C's pid, unchanged by B
    finally:
        monkeypatch.setattr(fcntl, "flock", real)
        if "c" in taken:
            taken["c"].release()
    # A's release removed the out it had created (empty then), C made it again and removed it on release
    assert not os.path.exists(out)


def test_a_release_between_a_starters_open_and_flock_leaves_the_starter_holding_the_path(tmp_path, monkeypatch):
    """The same race with no third run: B's flock succeeds on A's unlinked file, B finds no file at
    the path, takes a new one and holds it: the lock file at the path is B's (locked, B's pid), so
    the next starter is refused rather than holding out beside B (B holding the unlinked file would
    leave the path free)."""
    import fcntl

    out = str(tmp_path / "run")
    os.makedirs(out)
    a = hold(out)
    real = fcntl.flock
    seen = []

    def flock(fd, op):
        if not seen and op & fcntl.LOCK_EX:
            seen.append(os.fstat(fd).st_ino)
            a.release()
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    b = hold(out)
    monkeypatch.setattr(fcntl, "flock", real)
    try:
        path = os.path.join(out, LOCK_FILE)
        # (A's inode number may be reused once B closed it: only the path's match is asserted)
        assert seen and os.fstat(b.fd).st_ino == os.stat(path).st_ino
        assert open(path).read() == f"{os.getpid()}\n"
        with pytest.raises(ConfigError) as e:
            third = hold(out)  # (check_free would pass: it skips this process's own pid)
            third.release()
        assert str(e.value) == refusal(out, os.getpid())[len("error: "):]
    finally:
        b.release()
    assert os.listdir(out) == []
