"""Data: prepare (byte, bpe, GPT-2 tokenizer dir), deterministic batches, eval windows."""

import json

import numpy as np
import pytest
from support.cli_helpers import run

from gpt2common import data
from jaxpar.config import ConfigError

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 200


def test_prepare_byte_layout(tmp_path):
    meta = data.prepare(TEXT, tmp_path, "byte")
    n = len(TEXT.encode())
    shards = meta.pop("shards")
    assert meta == {"tokenizer": "byte", "vocab_size": 256, "train_tokens": n - n // 10, "val_tokens": n // 10,
                    "source": "", "documents": 1, "val_documents": 1, "eot_id": None, "dtype": "uint16",
                    "split": "tail", "val_fraction": 0.1, "seed": 0}
    assert [(s["file"], s["tokens"], s["max_id"]) for s in shards["train"] + shards["val"]] == [
        ("train.bin", n - n // 10, max(TEXT.encode())), ("val.bin", n // 10, max(TEXT.encode()))]
    train = np.fromfile(tmp_path / "train.bin", dtype="<u2")
    val = np.fromfile(tmp_path / "val.bin", dtype="<u2")
    assert np.array_equal(np.concatenate([train, val]), np.frombuffer(TEXT.encode(), np.uint8))


def test_prepare_bpe_and_gpt2_dir_round_trip(tmp_path):
    (tmp_path / "in.txt").write_text(TEXT)
    r = run(["prepare", f"input={tmp_path / 'in.txt'}", f"out={tmp_path / 'bpe'}", "tokenizer=bpe"])
    assert r.returncode == 0, r.stderr
    meta = json.loads(r.stdout)
    assert meta["tokenizer"] == "bpe" and 256 < meta["vocab_size"] <= data.BPE_VOCAB_SIZE
    tok = data.load_tokenizer(str(tmp_path / "bpe"))
    assert tok.decode(tok.encode(TEXT[:200])) == TEXT[:200]
    assert meta["train_tokens"] + meta["val_tokens"] < len(TEXT) / 4  # BPE compresses the repeated line
    # A GPT-2 style tokenizer dir (vocab.json + merges.txt) is used as is.
    tok._hf.model.save(str(tmp_path))
    d = data.make_tokenizer(str(tmp_path))
    assert d.kind == "gpt2-dir" and d.vocab_size == tok.vocab_size
    assert np.array_equal(d.encode(TEXT[:300]), tok.encode(TEXT[:300]))


def test_batches_are_pure_functions_of_seed_and_step(tmp_path):
    data.prepare(TEXT, tmp_path, "byte")
    ds = data.Dataset.open(str(tmp_path), 256, 16)
    a = data.train_batch(ds, 16, 4, seed=1, step=7)
    b = data.train_batch(ds, 16, 4, seed=1, step=7)
    c = data.train_batch(ds, 16, 4, seed=1, step=8)
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], data.train_batch(ds, 16, 4, seed=2, step=7)[0])  # the seed matters too
    assert a[0].shape == (4, 16) and a[0].dtype == np.int32
    assert np.array_equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one


def test_eval_windows_contract():
    toks = np.arange(23, dtype=np.uint16)
    x, y = data.eval_windows(toks, 5)
    assert x.shape == (4, 5)  # (23 - 1) // 5 windows
    assert x[2].tolist() == [10, 11, 12, 13, 14] and y[2].tolist() == [11, 12, 13, 14, 15]
    assert data.eval_windows(toks, 5, max_windows=2)[0].shape == (2, 5)
    with pytest.raises(ConfigError, match=r"eval data has 23 tokens, fewer than train.seq_len\+1=24"):
        data.eval_windows(toks, 23)


def _all_ids(d):
    meta = json.loads((d / "meta.json").read_text())
    return [np.fromfile(d / s["file"], "<u2").tolist() for s in meta["shards"]["train"] + meta["shards"]["val"]]


