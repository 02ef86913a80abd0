"""Nothing lost, round 4: what a failed start removes, what a write may open, and the
whole-state check of `init_state=`. In-process, no training: the functions are called directly,
races are forced by doing the other run's writes inside the failing run's context.

Independent reference: file trees and exact messages written down by hand here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support import states as S

from gpt2common import state as fmt
from gpt2common.grammar import ConfigError
from gpt2common.outdir import LOCK_FILE, OutLock, hold
from gpt2common.writes import write_atomic


def tree(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


# ----------------------------------------------------------------------------- 1: a failed start


def test_a_failed_start_removes_only_what_it_created_while_holding_the_lock(tmp_path, monkeypatch):
    """A (out=exp/a) creates exp/; B (out=exp/b) starts inside it; A fails before its first step
    (out of memory). A's entries go while A still holds its lock, exp/a goes, exp/ and B's run stay."""
    from jaxpar.run import loop

    a, b = tmp_path / "exp" / "a", tmp_path / "exp" / "b"
    at_release = []
    release = OutLock.release
    monkeypatch.setattr(OutLock, "release", lambda self: (at_release.append(sorted(os.listdir(self.out))),
                                                          release(self)))
    with pytest.raises(MemoryError), loop._holding_out(str(a), True):
        for name in ("config.json", "metrics.jsonl"):
            (a / name).write_text("")
        (a / "data").mkdir()
        (a / "data" / "train.bin").write_bytes(b"\0" * 8)
        b.mkdir()  # B: its lock and config.json
        (b / LOCK_FILE).write_text("4242\n")
        (b / "config.json").write_text('{"B": 1}')
        raise MemoryError
    assert at_release == [[LOCK_FILE]]  # A's entries were gone before it unlocked
    assert tree(tmp_path) == {"exp": None, "exp/b": None, "exp/b/.lock": b"4242\n", "exp/b/config.json": b'{"B": 1}'}
    with pytest.raises(ValueError), loop._holding_out(str(a), True):  # alone: every dir it made goes
        (a / "tb").mkdir()
        raise ValueError
    assert sorted(os.listdir(tmp_path / "exp")) == ["b"]
    (b / LOCK_FILE).unlink()
    (b / "config.json").unlink()
    b.rmdir()
    (tmp_path / "exp").rmdir()
    with pytest.raises(ValueError), loop._holding_out(str(a), True):
        raise ValueError
    assert os.listdir(tmp_path) == []


def test_a_failed_start_keeps_what_it_did_not_create(tmp_path):
    """An out that existed (a restartable run's leftovers) keeps every entry."""
    from jaxpar.run import loop

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(MemoryError), loop._holding_out(str(out), True):
        (out / "tb").mkdir()
        raise MemoryError
    assert tree(out) == {"config.json": b"old", "tb": None}


# ----------------------------------------------------------------------------- 3, 13: state temporaries


def test_a_state_write_never_touches_another_writers_temporary(tmp_path):
    """convert to_state=DIR removed whatever DIR.tmp held; two writes into one new DIR shared it
    (the loser: OSError ENOTEMPTY). Each now writes a temporary of its own; the second is refused."""
    foreign = tmp_path / "s.tmp"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    path = S.write_state(tmp_path / "s")
    assert (foreign / "keep.txt").read_text() == "mine"
    real_rename = os.rename

    def other_writer_first(src, dst):  # the race: another `convert to_state=DIR` renames first
        os.rename = real_rename
        S.write_state(dst)
        real_rename(src, dst)

    os.rename = other_writer_first
    try:
        with pytest.raises(ConfigError) as e:
            S.write_state(tmp_path / "s2")
    finally:
        os.rename = real_rename
    assert str(e.value) == (f"out={path + '2'!r} already exists (written meanwhile by another process); a "
                            "state is written into a new directory")
    assert sorted(os.listdir(tmp_path)) == ["s", "s.tmp", "s2"]  # no temporary left behind
    fmt.load_state(path + "2", "init_state")  # the winner's state is whole


# ----------------------------------------------------------------------------- 4: no write through a link


def test_a_lock_symlink_or_hard_link_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(target)
    with pytest.raises(ConfigError) as e:
        hold(str(out))
    assert str(e.value) == (f"out={str(out)!r}: its lock file .lock is a symlink; remove it (a run never writes "
                            "through a link)")
    (out / LOCK_FILE).unlink()
    os.link(target, out / LOCK_FILE)
    with pytest.raises(ConfigError) as e:
        hold(str(out))
    assert str(e.value) == (f"out={str(out)!r}: its lock file .lock has other hard links; remove it (a run never "
                            "writes a foreign file)")
    assert target.read_text() == "precious"


def test_an_atomic_write_never_follows_a_link_at_its_temporary(tmp_path):
    """write_atomic wrote `<path>.tmp` through open(): a symlink there truncated its target."""
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    (tmp_path / "config.json.tmp").symlink_to(target)
    write_atomic(tmp_path / "config.json", "{}")
    assert (tmp_path / "config.json").read_text() == "{}" and target.read_text() == "precious"
    (tmp_path / "metrics.jsonl").symlink_to(target)  # the file itself a link: replaced, not followed
    write_atomic(tmp_path / "metrics.jsonl", "x\n")
    assert not (tmp_path / "metrics.jsonl").is_symlink() and target.read_text() == "precious"


def test_the_runs_appended_and_log_files_never_follow_a_link(tmp_path):
    """metrics.jsonl (appended) and a rank's log (written anew) were opened through open(): a
    symlink or hard link there wrote into its target. Now: ELOOP, EEXIST, or the name replaced."""
    import errno

    from gpt2common.writes import open_fd, open_new

    target = tmp_path / "precious.txt"
    target.write_text("precious")
    (tmp_path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(OSError) as e:
        open_new(tmp_path / "metrics.jsonl", append=True)
    assert e.value.errno == errno.ELOOP
    os.link(target, tmp_path / "hard.jsonl")
    with pytest.raises(OSError) as e:
        open_new(tmp_path / "hard.jsonl", append=True)
    assert e.value.errno == errno.EEXIST
    os.close(open_fd(tmp_path / "metrics.jsonl"))  # a log written anew: the link goes, a new file comes
    assert not (tmp_path / "metrics.jsonl").is_symlink() and target.read_text() == "precious"


# ----------------------------------------------------------------------------- 8, 9, 12, 18, 21: the whole state


def _retensor(path: str, file: str, change) -> None:
    """Rewrite one safetensors file of state `path` through `change(tensors)` and re-sign it in the
    manifest, so that only the check of the tensors themselves can refuse it."""
    import hashlib

    p = os.path.join(path, file)
    tensors = load_file(p)
    change(tensors)
    save_file(tensors, p, metadata={"format": "pt"})
    m = json.loads(open(os.path.join(path, fmt.MANIFEST)).read())
    m["files"][file] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    open(os.path.join(path, fmt.MANIFEST), "w").write(json.dumps(m))


def _remanifest(path: str, change) -> None:
    m = json.loads(open(os.path.join(path, fmt.MANIFEST)).read())
    change(m)
    open(os.path.join(path, fmt.MANIFEST), "w").write(json.dumps(m))


WTE = "transformer.wte.weight"


def _nan_mu(t):
    t[fmt.MU + WTE][0, 0] = np.nan


def _neg_nu(t):
    t[fmt.NU + WTE][1, 2] = -1e-3


def _fp16_nu(t):
    t[fmt.NU + WTE] = t[fmt.NU + WTE].astype(np.float16)


def _extra(t):
    t["lm_head.extra"] = np.zeros(3, np.float32)


BAD_STATES = [  # (what is changed, the refusal after `init_state='<dir>'`)
    (("t", fmt.OPTIMIZER_FILE, _nan_mu), f": optimizer.safetensors: exp_avg.{WTE} holds non-finite values"),
    (("t", fmt.OPTIMIZER_FILE, _neg_nu), f": optimizer.safetensors: exp_avg_sq.{WTE} holds negative second moments"),
    (("t", fmt.OPTIMIZER_FILE, _fp16_nu), f": optimizer.safetensors: exp_avg_sq.{WTE} is float16, not float32"),
    (("t", fmt.MODEL_FILE, _extra), ": model.safetensors holds tensors no GPT-2 state has (lm_head.extra)"),
    (("m", lambda m: m["optimizer"].update(adam_count=1)),
     " is inconsistent: step 3 with 0 skipped non-finite steps needs AdamW and schedule counts 3, the manifest "
     "has 1 and 3"),
    (("m", lambda m: m.update(step=100)), " is at step 100: train.steps=6 leaves no step to run"),
    (("m", lambda m: m.update(step="3")), ": manifest.json field step is '3', not an integer"),
    (("m", lambda m: m["model"].pop("n_layer")), ": manifest.json field model.n_layer is missing"),
    (("m", lambda m: m.update(optimizer=[])), ": manifest.json field 'optimizer' is [], not an object"),
    (("m", lambda m: m["train"].update(lr="0.001")), ": manifest.json field train.lr is '0.001', not a finite number"),
    (("m", lambda m: m["optimizer"].update(adam_count=True)),
     ": manifest.json field optimizer.adam_count is True, not an integer"),
]


def bad_state(tmp_path, change) -> str:
    path = S.write_state(tmp_path / "s")
    if change[0] == "t":
        _retensor(path, change[1], change[2])
    else:
        _remanifest(path, change[1])
    return path


@pytest.mark.parametrize("change,msg", BAD_STATES)
def test_jaxpar_checks_a_state_whole_before_any_write(tmp_path, capsys, change, msg):
    from jaxpar import cli

    path, out = bad_state(tmp_path, change), tmp_path / "out"
    assert cli.main(["train", *S.KEYS, "progress=none", f"init_state={path}", f"out={out}"]) == 2
    assert capsys.readouterr().err == f"error: init_state={path!r}{msg}\n"
    assert not out.exists()


@pytest.mark.parametrize("change,msg", BAD_STATES)
def test_torchref_checks_a_state_whole_before_any_write(tmp_path, capsys, change, msg):
    from torchref.cli import main

    path, out = bad_state(tmp_path, change), tmp_path / "out"
    assert main(["train", *S.KEYS, f"init_state={path}", f"out={out}"]) == 2
    assert capsys.readouterr().err == f"error: init_state={path!r}{msg}\n"
    assert not out.exists()


def test_a_state_of_skipped_steps_is_consistent_for_jaxpar(tmp_path):
    """jaxpar's skipped non-finite steps advance the step, not the counts: step 3 with one skipped
    and counts 2 is whole (torchref refuses it for its own reason: test_torchref_state)."""
    path = S.write_state(tmp_path / "s", nonfinite_skipped=1,
                         optimizer={"name": "adamw", "adam_count": 2, "schedule_count": 2, "lr_next": 1e-3})
    m = fmt.read_manifest(path, "init_state")
    fmt.check_compatible(m, path, "init_state", S.TINY, S.TRAIN, 0)
    assert fmt.load_state(path, "init_state").step == 3


# ----------------------------------------------------------------------------- 15, 16: any errno, out of memory


@pytest.mark.parametrize("raised,line", [
    (PermissionError(13, "Permission denied", "/r/ckpt/4.orbax-checkpoint-tmp"), "Permission denied (errno 13)"),
    (ValueError("write failed [os_error_code='24']"), "Too many open files (errno 24)"),
    (MemoryError(), "Cannot allocate memory (errno 12)"),
    (ValueError("RESOURCE_EXHAUSTED: Failed to allocate 4096 bytes"), "Cannot allocate memory (errno 12)"),
])
def test_a_checkpoint_refused_for_any_errno_is_one_line_and_leaves_no_partial(tmp_path, raised, line):
    """EACCES on orbax's rename (write permission taken away mid-run), EMFILE (ulimit -n), an
    allocation refused inside the write (ulimit -v) were tracebacks with a partial step left."""
    import jax.numpy as jnp

    from gpt2common.writes import WriteFailed
    from jaxpar.run.checkpoint import Checkpointer

    ck = Checkpointer(str(tmp_path))
    partial = tmp_path / "ckpt" / "4.orbax-checkpoint-tmp-1"

    def save(step, args, force):
        partial.mkdir(parents=True)
        raise raised

    ck.mngr.save = save
    with pytest.raises(WriteFailed) as e:
        ck.save(4, {"params": {"w": jnp.ones(2)}}, {"step": 4})
    assert str(e.value) == f"cannot write checkpoint {tmp_path / 'ckpt' / '4'}: {line}"
    assert not partial.exists()


def test_any_errno_and_out_of_memory_reach_the_cli_as_one_line(monkeypatch, capsys):
    import jax

    from jaxpar import cli
    from jaxpar.run import commands

    oom = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1234 bytes."
    advice = ("; lower train.batch_size (or raise train.grad_accum), the model size or the sequence length, "
              "or add devices")
    for raised, line in [
        (OSError(24, "Too many open files", "/r/metrics.jsonl"), "cannot use /r/metrics.jsonl: Too many open "
                                                                  "files (errno 24)"),
        (MemoryError(), f"out of memory (a host allocation failed){advice}"),
        (jax.errors.JaxRuntimeError(oom + "\nmore"), f"out of memory ({oom}){advice}"),
    ]:
        def train(argv, raised=raised):
            raise raised
        monkeypatch.setattr(commands, "train", train)
        assert cli.main(["train"]) == 4
        assert capsys.readouterr().err == f"error: {line}\n"


def test_out_of_memory_in_a_job_is_not_a_lost_peer():
    """In a multi-process run an XLA RESOURCE_EXHAUSTED was taken for a failed collective and
    reported as 'lost contact with its peers' (exit 3); it is the process's own out of memory."""
    import jax

    from jaxpar.run.loop import _peer_lost

    assert not _peer_lost(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 45 bytes."))
    assert _peer_lost(jax.errors.JaxRuntimeError("UNAVAILABLE: Connection reset by peer"))


def test_a_step_quarantined_again_keeps_the_earlier_copy(tmp_path):
    """resume moves an unreadable step to ckpt.corrupt/<step> "for inspection"; a second bad copy
    of the same step removed the first (rmtree of a dir an earlier run made)."""
    from jaxpar.run.checkpoint import QUARANTINE_DIR, _quarantine

    (tmp_path / QUARANTINE_DIR / "2").mkdir(parents=True)
    (tmp_path / QUARANTINE_DIR / "2" / "old").write_text("first bad copy")
    (tmp_path / "ckpt" / "2").mkdir(parents=True)
    (tmp_path / "ckpt" / "2" / "new").write_text("second bad copy")
    assert _quarantine(str(tmp_path), 2) == str(tmp_path / QUARANTINE_DIR / "2.1")
    assert tree(tmp_path / QUARANTINE_DIR) == {"2": None, "2/old": b"first bad copy", "2.1": None,
                                                "2.1/new": b"second bad copy"}
    assert os.listdir(tmp_path / "ckpt") == []


def test_a_metrics_write_refused_mid_run_for_any_errno_is_write_failed():
    """At a step every errno is the storage's refusal (exit 4 with the checkpoint hint); without a
    step (an output path the user named) only a full disk, quota, size limit, read-only or I/O
    error is: the rest stays an OSError for the caller (plot's `out=... cannot be written`)."""
    import errno

    from gpt2common.writes import WriteFailed, refused_write

    with pytest.raises(WriteFailed) as e, refused_write("/r/metrics.jsonl", 7):
        raise PermissionError(errno.EACCES, "Permission denied")
    assert str(e.value) == "step 7: cannot use /r/metrics.jsonl: Permission denied (errno 13)"
    with pytest.raises(PermissionError), refused_write("/r/curves.png"):
        raise PermissionError(errno.EACCES, "Permission denied")
