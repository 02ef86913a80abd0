"""The training-state format (gpt2common/state.py) and jaxpar's bad-input paths around it
(`convert to_state=`, `train init_state=`): one `error:` line naming the value, exit 2, nothing
written or overwritten. The continuation itself is proven in parity_tests/test_state_handoff.py."""

import dataclasses
import os

import numpy as np
import pytest
from support import states as S
from support.cli_helpers import run

from gpt2common import hf
from gpt2common import state as fmt
from gpt2common.grammar import ConfigError
from gpt2common.init import init_params

KEYS = [*S.KEYS, "precision=fp32", "progress=none"]
_write = S.write_state


def test_round_trip_keeps_every_tensor_and_the_manifest(tmp_path):
    path = _write(tmp_path / "s")
    assert sorted(os.listdir(path)) == ["config.json", fmt.MANIFEST, fmt.MODEL_FILE, fmt.OPTIMIZER_FILE]
    st = fmt.load_state(path, "init_state")
    sd = hf.to_hf_state_dict(S.TINY, init_params(S.TINY, 0))
    assert st.step == 3 and st.manifest["format_version"] == fmt.FORMAT_VERSION == 1
    assert set(st.params) == set(sd) and len(sd) == 4 + 12 * S.TINY.n_layer  # HF names, lm_head tied (not stored)
    for k, v in sd.items():
        assert st.params[k].dtype == np.float32 and np.array_equal(st.params[k], v), k
        assert np.all(st.exp_avg[k] == 0.5) and np.all(st.exp_avg_sq[k] == 0.25), k
    # the dir is also an HF save_pretrained dir: init= reads its weights
    mc, params = hf.load_hf(path)
    assert mc.n_embd == S.TINY.n_embd and np.array_equal(params["wte"]["weight"], sd["transformer.wte.weight"])


def test_checks_name_the_value(tmp_path):
    path = _write(tmp_path / "s")
    m = fmt.read_manifest(path, "init_state")
    with pytest.raises(ConfigError, match=r"model.n_embd=128, this run has model.n_embd=64"):
        fmt.check_compatible(m, path, "init_state", dataclasses.replace(S.TINY, n_embd=64),
                             S.TRAIN, 0)
    with pytest.raises(ConfigError, match=r"train.lr=0.001, this run has train.lr=0.002"):
        fmt.check_compatible(m, path, "init_state", S.TINY, dataclasses.replace(S.TRAIN, lr=2e-3), 0)
    with pytest.raises(ConfigError, match=r"seed=0, this run has seed=1"):
        fmt.check_compatible(m, path, "init_state", S.TINY, S.TRAIN, 1)
    fmt.check_compatible(m, path, "init_state", S.TINY, dataclasses.replace(S.TRAIN, grad_accum=2), 0)
    with pytest.raises(ConfigError, match=r"train.steps=6, this run has train.steps=2"):
        fmt.check_compatible(m, path, "init_state", S.TINY, dataclasses.replace(S.TRAIN, steps=2), 0)
    with pytest.raises(ConfigError, match="data with 1000 train tokens, this run's data has 999"):
        fmt.check_data({**m, "data": {"train_tokens": 1000}}, path, "init_state", 999)


# The settings of the model and the optimizer a state does NOT pin, each with why; every other
# field of ModelConfig and OptimSettings (and the seed) must be pinned. The walk below reads the
# dataclasses, not gpt2common.state's tables, so a key dropped from those tables (or a new
# setting nobody decided on) fails it.
UNPINNED = {"train.grad_accum": "every value computes the same mean gradient",
            "model.dropout": "a training choice, not a shape (as init= takes it from the run)",
            "model.attention": "which core computes attention: the same numbers"}


