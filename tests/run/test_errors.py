"""Bad input: exit 2, one line `error: ...` naming the values, no traceback, nothing written."""

import os

import pytest
from support.cli_helpers import run


def err(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize("args,msg", [
    (["train.stepz=3"], "error: unknown key 'train.stepz' (valid: train.steps, train.batch_size"),
    (["foo=1"], "error: unknown key 'foo'"),
    (["mesh.foo=2"], "error: unknown key 'mesh.foo' (valid: mesh.data, mesh.fsdp, mesh.tensor, mesh.pipe)"),
    (["model=gpt3"], "error: model='gpt3' is not a preset (choose from gpt2-tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl)"),
    (["train.steps=ten"], "error: train.steps='ten' is not an integer"),
    (["train.lr=fast"], "error: train.lr='fast' is not a number"),
    (["resume=maybe"], "error: resume='maybe' is not a boolean (true/false)"),
    (["precision=fp8"], "error: precision='fp8' must be one of bf16, fp32"),
    (["model=gpt2-tiny", "train.seq_len=512"], "error: train.seq_len=512 exceeds model.n_positions=256"),
    (["model=gpt2-tiny", "model.n_head=3"], "error: model.n_embd=128 is not divisible by model.n_head=3"),
    (["model=gpt2-tiny", "train.batch_size=6", "train.grad_accum=4"],
     "error: train.batch_size=6 is not divisible by train.grad_accum=4"),
    (["train.steps"], "error: argument 'train.steps' is not key=value"),
])
def test_invalid_keys_and_values(args, msg, tmp_path):
    line = err(run(["train", *args, f"out={tmp_path / 'o'}"]))
    assert line.startswith(msg), line
    assert not (tmp_path / "o").exists()


def test_unknown_command():
    assert err(run(["trian"])).startswith("error: unknown command 'trian' (choose from train,")


def test_missing_data_file(tmp_path):
    line = err(run(["train", "model=gpt2-tiny", f"data={tmp_path / 'nope.txt'}", f"out={tmp_path / 'o'}"]))
    assert line == f"error: data={str(tmp_path / 'nope.txt')!r} does not exist"  # the key typed, not prepare's input=
    assert not (tmp_path / "o").exists()  # a start that fails before its first step leaves no dir behind


def test_a_start_that_fails_before_its_first_step_leaves_no_directory(tmp_path):
    """The vocab check fails after the run dir (and its missing parents) was made: all of it goes,
    and an existing parent stays."""
    out = tmp_path / "a" / "b" / "run"
    line = err(run(["train", "model=gpt2-tiny", "model.vocab_size=100", "train.seq_len=8", f"out={out}"]))
    assert line == ("error: data vocab_size=256 is larger than model.vocab_size=100 (tokenizer=byte): give "
                    "model.vocab_size=256, or prepare the text first (jaxpar prepare), whose vocab a run then takes")
    assert sorted(os.listdir(tmp_path)) == []


def test_corrupt_data_file(tmp_path):
    d = tmp_path / "prep"
    assert run(["prepare", "input=" + str(_text(tmp_path)), f"out={d}"]).returncode == 0
    (d / "train.bin").write_bytes(b"\x01\x02\x03")
    line = err(run(["train", "model=gpt2-tiny", "train.seq_len=8", f"data={d}", f"out={tmp_path / 'o'}"]))
    assert line == f"error: data file {str(d / 'train.bin')!r} is corrupt (odd size 3 bytes; expected uint16 tokens)"
    (d / "meta.json").write_text("{not json")
    line = err(run(["train", "model=gpt2-tiny", f"data={d}", f"out={tmp_path / 'o2'}"]))
    assert line == f"error: data={str(d)!r}: meta.json is missing or corrupt"


def _text(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return p


def test_vocab_larger_than_model(tmp_path):
    d = tmp_path / "bpe"
    r = run(["prepare", f"input={_text(tmp_path)}", f"out={d}", "tokenizer=bpe"])
    assert r.returncode == 0, r.stderr
    line = err(run(["train", "model=gpt2-tiny", "model.vocab_size=64", "train.seq_len=8", f"data={d}",
                    f"out={tmp_path / 'o'}"]))
    assert line.startswith("error: data vocab_size=") and line.endswith("is larger than model.vocab_size=64")


def test_missing_checkpoint(tmp_path):
    assert err(run(["eval", f"checkpoint={tmp_path}", f"data={tmp_path}"])) == \
        f"error: checkpoint={str(tmp_path)!r} has no config.json (not a jaxpar run dir)"
    assert err(run(["train", "model=gpt2-tiny", f"out={tmp_path / 'none'}", "resume=true"])) == \
        f"error: resume=true but out={str(tmp_path / 'none')!r} does not exist"
    assert err(run(["sample", f"checkpoint={tmp_path / 'none'}"])) == \
        f"error: checkpoint={str(tmp_path / 'none')!r} has no config.json (not a jaxpar run dir)"


def test_nonempty_out_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    line = err(run(["train", "model=gpt2-tiny", f"out={out}"]))
    assert line == f"error: out={str(out)!r} is not empty; pass resume=true to continue it or choose another out"
    assert [p.name for p in out.iterdir()] == ["precious.txt"] and (out / "precious.txt").read_text() == "keep me"


def test_bad_yaml_config(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  steps: 5\n  bogus: 1\n")
    assert err(run(["train", "--config", str(y)])).startswith("error: unknown key 'train.bogus'")
    assert err(run(["train", "--config", str(tmp_path / "missing.yaml")])) == \
        f"error: config file {str(tmp_path / 'missing.yaml')!r} does not exist"


def test_prepare_refuses_text_too_short_for_two_splits(tmp_path):
    """An input that leaves a split without one window of seq_len 1 (2 tokens) is refused before
    anything is written: 1 byte gave an empty train.bin, and the first run on it stopped there."""
    src = tmp_path / "one.txt"
    for text, split in ((b"a", "0 train, 1 val"), (b"abc", "2 train, 1 val")):
        src.write_bytes(text)
        r = run(["prepare", f"input={src}", f"out={tmp_path / 'prep'}"])
        assert r.returncode == 2
        assert err(r) == (f"error: input={str(src)!r} gives {len(text)} tokens ({split}); each split needs at least "
                          "2 tokens")
        assert not (tmp_path / "prep").exists()
    src.write_bytes(b"abcdefghijklmnopqrst")  # 18 train, 2 val: the least that splits
    assert run(["prepare", f"input={src}", f"out={tmp_path / 'prep'}"]).returncode == 0
    assert (tmp_path / "prep" / "val.bin").stat().st_size == 2 * 2


def test_prepare_refuses_a_prepared_dir(tmp_path):
    """A second prepare into the same out= (a run may be training from it) is refused and rewrites nothing."""
    d = tmp_path / "prep"
    assert run(["prepare", "input=" + str(_text(tmp_path)), f"out={d}"]).returncode == 0
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    other = tmp_path / "other.txt"
    other.write_text("a different corpus entirely. " * 300)
    r = run(["prepare", f"input={other}", f"out={d}"])
    assert r.returncode == 2
    assert err(r) == (f"error: out={str(d)!r} already holds prepared data (meta.json, train.bin, val.bin); "
                      "choose a new out= or delete it first")
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before


def test_an_hf_dir_error_names_the_key_it_was_given_by(tmp_path, capsys):
    """init= (train), hf= (eval, convert): the path is named with its key, as the user typed it."""
    from jaxpar import cli

    nope = str(tmp_path / "nope")
    line = err(run(["train", "model=gpt2-tiny", f"init={nope}", f"out={tmp_path / 'o'}"]))
    assert line == f"error: init={nope!r} is not an HF save_pretrained dir (no config.json)"
    assert not (tmp_path / "o").exists()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, '
                                                  '"vocab_size": 16, "n_positions": 8}')
    bad = str(tmp_path / "bad")
    for argv, want in ((["convert", f"hf={nope}", f"out={tmp_path / 'r'}"],
                        f"hf={nope!r} is not an HF save_pretrained dir (no config.json)"),
                       (["eval", f"hf={bad}", f"data={tmp_path / 'x.bin'}"], f"hf={bad!r} has no model.safetensors")):
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == f"error: {want}\n"
