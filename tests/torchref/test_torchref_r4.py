"""Nothing lost, round 4, torchref's side: a restart never removes a killed run's
states, and a start refused before any worker leaves nothing of an out it created. In-process,
no training. Independent reference: file trees and messages written down by hand here."""

from __future__ import annotations

import os

import pytest
from support import states as S

from gpt2common.grammar import ConfigError
from torchref.cli import main
from torchref.launch import check_out


def tree(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


def test_a_killed_runs_states_are_never_removed_by_the_next_run(tmp_path, capsys):
    """A killed `state_every=2` run left state/2 and state/4 (its only checkpoints) and no
    summary.json: a restart into that out removed them, init_state=<out>/state/4 out=<out> too."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for step in (2, 4):
        S.write_state(out / "state" / str(step), step=step)
    before = tree(out)
    msg = (f"out={str(out)!r} holds the training states of an unfinished torchref run (state/2, state/4); "
           "continue one with init_state=<that dir> and another out, or choose another out")
    with pytest.raises(ConfigError) as e:
        check_out(out)
    assert str(e.value) == msg
    for extra in ([], [f"init_state={out / 'state' / '4'}"]):
        assert main(["train", *S.KEYS, *extra, f"out={out}"]) == 2
        assert capsys.readouterr().err == f"error: {msg}\n"
    assert tree(out) == before


def test_a_damaged_state_leaves_no_out_behind(tmp_path, capsys):
    """init_state= with a damaged tensor file: refused before out is created (the out kept a data/)."""
    state, out = S.write_state(tmp_path / "s"), tmp_path / "new" / "out"
    with open(os.path.join(state, "model.safetensors"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    (tmp_path / "text.txt").write_text("some text to train on. " * 100)
    assert main(["train", *S.KEYS, f"data={tmp_path / 'text.txt'}", f"init_state={state}", f"out={out}"]) == 2
    assert capsys.readouterr().err == (f"error: init_state={state!r}: model.safetensors does not match its checksum "
                                       "in manifest.json (damaged or replaced)\n")
    assert not (tmp_path / "new").exists()


def test_a_start_refused_in_prepare_removes_what_it_created(tmp_path, monkeypatch, capsys):
    """Any refusal after out is held and before the workers start (prepare tokenized data/ first):
    the entries go while the lock is held, then out and the parents this run made."""
    from torchref import launch

    def prepare(cfg, ref):
        os.makedirs(os.path.join(cfg.out, "data"))
        open(os.path.join(cfg.out, "data", "train.bin"), "wb").close()
        raise ConfigError("refused late")

    monkeypatch.setattr(launch, "prepare", prepare)
    out = tmp_path / "a" / "out"
    assert main(["train", "model=gpt2-tiny", "strategy=single", f"out={out}"]) == 2
    assert capsys.readouterr().err == "error: refused late\n"
    assert os.listdir(tmp_path) == []


def test_an_interrupted_torchref_process_leaves_with_130_without_teardown(monkeypatch, capsys):
    """Ctrl-C: exit 130 by os._exit when torchref is the process (argv None), not a teardown under
    torch's threads; a call from Python still returns 130."""
    from torchref import launch

    class Exited(Exception):
        pass

    def train(cfg, ref, on_start=None):
        raise KeyboardInterrupt

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(launch, "train", train)
    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr("sys.argv", ["torchref", "train", "model=gpt2-tiny", "strategy=single"])
    with pytest.raises(Exited) as e:
        main()
    assert e.value.args == (130,) and capsys.readouterr().err == "error: interrupted\n"
    assert main(["train", "model=gpt2-tiny", "strategy=single"]) == 130