def test_folder_input_reads_txt_and_md(tmp_path):
    """Each file is a document; the byte tokenizer (no end-of-text id) separates them by a blank line."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b.md").write_text("bbb")
    (tmp_path / "in" / "a.txt").write_text("aaa")
    (tmp_path / "in" / "skip.bin").write_bytes(b"zzz")
    meta = data.prepare_input(str(tmp_path / "in"), tmp_path / "p", quiet=True)
    assert (meta["documents"], meta["val_documents"]) == (2, 1)  # no document drawn: the last is validation
    assert _all_ids(tmp_path / "p") == [list(b"aaa"), list(b"\n\nbbb")]


def test_folder_input_reads_the_files_of_its_subfolders(tmp_path):
    """Every .txt/.md file *under* the folder, sorted by path. Reference: the files."""
    (tmp_path / "in" / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "in" / "b.md").write_text("bbb")
    (tmp_path / "in" / "a.txt").write_text("aaa")
    (tmp_path / "in" / "sub" / "deeper" / "c.txt").write_text("ccc")
    (tmp_path / "in" / "sub" / "skip.json").write_text("{}")
    data.prepare_input(str(tmp_path / "in"), tmp_path / "p", quiet=True)
    assert _all_ids(tmp_path / "p") == [list(b"aaa\n\nbbb"), list(b"\n\nccc")]


def test_byte_decode_drops_ids_past_the_byte_range():
    """A model with vocab_size > 256 on byte data can sample ids >= 256: they decode to nothing."""
    assert data.Tokenizer("byte").decode([72, 105, 256, 300, 33]) == "Hi!"


def test_a_split_of_exactly_seq_len_plus_one_tokens_gives_its_one_window(tmp_path):
    """`prepare` and `Dataset.open` accept a split of seq_len+1 tokens (their error texts say
    "fewer than train.seq_len+1"); its one window starts at 0. Reference: the split itself.
    numpy's integers(0, 0) made this a ValueError traceback at the first eval."""
    toks = np.arange(17, dtype=np.uint16)
    for step in range(3):
        off = data.batch_offsets(len(toks), 16, 4, seed=0, step=step)
        assert off.tolist() == [0, 0, 0, 0]
    x, y = data.get_batch(toks, data.batch_offsets(17, 16, 2, 0, 0), 16)
    assert x.tolist() == [list(range(16))] * 2 and y.tolist() == [list(range(1, 17))] * 2
    # a longer split: every window fits (offset + seq_len + 1 <= n)
    off = data.batch_offsets(40, 16, 64, seed=3, step=5)
    assert off.min() >= 0 and off.max() + 16 + 1 <= 40


def test_prepare_and_open_accept_a_split_of_exactly_seq_len_plus_one_tokens(tmp_path):
    """170 bytes: val = 170 // 10 = 17 tokens, train 153. seq_len=16 needs 17 per split: accepted by
    prepare and Dataset.open; seq_len=17 needs 18: both refuse, naming the counts. Reference: the
    error texts' "fewer than train.seq_len+1" (a split of exactly seq_len+1 holds one window)."""
    text = bytes(range(65, 65 + 17)) * 10
    meta = data.prepare(text, tmp_path / "ok", "byte", min_tokens=17)
    assert (meta["train_tokens"], meta["val_tokens"]) == (153, 17)
    ds = data.Dataset.open(str(tmp_path / "ok"), 256, 16)
    assert (len(ds.train), len(ds.val)) == (153, 17)
    with pytest.raises(ConfigError) as e:
        data.prepare(text, tmp_path / "no", "byte", source="s", min_tokens=18)
    assert str(e.value) == "data='s' gives 170 tokens (153 train, 17 val); each split needs at least train.seq_len+1=18"
    with pytest.raises(ConfigError) as e:
        data.Dataset.open(str(tmp_path / "ok"), 256, 17)
    assert str(e.value) == f"val.bin in {str(tmp_path / 'ok')!r} has 17 tokens, fewer than train.seq_len+1=18"


