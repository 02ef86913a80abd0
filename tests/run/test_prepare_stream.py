"""`jaxpar prepare` streamed: documents, end-of-text ids, validation by documents, shards, workers,
continuing an interrupted prepare, every input format, and the one-line refusals of bad input.
Reference everywhere: the tokenizer's own `encode` of each document, whole."""

import gzip
import json
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.cli_helpers import run

from gpt2common import data
from gpt2common import prepare as pp
from gpt2common.grammar import ConfigError
from gpt2common.segment import segments

WORDS = ["the", "King", "said", "über", "42", "3.14", "naïve", "—", "can't", "  ", "\n", "\t", "<|endoftext|>"]


def _docs(n=120, seed=0):
    r = random.Random(seed)
    words = WORDS[:-1]  # a literal <|endoftext|> in a document is that id: kept out of the documents
    return [" ".join(r.choice(words) for _ in range(r.randint(0, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL corpus of 120 documents (one empty at least) and a BPE with <|endoftext|> trained on it."""
    d = tmp_path_factory.mktemp("corpus")
    docs = _docs()
    docs[5] = ""
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(docs)))
    tok = data.train_bpe(iter(docs))
    tok.hf_tokenizer().save(str(d / "tok.json"))
    return d, docs, tok.hf_tokenizer()


def _split_ids(out, split):
    meta = json.loads((out / "meta.json").read_text())
    dt = "<u4" if meta["dtype"] == "uint32" else "<u2"
    return np.concatenate([np.fromfile(out / s["file"], dt) for s in meta["shards"][split]]).tolist()


def _by_docs(ids, eot):
    docs, cur = [], []
    for i in ids:
        cur.append(i)
        if i == eot:
            docs.append(cur)
            cur = []
    assert cur == []
    return docs


def test_each_document_is_its_ids_then_one_end_of_text_and_validation_is_by_documents(corpus, tmp_path):
    d, docs, hf = corpus
    meta = data.prepare_input(str(d / "c.jsonl"), tmp_path / "p", str(d / "tok.json"), val_fraction=0.1, seed=3,
                              shard_tokens=500, quiet=True)
    eot = hf.token_to_id("<|endoftext|>")
    want = [hf.encode(t, add_special_tokens=False).ids + [eot] for t in docs]
    is_val = [pp.is_val(3, i, 0.1) for i in range(len(docs))]
    assert _by_docs(_split_ids(tmp_path / "p", "train"), eot) == [w for w, v in zip(want, is_val) if not v]
    assert _by_docs(_split_ids(tmp_path / "p", "val"), eot) == [w for w, v in zip(want, is_val) if v]
    assert (meta["documents"], meta["val_documents"], meta["eot_id"]) == (120, sum(is_val), eot)
    assert 0 < sum(is_val) < 30
    assert meta["train_tokens"] + meta["val_tokens"] == sum(map(len, want))
    tr = meta["shards"]["train"]
    assert len(tr) > 3 and all(s["tokens"] >= 500 for s in tr[:-1])  # a shard closes at the first document end past 500
    assert [s["file"] for s in tr[:3]] == ["train.bin", "train.1.bin", "train.2.bin"]
    ds = data.Dataset.open(str(tmp_path / "p"), hf.get_vocab_size(), 16)
    assert len(ds.train) == meta["train_tokens"]
    # the sharded split reads as the concatenation: a batch equals the one drawn from one array
    flat = np.asarray(_split_ids(tmp_path / "p", "train"), np.uint16)
    for step in range(3):
        a = data.train_batch(ds, 16, 8, seed=1, step=step)
        b = data.get_batch(flat, data.batch_offsets(len(flat), 16, 8, 1, step), 16)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_workers_and_an_interrupted_prepare_give_the_same_bytes(corpus, tmp_path, monkeypatch):
    d, _, _ = corpus
    args = [f"input={d / 'c.jsonl'}", f"tokenizer={d / 'tok.json'}", "shard_tokens=400", "val_fraction=0.05"]
    for w in (1, 2):
        r = run(["prepare", f"out={tmp_path / f'w{w}'}", f"workers={w}", *args])
        assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "w2").iterdir()) and "train.3.bin" in files
    assert all((tmp_path / "w1" / f).read_bytes() == (tmp_path / "w2" / f).read_bytes() for f in files)
    # killed after its third shard: no meta.json (nothing a run accepts); the same call continues
    closes, real = [], pp._Shards.close

    def dies(self):
        real(self)
        closes.append(self.split)
        if len(closes) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(pp._Shards, "close", dies)
    kw = dict(tokenizer=str(d / "tok.json"), shard_tokens=400, val_fraction=0.05, quiet=True)
    with pytest.raises(KeyboardInterrupt):
        data.prepare_input(str(d / "c.jsonl"), tmp_path / "k", **kw)
    assert not (tmp_path / "k" / "meta.json").exists() and (tmp_path / "k" / pp.PROGRESS).exists()
    assert not data.is_prepared(str(tmp_path / "k"))
    with pytest.raises(ConfigError) as e:  # nothing a run takes
        data.resolve_data(str(tmp_path / "k"), "byte", str(tmp_path / "run"))
    assert str(e.value) == (f"data={str(tmp_path / 'k')!r} is an unfinished prepare (no meta.json yet): run the same "
                            "jaxpar prepare again to finish it")
    monkeypatch.setattr(pp._Shards, "close", real)
    with pytest.raises(ConfigError) as e:  # other settings: refused, nothing touched
        data.prepare_input(str(d / "c.jsonl"), tmp_path / "k", **{**kw, "shard_tokens": 401})
    assert str(e.value) == (f"out={str(tmp_path / 'k')!r} holds an unfinished prepare with other settings "
                            "(shard_tokens); run the same command again, or choose a new out=")
    data.prepare_input(str(d / "c.jsonl"), tmp_path / "k", **kw)
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == files
    assert all((tmp_path / "k" / f).read_bytes() == (tmp_path / "w1" / f).read_bytes() for f in files)


def test_every_input_format_gives_the_same_documents(corpus, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d, docs, _ = corpus
    docs = docs[:40]
    table = pa.table({"body": docs})
    (tmp_path / "in").mkdir()
    pq.write_table(table.slice(0, 25), tmp_path / "in" / "a.parquet", row_group_size=7)
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in docs[25:32])
    import zstandard

    (tmp_path / "in" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"body": t}) + "\n" for t in docs[32:]).encode()))
    kw = dict(tokenizer=str(d / "tok.json"), text_key="body", quiet=True)
    ref = data.prepare_input(str(tmp_path / "in"), tmp_path / "folder", **kw)
    assert ref["documents"] == 40
    # the same rows as a saved HF dataset (Arrow stream files + state.json, as datasets writes them)
    saved = tmp_path / "saved"
    saved.mkdir()
    for i, (a, b) in enumerate(((0, 20), (20, 40))):
        with pa.OSFile(str(saved / f"data-{i:05d}-of-00002.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(pa.table({"body": docs[a:b]}))
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-{i:05d}-of-00002.arrow"}
                                                                  for i in range(2)]}))
    data.prepare_input(str(saved), tmp_path / "hf", **kw)
    # and by name from the local HF hub cache (offline): a snapshot holding the folder's files
    snap = tmp_path / "home" / "hub" / "datasets--me--tiny" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in (tmp_path / "in").iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "home" / "hub"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "home" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data.prepare_input("me/tiny", tmp_path / "cache", **kw)
    # and from the `datasets` library's Arrow cache (load_dataset's), when the hub has no snapshot
    arrow = tmp_path / "dscache" / "me___arrowset" / "default" / "0.0.0" / "abc"
    arrow.mkdir(parents=True)
    for i in range(2):
        (arrow / f"arrowset-train-0000{i}-of-00002.arrow").write_bytes(
            (saved / f"data-{i:05d}-of-00002.arrow").read_bytes())
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "dscache"))
    data.prepare_input("me/arrowset", tmp_path / "dscached", **kw)
    glob = data.prepare_input(f"{tmp_path / 'in'}/*.parquet,{tmp_path / 'in'}/*.jsonl.*", tmp_path / "glob", **kw)
    assert glob["documents"] == 40
    for other in ("hf", "cache", "dscached", "glob"):
        for split in ("train", "val"):
            assert _split_ids(tmp_path / other, split) == _split_ids(tmp_path / "folder", split), (other, split)


@settings(max_examples=60, deadline=None)
@example(text="a" * 300 + " " * 200 + "b\n\n  c" * 40, seg=64)
@example(text="x<|endoftext|>y " * 50, seg=32)
@given(text=st.lists(st.sampled_from(WORDS + [" ", "  ", "é", "1", "!!", "aaaaaaaaaaaaaaaa"]), max_size=400).map("".join),
       seg=st.integers(16, 300))
def test_a_document_cut_into_segments_has_the_ids_of_the_whole(corpus, text, seg):
    """`segments` (cuts where the tokenizer never merges across) against encoding the text whole."""
    _, _, hf = corpus
    pieces = [text[i:i + 37] for i in range(0, len(text), 37)]
    parts = list(segments(iter(pieces), hf, seg_chars=seg, warn=lambda m: None))
    assert "".join(parts) == text
    ids = [i for p in parts for i in hf.encode(p, add_special_tokens=False).ids]
    assert ids == hf.encode(text, add_special_tokens=False).ids


def test_a_long_line_is_cut_and_the_ids_are_those_of_the_whole(corpus, tmp_path, capsys):
    d, docs, hf = corpus
    text = " ".join(docs).replace("\n", " ")  # one line, no newline anywhere
    (tmp_path / "one.txt").write_text(text)
    meta = data.prepare_input(str(tmp_path / "one.txt"), tmp_path / "p", str(d / "tok.json"), seg_chars=500)
    ids = hf.encode(text, add_special_tokens=False).ids + [hf.token_to_id("<|endoftext|>")]
    n_val = max(int(len(ids) * 0.1), 1)  # one document: the tail split, and it says so
    assert _split_ids(tmp_path / "p", "train") + _split_ids(tmp_path / "p", "val") == ids
    assert (meta["train_tokens"], meta["val_tokens"], meta["split"]) == (len(ids) - n_val, n_val, "tail")
    err = capsys.readouterr().err
    assert f"prepare: one document: validation is its last 10% of tokens ({n_val:,} of {len(ids):,})\n" in err
    assert "prepared: " in err.splitlines()[-1] and f"{len(ids):,} tokens" in err.splitlines()[-1]


def _refused(args, tmp_path):
    r = run(["prepare", f"out={tmp_path / 'o'}", *args])
    assert (r.returncode, r.stdout) == (2, "")
    assert not (tmp_path / "o").exists()  # nothing written
    return r.stderr


def test_bad_input_is_one_line_and_nothing_is_written(corpus, tmp_path):
    d, _, _ = corpus
    j = tmp_path / "x.jsonl"
    j.write_text('{"text": "a"}\n{"body": "b"}\n')
    assert _refused([f"input={j}"], tmp_path) == f"error: {j}:2: no field text_key='text'\n"
    j.write_text('{"text": "a"}\n{"text": "b"\n')
    assert _refused([f"input={j}"], tmp_path) == f"error: {j}:2: not a JSON object\n"
    j.write_text('{"text": "a"}\n{"text": 7}\n')
    assert _refused([f"input={j}"], tmp_path) == f"error: {j}:2: field 'text' is int, not a string\n"
    g = tmp_path / "x.jsonl.gz"
    g.write_bytes(gzip.compress(b'{"text": "a"}\n' * 50)[:-12])
    assert _refused([f"input={g}"], tmp_path).startswith(f"error: input file {str(g)!r} is corrupt or unreadable (")
    pq_ = tmp_path / "x.parquet"
    pq_.write_bytes(b"PAR1 not really")
    assert _refused([f"input={pq_}"], tmp_path).startswith(f"error: input file {str(pq_)!r} is corrupt or unreadable (")
    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("fine text " * 10)
    (folder / "b.txt").symlink_to(folder / "sub")  # a "file" that cannot be read
    assert _refused([f"input={folder}"], tmp_path) == (f"error: input file {str(folder / 'b.txt')!r} cannot be read "
                                                       "(Is a directory)\n")
    e = tmp_path / "e.jsonl"
    e.write_text("\n\n")
    assert _refused([f"input={e}"], tmp_path) == f"error: input={str(e)!r} holds no documents\n"
    assert _refused(["input=me/absent"], tmp_path).startswith(
        "error: input='me/absent' does not exist, nor is it a dataset in the local HF cache (")
    assert _refused(["input=", "workers=-1"], tmp_path) == "error: workers=-1 must be >= 0 (0: the cores this process may use)\n"
    assert _refused(["val_fraction=1"], tmp_path) == "error: val_fraction=1.0 must be in (0, 1)\n"


def test_a_fine_tune_tokenizes_with_the_tokenizer_its_init_dir_ships(corpus, tmp_path):
    """`train init=EXPORT data=text.txt`: the export's tokenizer.json (jaxpar's own export format),
    not the byte default, in jaxpar and torchref; tokenizer= given keeps its value."""
    from gpt2common import hf, hf_tokenizer
    from gpt2common.init import init_params
    from gpt2common.model import ModelConfig
    from jaxpar.run.rundir import resolve_train

    _, docs, hfk = corpus
    tok = data.Tokenizer("bpe", hfk)
    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=tok.vocab_size, n_positions=32)
    export = tmp_path / "export"
    hf.save_hf(str(export), mc, init_params(mc, seed=0))
    hf_tokenizer.save_tokenizer(str(export), tok, mc.n_positions)
    text = "\n".join(docs)
    (tmp_path / "t.txt").write_text(text)
    cfg = resolve_train({"init": str(export), "data": str(tmp_path / "t.txt"), "out": str(tmp_path / "run")}, None,
                        writer=False)
    assert cfg.tokenizer == str(export)
    from torchref.config import resolve_ref

    assert resolve_ref([f"init={export}", f"data={tmp_path / 't.txt'}", "strategy=single"])[0].tokenizer == str(export)
    d = data.resolve_data(cfg.data, cfg.tokenizer, cfg.out, 8, cfg.model.vocab_size)
    ids = _split_ids(tmp_path / "run" / "data", "train") + _split_ids(tmp_path / "run" / "data", "val")
    assert ids == hfk.encode(text, add_special_tokens=False).ids + [hfk.token_to_id("<|endoftext|>")]
    assert data.read_meta(d)["vocab_size"] == tok.vocab_size
    given = resolve_train({"init": str(export), "data": str(tmp_path / "t.txt"), "tokenizer": "byte",
                           "out": str(tmp_path / "r2")}, None, writer=False)
    assert given.tokenizer == "byte"
    bare = tmp_path / "bare"  # weights only: the byte default stays
    hf.save_hf(str(bare), mc, init_params(mc, seed=0))
    assert resolve_train({"init": str(bare), "out": str(tmp_path / "r3")}, None, writer=False).tokenizer == "byte"


def test_a_mixture_draws_rows_in_its_weights_from_seed_and_step(tmp_path):
    """data=a:3,b:1: rows come from a about 3/4 of the time; each batch is a pure function of
    (seed, step); the refusals are one line each."""
    for name, byte in (("a", b"a"), ("b", b"b")):
        (tmp_path / f"{name}.txt").write_bytes(byte * 5000)
        data.prepare_input(str(tmp_path / f"{name}.txt"), tmp_path / name, quiet=True)
    spec = f"{tmp_path / 'a'}:3,{tmp_path / 'b'}:1"
    assert data.resolve_data(spec, "byte", str(tmp_path / "run")) == spec  # read in place
    ds = data.Dataset.open(spec, 256, 8)
    rows = np.concatenate([data.train_batch(ds, 8, 64, seed=0, step=s)[0][:, 0] for s in range(50)])
    share = float(np.mean(rows == ord("a")))
    assert set(rows.tolist()) == {ord("a"), ord("b")} and abs(share - 0.75) < 0.05  # 3200 rows: sd 0.008
    x1, y1 = data.train_batch(ds, 8, 16, seed=4, step=9)
    x2, y2 = data.train_batch(data.Dataset.open(spec, 256, 8), 8, 16, seed=4, step=9)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert not np.array_equal(x1, data.train_batch(ds, 8, 16, seed=5, step=9)[0])
    assert np.array_equal(data.val_batch(ds, 8, 16, 0, 0)[0][:, 1:], data.val_batch(ds, 8, 16, 0, 0)[1][:, :-1])
    for w in ("0", "-1", "x", "inf"):
        zero = f"{tmp_path / 'a'}:{w},{tmp_path / 'b'}:1"
        with pytest.raises(ConfigError) as e:
            data.Dataset.open(zero, 256, 8)
        assert str(e.value) == f"data={zero!r}: the weight {w!r} of {str(tmp_path / 'a')!r} is not a positive number"
    (tmp_path / "c.txt").write_text("some text " * 500)
    data.prepare_input(str(tmp_path / "c.txt"), tmp_path / "c", "bpe", quiet=True)
    bad = f"{tmp_path / 'a'}:1,{tmp_path / 'c'}:1"
    with pytest.raises(ConfigError) as e:
        data.resolve_data(bad, "byte", str(tmp_path / "run"))
    vocab = data.read_meta(str(tmp_path / "c"))["vocab_size"]
    assert str(e.value) == (f"data={bad!r}: {str(tmp_path / 'a')!r} and {str(tmp_path / 'c')!r} were prepared with "
                            f"different tokenizers (byte/256 and bpe/{vocab}); a mixture needs one tokenizer")


def test_a_tokenizer_by_hub_name_comes_from_the_local_cache_only(corpus, tmp_path, monkeypatch):
    d, docs, hfk = corpus
    snap = tmp_path / "hub" / "models--me--tok" / "snapshots" / ("1" * 40)
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_bytes((d / "tok.json").read_bytes())
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("1" * 40)
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import: both, as test_hf_format does
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = data.make_tokenizer("me/tok")
    assert tok.encode(docs[0]).tolist() == hfk.encode(docs[0]).ids
    with pytest.raises(ConfigError) as e:
        data.make_tokenizer("me/absent")
    assert str(e.value) == ("tokenizer='me/absent' must be byte, bpe, a tokenizer dir (tokenizer.json, or vocab.json "
                            f"+ merges.txt), a tokenizer.json, or a hub name in the local HF cache ({tmp_path / 'hub'})")


def test_a_large_split_takes_its_largest_id_from_meta_and_a_small_one_is_read(tmp_path, monkeypatch):
    """Dataset.open reads a split over SCAN_BYTES for nothing but its memmap (17 GB of OpenWebText are
    not read at every start): meta.json's max_id stands for it; a small split is scanned (hand edits)."""
    (tmp_path / "a.txt").write_bytes(b"abc" * 2000)
    data.prepare_input(str(tmp_path / "a.txt"), tmp_path / "p", quiet=True)
    ids = np.fromfile(tmp_path / "p" / "train.bin", "<u2")
    ids[7] = 300  # past the vocab, behind meta.json's back
    ids.tofile(tmp_path / "p" / "train.bin")
    with pytest.raises(ConfigError) as e:
        data.Dataset.open(str(tmp_path / "p"), 256, 8)
    assert str(e.value) == f"train.bin in {str(tmp_path / 'p')!r} holds token id 300 >= model.vocab_size=256"
    monkeypatch.setattr(data, "SCAN_BYTES", 5000)  # train: 10,800 bytes, "large"; val: 1,200
    reads = []
    monkeypatch.setattr(np.memmap, "max", lambda self, *a, **k: reads.append(1) or np.ndarray.max(self, *a, **k))
    assert data.Dataset.open(str(tmp_path / "p"), 256, 8).vocab_size == 256  # meta's max_id: 99 ('c')
    assert reads == [1]  # val only


def test_a_vocab_past_uint16_is_written_and_read_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    docs = ["w69999 w1 w65536", "w2 w3", "w65535 w7"]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    meta = data.prepare_input(str(tmp_path / "c.jsonl"), tmp_path / "p", str(tmp_path / "big.json"), quiet=True)
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 70_001, 70_000)
    assert _split_ids(tmp_path / "p", "train") == [69999, 1, 65536, 70000, 2, 3, 70000]  # the last doc: val
    assert _split_ids(tmp_path / "p", "val") == [65535, 7, 70000]
    ds = data.Dataset.open(str(tmp_path / "p"), 70_001, 2)
    assert ds.train.dtype == np.dtype("<u4") and int(ds.train[2]) == 65536
