"""torchref's bad-input paths around the training-state format (torchref/handoff.py): one `error:`
line naming the value, exit 2, out= never created. The continuation itself is proven in
parity_tests/test_state_handoff.py."""

import json
import os
import shutil

import pytest
from support import states as S

from torchref.cli import main


def _one_error(capsys, argv, *needles):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def state(tmp_path):
    return S.write_state(tmp_path / "s")


def test_bad_states_are_refused_before_out_exists(tmp_path, capsys, state):
    out = tmp_path / "out"
    base = ["train", *S.KEYS, f"out={out}"]
    _one_error(capsys, [*base, "model.vocab_size=512", f"init_state={state}"],
               "model.vocab_size=256, this run has model.vocab_size=512")
    _one_error(capsys, [*base, "model.n_layer=3", f"init_state={state}"], "model.n_layer=2, this run has model.n_layer=3")
    os.makedirs(tmp_path / "empty")
    _one_error(capsys, [*base, f"init_state={tmp_path / 'empty'}"], "has no manifest.json")
    newer = tmp_path / "newer"
    shutil.copytree(state, newer)
    m = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**m, "format_version": 2}))
    _one_error(capsys, [*base, f"init_state={newer}"], "has format_version=2, newer than this reader's 1")
    _one_error(capsys, [*base, f"init_state={state}", "strategy=single-ps", "workers=2"],
               "init_state= needs an all-reduce strategy")
    _one_error(capsys, [*base, f"init_state={state}", "train.steps=5"], "train.steps=6, this run has train.steps=5")
    end = S.write_state(tmp_path / "end", step=6)
    _one_error(capsys, [*base, f"init_state={end}"], "is at step 6: train.steps=6 leaves no step to run")
    _one_error(capsys, [*base, f"init_state={state}", f"init={state}"], "cannot be combined with init_state=")
    _one_error(capsys, [*base, "state_every=-1"], "state_every=-1 must be >= 0")
    assert not out.exists()
