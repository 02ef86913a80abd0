"""Damaged checkpoints: truncated, zero-filled or deleted files in the latest
step make `jaxpar.run.checkpoint.restore` (the one path behind resume, eval, sample and convert)
fall back to the newest intact step with one warning line naming the skipped step; nothing
readable at all is one ConfigError (CLI: one `error:` line, exit 2).

In-process cases use a tiny two-step checkpoint (fast); the CLI cases train gpt2-sized-down runs.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cli_helpers import run

from jaxpar.config import ConfigError
from jaxpar.run.checkpoint import QUARANTINE_DIR, Checkpointer, restore

ONE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _state(step: int) -> dict:
    """Values that differ per step, so a test can tell which step came back."""
    params = {"w": jnp.arange(32.0).reshape(8, 4) * step, "b": {"c": jnp.full((5,), 0.5 + step)}}
    return {"params": params, "opt_state": {"mu": jnp.ones((8, 4)) * step, "count": jnp.int32(step)}}


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=ONE), tree)


P_ABS, O_ABS = _abstract(_state(1)["params"]), _abstract(_state(1)["opt_state"])


@pytest.fixture
def two_steps(tmp_path):
    ck = Checkpointer(str(tmp_path))
    for s in (1, 2):
        ck.save(s, _state(s), {"step": s})
    ck.close()
    return tmp_path


def _files(run_dir, step: int, pattern: str) -> list[str]:
    found = [f for f in glob.glob(os.path.join(run_dir, "ckpt", str(step), pattern)) if os.path.isfile(f)]
    assert found, pattern
    return found


def _damage(path: str, how: str) -> None:
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "zero":
        n = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(b"\0" * n)
    else:
        os.remove(path)


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("warning:")]


# The files that hold a step's arrays and their index; damage to any of them must be caught.
TARGETS = {"params data": "params/d/*", "params index": "params/manifest.ocdbt", "params metadata": "params/_METADATA",
           "opt_state data": "opt_state/d/*", "meta": "meta/metadata"}


@pytest.mark.parametrize("how", ["truncate", "zero", "delete"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_damaged_latest_step_falls_back_to_previous(two_steps, target, how, capsys):
    for f in _files(two_steps, 2, TARGETS[target]):
        _damage(f, how)
    r = restore(str(two_steps), P_ABS, O_ABS)
    assert r.step == 1 and r.meta["step"] == 1
    want = _state(1)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), r.params,
                                     want["params"]))
    assert int(r.opt_state["count"]) == 1
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1
    assert lines[0].startswith(f"warning: skipped unreadable checkpoint step 2 in {two_steps / 'ckpt'} (")
    assert lines[0].endswith("); using step 1")
    assert os.path.isdir(two_steps / "ckpt" / "2")  # eval/sample/convert never move anything


def test_checksum_mismatch_is_caught(two_steps, capsys):
    """Bytes that decode but are not what was written (bit rot): the per-array checksums in meta
    catch them. Simulated by editing the recorded checksum of one params array."""
    path = _files(two_steps, 2, "meta/metadata")[0]
    meta = json.loads(open(path).read())
    meta["checksums"]["params"][0] ^= 1
    with open(path, "w") as f:
        json.dump(meta, f)
    r = restore(str(two_steps), P_ABS)
    assert r.step == 1
    (line,) = _warnings(capsys.readouterr().err)
    assert line == (f"warning: skipped unreadable checkpoint step 2 in {two_steps / 'ckpt'} "
                    f"(_Corrupt: params fail their checksums); using step 1")


def test_opt_state_checksum_mismatch_is_caught(two_steps, capsys):
    """The optimizer state is checked too when it is restored (resume): its moments are what a
    resumed run continues from."""
    path = _files(two_steps, 2, "meta/metadata")[0]
    meta = json.loads(open(path).read())
    meta["checksums"]["opt_state"][0] ^= 1
    with open(path, "w") as f:
        json.dump(meta, f)
    r = restore(str(two_steps), P_ABS, O_ABS)
    assert r.step == 1 and int(r.opt_state["count"]) == 1
    (line,) = _warnings(capsys.readouterr().err)
    assert line == (f"warning: skipped unreadable checkpoint step 2 in {two_steps / 'ckpt'} "
                    f"(_Corrupt: opt_state fail their checksums); using step 1")
    assert restore(str(two_steps), P_ABS).step == 2  # params alone are intact: eval/sample use step 2


def test_intact_latest_step_is_used_silently(two_steps, capsys):
    r = restore(str(two_steps), P_ABS, O_ABS)
    assert r.step == 2 and float(r.params["b"]["c"][0]) == 2.5 and int(r.opt_state["count"]) == 2
    assert _warnings(capsys.readouterr().err) == []


def test_nothing_readable_is_one_config_error(two_steps, capsys):
    for step in (1, 2):
        for f in _files(two_steps, step, "params/d/*"):
            _damage(f, "zero")
    with pytest.raises(ConfigError) as e:
        restore(str(two_steps), P_ABS, quarantine=True)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint={str(two_steps)!r}: no readable checkpoint step (tried 2 (")
    assert "); 1 (" in msg and "\n" not in msg
    assert _warnings(capsys.readouterr().err) == []  # the error line says it all
    assert sorted(os.listdir(two_steps / "ckpt")) == ["1", "2"]  # a failed restore moves nothing
    assert not os.path.exists(two_steps / QUARANTINE_DIR)


def test_wrong_model_is_a_config_error_not_a_fallback(two_steps, capsys):
    wrong = dict(P_ABS, w=jax.ShapeDtypeStruct((8, 5), jnp.float32, sharding=ONE))
    with pytest.raises(ConfigError) as e:
        restore(str(two_steps), wrong)
    assert str(e.value) == (f"checkpoint={str(two_steps)!r} step 2 holds params['w'] of shape (8, 4) but the "
                            "model needs (8, 5) (model.* differs from the run that wrote it)")
    assert _warnings(capsys.readouterr().err) == []


def test_quarantine_moves_the_skipped_step_aside(two_steps, capsys):
    for f in _files(two_steps, 2, "params/d/*"):
        _damage(f, "truncate")
    r = restore(str(two_steps), P_ABS, O_ABS, quarantine=True, key="out")
    assert r.step == 1
    assert sorted(os.listdir(two_steps / "ckpt")) == ["1"]
    assert os.listdir(two_steps / QUARANTINE_DIR) == ["2"]
    (line,) = _warnings(capsys.readouterr().err)
    assert line.endswith(f"); using step 1; moved it to {two_steps / QUARANTINE_DIR / '2'}")


def test_not_a_run_dir(tmp_path):
    with pytest.raises(ConfigError) as e:
        restore(str(tmp_path), P_ABS)
    assert str(e.value) == f"checkpoint={str(tmp_path)!r} has no ckpt/ directory (not a jaxpar run dir)"


# ----------------------------------------------------------------------------- through the CLI

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.vocab_size=256", "train.seq_len=16",
        "train.batch_size=4", "train.steps=3", "train.ckpt_every=1", "precision=fp32", "train.eval_every=0",
        "progress=none"]


def _losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step fsdp x tensor run keeping checkpoints 2 and 3."""
    out = tmp_path_factory.mktemp("corrupt") / "run"
    r = run(["train", *TINY, "mesh.fsdp=2", "mesh.tensor=2", f"out={out}"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(out / "ckpt")) == ["2", "3"]
    return out


def test_resume_skips_a_zero_filled_latest_step(trained, tmp_path):
    """Zero-fill ckpt/3's params, then resume on one device: warned, step 3 moved aside, step 3
    retrained from step 2 with the original loss (fp32 sharding tolerance, other mesh)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    for f in _files(out, 3, "params/d/*"):
        _damage(f, "zero")
    r = run(["train", *TINY, f"out={out}", "resume=true"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = _warnings(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"warning: skipped unreadable checkpoint step 3 in {out / 'ckpt'} (")
    assert lines[0].endswith(f"); using step 2; moved it to {out / QUARANTINE_DIR / '3'}")
    before, after = _losses(trained), _losses(out)
    assert sorted(after) == [1, 2, 3]
    assert abs(after[3] - before[3]) <= 1e-5 * before[3]
    assert sorted(os.listdir(out / "ckpt")) == ["2", "3"]


def test_resume_below_the_checkpoint_step_exits_2_and_moves_nothing(trained, tmp_path):
    """resume=true with train.steps=1 while ckpt/3 is damaged and ckpt/2 intact: one error line,
    exit 2, and ckpt/3 stays where it was (the refusal comes before the quarantine)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    for f in _files(out, 3, "params/d/*"):
        _damage(f, "zero")
    args = [a for a in TINY if not a.startswith("train.steps=")]
    r = run(["train", *args, "train.steps=1", f"out={out}", "resume=true"])
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == "error: train.steps=1 is below the step of the checkpoint to resume (2)"
    assert sorted(os.listdir(out / "ckpt")) == ["2", "3"] and not os.path.exists(out / QUARANTINE_DIR)


@pytest.mark.slow
def test_eval_falls_back_then_errors_when_nothing_is_readable(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    data = ["data=" + str(out / "data"), "eval.windows=32"]
    ref = run(["eval", f"checkpoint={out}", *data])
    assert ref.returncode == 0, ref.stderr[-2000:]
    shutil.rmtree(out / "ckpt" / "3")
    want = json.loads(ref.stdout)  # step 3's loss; step 2's is what a fallback must give
    step2 = json.loads(run(["eval", f"checkpoint={out}", *data]).stdout)
    assert step2["loss"] != want["loss"]
    shutil.rmtree(out)
    shutil.copytree(trained, out)
    for f in _files(out, 3, "params/manifest.ocdbt"):
        _damage(f, "truncate")
    r = run(["eval", f"checkpoint={out}", *data])
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == step2
    (line,) = _warnings(r.stderr)
    assert line.startswith(f"warning: skipped unreadable checkpoint step 3 in {out / 'ckpt'} (")
    for f in _files(out, 2, "params/d/*"):
        _damage(f, "delete")
    r = run(["eval", f"checkpoint={out}", *data])
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpoint={str(out)!r}: no readable checkpoint step (tried 3 (")


def test_a_refused_step_quarantines_nothing(two_steps, capsys):
    """`accept` (resume's train.steps check) refuses the restored step before the damaged newer
    step is moved to ckpt.corrupt/: a command that exits 2 leaves the run dir as it was."""
    for f in _files(two_steps, 2, "params/d/*"):
        _damage(f, "truncate")

    def accept(step):
        raise ConfigError(f"train.steps=0 is below the step of the checkpoint to resume ({step})")

    with pytest.raises(ConfigError) as e:
        restore(str(two_steps), P_ABS, O_ABS, quarantine=True, key="out", accept=accept)
    assert str(e.value) == "train.steps=0 is below the step of the checkpoint to resume (1)"
    assert sorted(os.listdir(two_steps / "ckpt")) == ["1", "2"]
    assert not os.path.exists(two_steps / QUARANTINE_DIR)
    assert _warnings(capsys.readouterr().err) == []


def _raised(text: str, filename: str) -> Exception:
    """An exception raised by code whose file is `filename` (as orbax's coroutines raise theirs)."""
    try:
        exec(compile(f"raise Exception({text!r})", filename, "exec"))
    except Exception as e:  # noqa: BLE001
        return e


def test_only_orbax_read_failures_are_dropped_as_orphans():
    """A damaged step's other reads fail after the restore gave up, in three forms: unraisable
    'Event loop is closed', unraisable read coroutines, asyncio's never-retrieved task or gathering
    future. Up to 860 traceback lines around the one warning (4 of 6 evals by hand; 0 of 14 after).
    Only those go: the same text raised outside orbax, or an orbax write failure, still shows."""
    import logging
    from types import SimpleNamespace

    from jaxpar.run import checkpoint as C

    orbax = f"{os.sep}site-packages{os.sep}orbax{os.sep}checkpoint{os.sep}_src{os.sep}serialization.py"
    read = _raised("Encountered error while reading array index: (slice(0, 2, 1),)", orbax)
    cases = {  # exception -> dropped
        read: True,
        _raised('OUT_OF_RANGE: Error reading "wpe.weight/0.0" in OCDBT database', orbax): True,
        _raised("Encountered error while reading array index", f"{os.sep}elsewhere{os.sep}mine.py"): False,
        _raised("Error writing local file", orbax): False,
    }
    for exc, dropped in cases.items():
        assert C._orphaned_read_error(SimpleNamespace(exc_value=exc, object=None)) is dropped, exc
        record = logging.LogRecord("asyncio", logging.ERROR, "x", 1, "Task exception was never retrieved\nfuture: <Task>",
                                   None, (type(exc), exc, exc.__traceback__))
        assert C._OrphanedReadTasks().filter(record) is (not dropped), exc
    assert C._orphaned_read_error(SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None))
    assert not C._orphaned_read_error(SimpleNamespace(exc_value=RuntimeError("Event loop is open"), object=None))
    # asyncio's other records of the same exception (not "never retrieved") pass
    record = logging.LogRecord("asyncio", logging.ERROR, "x", 1, "Exception in callback", None,
                               (Exception, read, read.__traceback__))
    assert C._OrphanedReadTasks().filter(record) is True


def test_a_step_that_lost_its_whole_opt_state_is_damaged_not_weights_only(two_steps, capsys):
    """A step saved without an optimizer state on purpose (`jaxpar convert hf=`) restores with
    opt_state None; one whose opt_state dir went missing still lists opt_state's checksums in its
    meta, so it is unreadable and the previous step is used."""
    import shutil

    shutil.rmtree(two_steps / "ckpt" / "2" / "opt_state")
    r = restore(str(two_steps), P_ABS, O_ABS)
    assert r.step == 1 and int(r.opt_state["count"]) == 1
    assert len(_warnings(capsys.readouterr().err)) == 1


def test_a_step_written_before_checksums_still_restores_its_opt_state(two_steps):
    """Checkpoints from before the checksums existed have none in their meta: that is no sign of a
    weights-only step, and their optimizer state comes back."""
    path = _files(two_steps, 2, "meta/metadata")[0]
    meta = json.loads(open(path).read())
    del meta["checksums"]
    with open(path, "w") as f:
        json.dump(meta, f)
    r = restore(str(two_steps), P_ABS, O_ABS)
    assert r.step == 2 and int(r.opt_state["count"]) == 2