def _changed(v):
    """Another valid value of the same type: int + 1, float / 2 (0 -> 0.5), str -> another core."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError(f"no rule to change {v!r}")
    if isinstance(v, str):
        return "xla" if v != "xla" else "auto"
    return v + 1 if isinstance(v, int) else (v / 2 if v else 0.5)


def test_every_setting_the_state_pins_is_refused_when_changed_once(tmp_path):
    """The table of pinned keys walked: each field of ModelConfig and OptimSettings, and the seed,
    changed alone, is refused naming both values (warmup_steps dropped from the table would let a
    continuing run follow another schedule, silently); the UNPINNED ones are accepted."""
    from gpt2common.optim import OptimSettings

    path = _write(tmp_path / "s")
    m = fmt.read_manifest(path, "init_state")
    fmt.check_compatible(m, path, "init_state", S.TINY, S.TRAIN, 0)  # unchanged: accepted
    keys = [("model", f.name) for f in dataclasses.fields(S.TINY)] + [
        ("train", f.name) for f in dataclasses.fields(OptimSettings)] + [("", "seed")]
    assert len(keys) == 8 + 12 + 1  # a new setting lands here with a decision: pinned or UNPINNED
    refused = []
    for section, name in keys:
        model, train, seed = S.TINY, S.TRAIN, 0
        if section == "model":
            old = getattr(model, name)
            model = dataclasses.replace(model, **{name: _changed(old)})
        elif section == "train":
            old = getattr(train, name)
            train = dataclasses.replace(train, **{name: _changed(old)})
        else:
            old, seed = 0, 1
        key = f"{section}.{name}" if section else name
        if key in UNPINNED:
            fmt.check_compatible(m, path, "init_state", model, train, seed)
            continue
        with pytest.raises(ConfigError) as e:
            fmt.check_compatible(m, path, "init_state", model, train, seed)
        assert str(e.value) == (f"init_state={path!r} was written with {key}={old}, this run has {key}={_changed(old)} "
                                "(the state continues only the same model, batches and schedule)"), key
        refused.append(key)
    assert len(refused) == len(keys) - len(UNPINNED) == 18

def test_bad_dirs_are_one_line_errors(tmp_path):
    path = _write(tmp_path / "s")
    with pytest.raises(ConfigError, match="already exists; a state is written into a new directory"):
        fmt.check_target(path, "to_state")
    newer = _write(tmp_path / "newer", format_version=2)
    with pytest.raises(ConfigError, match="has format_version=2, newer than this reader's 1"):
        fmt.read_manifest(newer, "init_state")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"has no manifest.json \(not a training-state dir\)"):
        fmt.read_manifest(str(tmp_path / "empty"), "init_state")
    (tmp_path / "empty" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # json recurses per level
    with pytest.raises(ConfigError) as e:
        fmt.read_manifest(str(tmp_path / "empty"), "init_state")
    assert str(e.value) == f"init_state={str(tmp_path / 'empty')!r}: manifest.json is corrupt"
    with open(os.path.join(path, fmt.OPTIMIZER_FILE), "r+b") as f:  # one flipped byte in a tensor
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ConfigError, match="optimizer.safetensors does not match its checksum"):
        fmt.load_state(path, "init_state")


def _one_error(r, *needles):
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_jaxpar_refuses_bad_states_before_any_write(tmp_path):
    state = _write(tmp_path / "s")
    out = tmp_path / "out"
    r = run(["train", *KEYS, "model.vocab_size=512", f"init_state={state}", f"out={out}"])
    # (a newer format_version or a missing manifest take the same path: test_bad_dirs_are_one_line_errors)
    _one_error(r, "model.vocab_size=256, this run has model.vocab_size=512")
    assert not out.exists()  # nothing of the run was created
    snapshot = lambda: {p: os.stat(os.path.join(state, p)).st_mtime_ns for p in os.listdir(state)}  # noqa: E731
    before = snapshot()
    r = run(["convert", f"checkpoint={tmp_path}", f"to_state={state}"])
    _one_error(r, f"to_state={state!r} already exists")
    assert snapshot() == before and len(before) == 4


def test_a_state_with_skipped_steps_continues_its_own_schedule_count(tmp_path, capsys):
    """The boundary the clean handoffs never reach: a jaxpar state written after skipped non-finite
    steps (train.skip_nonfinite=true) is at step 5 with 1 step skipped, so AdamW and the schedule
    have counted 4 updates. Continued for its last step (6 of 6) in this process, the run must go
    on from those counts (4 -> 5), not from the step (5 -> 6: another learning rate, lr(5) instead
    of lr(4) for step 6's update); `convert to_state=` of the result reads them back."""
    import json

    from jaxpar import cli
    from jaxpar.config import TrainConfig
    from jaxpar.train import lr_schedule

    state = S.write_state(tmp_path / "s", step=5, nonfinite_skipped=1,
                          optimizer={**fmt.manifest_dict(written_by="test", model=S.TINY, train=S.TRAIN, seed=0, step=5,
                                                         adam_count=4, schedule_count=4, lr_next=0.0,
                                                         data={})["optimizer"]})
    out, again = tmp_path / "out", tmp_path / "again"
    assert cli.main(["train", *KEYS, f"init_state={state}", f"out={out}"]) == 0
    assert cli.main(["convert", f"checkpoint={out}", f"to_state={again}"]) == 0
    capsys.readouterr()
    m = json.loads((again / fmt.MANIFEST).read_text())
    assert (m["step"], m["nonfinite_skipped"]) == (6, 1)
    assert (m["optimizer"]["adam_count"], m["optimizer"]["schedule_count"]) == (5, 5)
    tc = TrainConfig(**{k: getattr(S.TRAIN, k) for k in fmt.TRAIN_KEYS})
    assert m["optimizer"]["lr_next"] == float(lr_schedule(tc)(5)) != float(lr_schedule(tc)(6))
