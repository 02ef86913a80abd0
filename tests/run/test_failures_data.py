"""Failure paths of the data (in-process): non-UTF-8 input, token ids past the vocab, too little
text (checked before anything is written), a changed `data=` in a reused run dir.

Independent reference: the input bytes themselves and hand-written messages."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpt2common import data
from jaxpar.config import ConfigError

LATIN1 = ("Ça coûte très cher, señor. Åse og Øystein. " * 1000).encode("latin-1")


def test_byte_tokenizer_takes_latin1_bytes_as_they_are(tmp_path):
    src = tmp_path / "latin1.txt"
    src.write_bytes(LATIN1)
    prepared = data.resolve_data(str(src), "byte", str(tmp_path / "run"), seq_len=16, model_vocab=256)
    ids = np.concatenate([np.fromfile(f"{prepared}/{n}", "<u2") for n in ("train.bin", "val.bin")])
    assert len(ids) == len(LATIN1)  # not 1 token per byte + replacement characters
    assert bytes(ids.astype(np.uint8)) == LATIN1


def test_bpe_on_non_utf8_input_warns_with_the_count(tmp_path, capsys):
    src = tmp_path / "latin1.txt"
    src.write_bytes(LATIN1[:4000])
    data.prepare_input(str(src), tmp_path / "bpe", "bpe", quiet=True)
    bad = LATIN1[:4000].decode("utf-8", errors="replace").count("\ufffd")
    assert bad > 0
    assert capsys.readouterr().err == (f"warning: input file {str(src)!r} is not valid UTF-8 ({bad} undecodable "
                                       "sequences replaced by U+FFFD); tokenizer=byte would keep the raw bytes\n")


def test_token_ids_past_the_vocab_are_refused(tmp_path):
    data.prepare("hello world " * 100, tmp_path, "byte")
    train = np.fromfile(tmp_path / "train.bin", "<u2")
    train[17] = 300
    train.tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError) as e:
        data.Dataset.open(str(tmp_path), 300, 16)
    assert str(e.value) == f"train.bin in {str(tmp_path)!r} holds token id 300 >= model.vocab_size=300"
    assert data.Dataset.open(str(tmp_path), 301, 16).vocab_size == 256


def test_too_little_text_is_refused_before_anything_is_written(tmp_path):
    src = tmp_path / "tiny.txt"
    run = tmp_path / "run"
    for n, split in ((10, "9 train, 1 val"), (100, "90 train, 10 val")):  # the 90/10 split: val runs short first
        src.write_bytes(b"0123456789" * (n // 10))
        with pytest.raises(ConfigError) as e:
            data.resolve_data(str(src), "byte", str(run), seq_len=16)
        assert str(e.value) == (f"data={str(src)!r} gives {n} tokens ({split}); each split needs at least "
                                "train.seq_len+1=17")
        assert not run.exists()


def test_a_changed_data_source_is_prepared_again(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("a" * 1000)
    b.write_text("b" * 1000)
    run = str(tmp_path / "run")
    d = data.resolve_data(str(a), "byte", run, seq_len=8)
    mtime = (tmp_path / "run" / "data" / "train.bin").stat().st_mtime_ns
    assert data.resolve_data(str(a), "byte", run, seq_len=8) == d  # same source: reused as is
    assert (tmp_path / "run" / "data" / "train.bin").stat().st_mtime_ns == mtime
    data.resolve_data(str(b), "byte", run, seq_len=8)
    assert set(np.fromfile(f"{d}/train.bin", "<u2").tolist()) == {ord("b")}
    assert json.loads((tmp_path / "run" / "data" / "meta.json").read_text())["source"] == str(b)


def test_data_prepared_with_another_tokenizer_is_prepared_again(tmp_path):
    """Same source, other tokenizer: another token stream, so `<run>/data` is rewritten, never
    reused. Reference: the byte tokenizer's ids are the text's bytes; meta.json names the kind."""
    src = tmp_path / "a.txt"
    src.write_text("to be or not to be, that is the question. " * 40)
    run = str(tmp_path / "run")
    d = data.resolve_data(str(src), "bpe", run, seq_len=8)
    assert json.loads((tmp_path / "run" / "data" / "meta.json").read_text())["tokenizer"] == "bpe"
    assert data.resolve_data(str(src), "byte", run, seq_len=8) == d
    assert json.loads((tmp_path / "run" / "data" / "meta.json").read_text())["tokenizer"] == "byte"
    ids = np.concatenate([np.fromfile(f"{d}/train.bin", "<u2"), np.fromfile(f"{d}/val.bin", "<u2")])
    assert ids.tolist() == list(src.read_bytes())