def test_eval_windows_when_the_length_is_a_multiple_of_seq_len():
    """25 tokens, T=5: windows need T+1 tokens each, overlapping by one, so (25-1)//5 = 4 (a fifth
    would need token 25). Reference: hand count."""
    x, y = data.eval_windows(np.arange(25, dtype=np.uint16), 5)
    assert x.shape == (4, 5) and y[-1].tolist() == [16, 17, 18, 19, 20]


def test_a_meta_json_whose_vocab_size_is_not_an_integer_is_corrupt(tmp_path):
    """meta.json is written by `prepare` with an integer vocab_size; a hand-edited "300" (or a JSON
    list) is the one-line corrupt error, not a TypeError traceback at the vocab comparison."""
    meta = data.prepare(TEXT, tmp_path, "byte")
    assert data.read_meta(str(tmp_path), 256) == meta
    deep = "[" * 100_000 + "]" * 100_000  # json recurses per level: a RecursionError traceback
    for doc in (json.dumps({**meta, "vocab_size": "300"}), json.dumps({**meta, "vocab_size": 256.0}),
                json.dumps([meta]), deep):
        (tmp_path / "meta.json").write_text(doc)
        with pytest.raises(ConfigError) as e:
            data.read_meta(str(tmp_path), 256)
        assert str(e.value) == f"data={str(tmp_path)!r}: meta.json is missing or corrupt"


def test_a_prepared_vocab_larger_than_the_preset_sets_model_vocab_size(tmp_path, capsys):
    """model=gpt2-tiny (vocab 256) on a prepared BPE dir of a larger vocab: the model takes it and
    says so on stderr; a model.vocab_size the user names is kept, and a smaller
    prepared vocab changes nothing."""
    from jaxpar.run.rundir import resolve_train

    text = "hello world, this is some text for a bpe tokenizer. " * 300
    big, small = str(tmp_path / "bpe"), str(tmp_path / "byte")
    data.prepare(text, big, "bpe")  # a tokenizer trained on the text: its vocab is what it learned
    data.prepare(text[:2000], small, "byte")
    vocab = data.read_meta(big)["vocab_size"]
    assert vocab > 256
    cfg = resolve_train({"model": "gpt2-tiny", "data": big}, None, writer=False)
    assert cfg.model.vocab_size == vocab
    assert capsys.readouterr().err == (f"model.vocab_size={vocab}: the vocab of data={big!r} (the gpt2-tiny preset "
                                       f"has 256)\n")
    assert resolve_train({"model": "gpt2-tiny", "data": small}, None, writer=False).model.vocab_size == 256
    named = resolve_train({"model": "gpt2-tiny", "data": big, "model.vocab_size": "256"}, None, writer=False)
    assert named.model.vocab_size == 256  # refused later, when the data is read, naming both numbers
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"^model\.vocab_size=0 must be positive$"):
        resolve_train({"model": "gpt2-tiny", "data": big, "model.vocab_size": "0"}, None, writer=False)


def test_check_data_reads_nothing_and_accepts_what_resolve_data_would_reuse(tmp_path):
    """`jaxpar launch` checks data= once with check_data: the same refusals as resolve_data, and
    a raw source that is gone passes when the run dir holds data prepared from it (a resume)."""
    src = tmp_path / "corpus.txt"
    src.write_text("hello world " * 200)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^data='.*none.txt' does not exist$"):
        data.check_data(str(tmp_path / "none.txt"), "byte", str(run))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^data='.*half' has meta.json but no train.bin$"):
        data.check_data(str(tmp_path / "half"), "byte", str(run))
    data.check_data("", "byte", str(run))  # the built-in corpus
    assert data.resolve_data(str(src), "byte", str(run), seq_len=16) == str(run / "data")
    src.unlink()
    data.check_data(str(src), "byte", str(run))  # reused by resolve_data: nothing to read
    with pytest.raises(ConfigError, match=r"does not exist$"):
        data.check_data(str(src), "bpe", str(run))  # another tokenizer: prepared again from the source
