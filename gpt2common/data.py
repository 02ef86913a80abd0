"""Tokenizers, uint16 memmap token files (nanoGPT layout) and the deterministic batch order.

A prepared dir holds `train.bin`, `val.bin` (uint16 token ids, little-endian) and
`meta.json` ({tokenizer, vocab_size, train_tokens, val_tokens, source}). Batches are
a pure function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted run would, and torchref draws the very same rows.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from gpt2common.grammar import ConfigError
from gpt2common.outdir import make_out

BUILTIN_CORPUS = "tinyshakespeare"  # shipped gzipped inside the package; works offline
BPE_VOCAB_SIZE = 4096


def builtin_text() -> str:
    data = resources.files("gpt2common.corpus").joinpath("tinyshakespeare.txt.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")


class Tokenizer:
    """encode/decode + vocab size; `byte` (256 ids), a trained BPE, or a tokenizer read from a dir,
    a tokenizer.json or a hub name in the local HF cache (kind `gpt2-dir`)."""

    def __init__(self, kind: str, hf=None):
        self.kind, self._hf = kind, hf

    @property
    def vocab_size(self) -> int:
        return 256 if self._hf is None else self._hf.get_vocab_size()

    def hf_tokenizer(self):
        """The `tokenizers.Tokenizer` (None for the byte tokenizer)."""
        return getattr(self._hf, "_tokenizer", self._hf)  # ByteLevelBPETokenizer wraps one

    def encode(self, text: str | bytes, source: str = "", label: str = "") -> np.ndarray:
        """Token ids of `text`; bytes go to the byte tokenizer untouched. A BPE tokenizer needs
        text: bytes that are not UTF-8 become U+FFFD, with a warning naming how many and where
        they came from (`label`, else input=`source`)."""
        if self._hf is None:
            raw = text if isinstance(text, bytes) else text.encode("utf-8")
            return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
        if isinstance(text, bytes):
            text = _decoded(text, label or f"input={source!r}")
        ids = self._hf.encode(text).ids
        return np.asarray(ids, dtype=np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids)

    def save(self, out_dir: Path) -> None:
        if self._hf is not None:
            self._hf.save(str(Path(out_dir) / "tokenizer.json"))


def load_gpt2_tokenizer_dir(path: str, key: str = "tokenizer") -> Tokenizer:
    """A tokenizer dir: its tokenizer.json (a jaxpar export, an HF save_pretrained dir), else
    GPT-2's vocab.json + merges.txt."""
    from tokenizers import ByteLevelBPETokenizer

    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return load_tokenizer_file(os.path.join(path, "tokenizer.json"), key, shown=path)
    vocab, merges = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        raise ConfigError(f"{key}={path!r} holds no tokenizer (tokenizer.json, or vocab.json and merges.txt)")
    try:
        return Tokenizer("gpt2-dir", ByteLevelBPETokenizer(vocab, merges))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"{key}={path!r}: vocab.json or merges.txt is corrupt ({_first_line(e)})") from None


def load_tokenizer_file(path: str, key: str = "tokenizer", shown: str = "") -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return Tokenizer("gpt2-dir", HFTokenizer.from_file(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"{key}={shown or path!r}: tokenizer.json is corrupt ({_first_line(e)})") from None


def has_tokenizer(path: str) -> bool:
    """A dir a tokenizer can be read from (`init=` dirs: the model's own tokenizer)."""
    return os.path.isfile(os.path.join(path, "tokenizer.json")) or all(
        os.path.isfile(os.path.join(path, n)) for n in ("vocab.json", "merges.txt"))


def _first_line(e: Exception) -> str:
    return next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)


def train_bpe(texts) -> Tokenizer:
    """A byte-level BPE of BPE_VOCAB_SIZE ids trained on `texts` (an iterator of str), with
    GPT-2's end-of-text token, so that documents keep their boundaries."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    return Tokenizer("bpe", tok)


def make_tokenizer(spec: str, text: str | None = None, key: str = "tokenizer") -> Tokenizer:
    """byte | bpe (trained on `text`) | a tokenizer dir | a tokenizer.json | a hub name in the
    local HF cache (`openai-community/gpt2`: never downloads)."""
    if spec == "byte":
        return Tokenizer("byte")
    if spec == "bpe":
        return train_bpe(iter([text or ""]))
    if os.path.isdir(spec):
        return load_gpt2_tokenizer_dir(spec, key)
    if os.path.isfile(spec) and spec.endswith(".json"):
        return load_tokenizer_file(spec, key)
    from gpt2common.hf import cached_snapshot

    if (snap := cached_snapshot(spec)) is not None:
        return load_gpt2_tokenizer_dir(snap, key)
    from gpt2common.hf import hub_cache_dir

    raise ConfigError(f"{key}={spec!r} must be byte, bpe, a tokenizer dir (tokenizer.json, or vocab.json + "
                      f"merges.txt), a tokenizer.json, or a hub name in the local HF cache ({hub_cache_dir()})")


def load_tokenizer(prepared_dir: str) -> Tokenizer:
    """The tokenizer a prepared dir was made with (for `sample`)."""
    meta = read_meta(prepared_dir)
    if meta["tokenizer"] == "byte":
        return Tokenizer("byte")
    return Tokenizer(meta["tokenizer"], _saved_tokenizer(prepared_dir))


def _saved_tokenizer(path: str):
    """The HF tokenizer saved in a prepared dir (tokenizer.json), or a one-line ConfigError."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"data={path!r}: tokenizer.json is corrupt ({_first_line(e)})") from None


def _check_vocab(tok: Tokenizer, model_vocab: int | None) -> None:
    if tok.vocab_size > 1 << 32:
        raise ConfigError(f"tokenizer vocab_size={tok.vocab_size} does not fit uint32")
    if model_vocab is not None and tok.vocab_size > model_vocab:
        raise ConfigError(f"data vocab_size={tok.vocab_size} is larger than model.vocab_size={model_vocab}")


def prepare(text: str | bytes, out_dir: str, tokenizer: str = "byte", source: str = "", min_tokens: int = 0,
            model_vocab: int | None = None, key: str = "data") -> dict:
    """Tokenize `text`, one document held in memory, into `out_dir` (its last 10% of tokens is
    validation), write meta.json. Returns meta. `prepare_input` streams files of any size."""
    from gpt2common import prepare as pp
    from gpt2common.corpus_sources import Doc

    tok = make_tokenizer(tokenizer, text.decode("utf-8", errors="replace") if isinstance(text, bytes)
                         and tokenizer == "bpe" else text)
    _check_vocab(tok, model_vocab)
    if tok._hf is not None and isinstance(text, bytes):
        text = _decoded(text, f"input={source!r}")
    raw = text if tok._hf is not None or isinstance(text, bytes) else text.encode("utf-8")
    n = len(raw) if tok._hf is None else 0
    st = pp.Settings(source=source, tokenizer=tok.kind)
    return _run_into(out_dir, tok, lambda: iter([Doc(source or "text", iter([raw]))]), st, single=True,
                     total_bytes=n, quiet=True, min_tokens=min_tokens, key=key)


def _decoded(raw: bytes, label: str) -> str:
    """`raw` as UTF-8; invalid sequences become U+FFFD, with one warning naming `label` and how many."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        decoded = raw.decode("utf-8", errors="replace")
        bad = decoded.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
        sys.stderr.write(f"warning: {label} is not valid UTF-8 ({bad} undecodable sequences "
                         f"replaced by U+FFFD); tokenizer=byte would keep the raw bytes\n")
        return decoded


def _run_into(out_dir, tok, docs_fn, st, **kw) -> dict:
    """`prepare.run` into `out_dir`, created if needed; on bad input (ConfigError) what this call
    wrote is removed (a continued prepare's earlier shards stay)."""
    from gpt2common import prepare as pp
    from gpt2common.outdir import _missing_dirs, _remove_empty

    out = Path(out_dir)
    created = _missing_dirs(str(out))  # deepest first: removed again, each while empty, on bad input
    make_out(str(out_dir))
    before = set(os.listdir(out))
    if tok._hf is not None and not (out / "tokenizer.json").exists():
        tok.save(out)  # first: a continued prepare reads it back (a trained BPE is not trained again)
    from gpt2common.writes import WriteFailed

    try:
        return pp.run(docs_fn, str(out), tok, st, **kw)
    except (ConfigError, WriteFailed):
        for name in set(os.listdir(out)) - before:
            with contextlib.suppress(OSError):
                os.unlink(out / name)
        _remove_empty(created)
        raise


def prepare_input(source: str, out_dir: str, tokenizer: str = "byte", text_key: str = "text", workers: int = 1,
                  val_fraction: float | None = None, seed: int = 0, shard_tokens: int | None = None,
                  min_tokens: int = 0, model_vocab: int | None = None, key: str = "input", quiet: bool = False,
                  seg_chars: int | None = None) -> dict:
    """Stream the corpus `source` (files, folders, globs, a saved or cached HF dataset; empty: the
    built-in corpus) into the prepared dir `out_dir` with `workers` processes. Returns meta."""
    from gpt2common import corpus_sources as cs
    from gpt2common import prepare as pp
    from gpt2common.segment import SEG_CHARS

    builtin = not source
    paths = [] if builtin else cs.input_paths(source, key)
    text = builtin_text() if builtin else ""

    def documents(raw: bool, warn=None):
        if builtin:
            return iter([cs.Doc(BUILTIN_CORPUS, iter([text.encode("utf-8") if raw else text]))])
        return cs.documents(paths, text_key, raw=raw, warn=warn)

    out = Path(out_dir)
    if tokenizer == "bpe" and (out / "tokenizer.json").exists() and (out / pp.PROGRESS).exists():
        tok = Tokenizer("bpe", _saved_tokenizer(str(out)))  # continuing: the BPE trained before
    elif tokenizer == "bpe":  # one pass over the corpus first, in 1 MiB pieces
        tok = train_bpe(piece for d in documents(raw=False) for piece in d.pieces)
    else:
        tok = make_tokenizer(tokenizer)
    if model_vocab is not None and tok.vocab_size > model_vocab:  # raw text for a run: say how it fits
        raise ConfigError(f"data vocab_size={tok.vocab_size} is larger than model.vocab_size={model_vocab} "
                          f"(tokenizer={tokenizer}): give model.vocab_size={tok.vocab_size}, or prepare the text first "
                          "(jaxpar prepare), whose vocab a run then takes")
    _check_vocab(tok, None)
    warn = pp.warn_once()
    raw = tok._hf is None  # the byte tokenizer takes a text file's bytes as they are
    docs_fn = lambda: documents(raw, warn)  # noqa: E731
    total = len(text.encode("utf-8")) if builtin else sum(os.path.getsize(p) for p in paths)
    single = builtin or cs.is_single_document(paths)
    st = pp.Settings(source=source or BUILTIN_CORPUS, tokenizer=tok.kind, text_key=text_key,
                     val_fraction=pp.VAL_FRACTION if val_fraction is None else val_fraction, seed=seed,
                     shard_tokens=shard_tokens or pp.SHARD_TOKENS, seg_chars=seg_chars or SEG_CHARS)
    return _run_into(out_dir, tok, docs_fn, st, workers=workers, single=single, total_bytes=total, quiet=quiet,
                     min_tokens=min_tokens, key=key, warn=warn)


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json")) and os.path.isfile(os.path.join(path, "train.bin"))


def read_meta(path: str, model_vocab: int | None = None) -> dict:
    """meta.json of a prepared dir; with `model_vocab`, also check the tokens fit the model."""
    try:
        meta = json.loads(Path(path, "meta.json").read_text())
        if type(meta["vocab_size"]) is not int:  # "300" passed int() and then failed `>` with a TypeError traceback
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # Recursion: json nested past the stack
        raise ConfigError(f"data={path!r}: meta.json is missing or corrupt") from None
    # What a hand edit or a partial copy breaks: the tokenizer that made the ids, and its vocab.
    kind, vocab = meta.get("tokenizer"), meta["vocab_size"]
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"data={path!r}: meta.json names no known tokenizer (tokenizer={kind!r}); prepare it again")
    # A tokenizer jaxpar makes is checked against its files; another name marks token ids made
    # elsewhere (nanoGPT's layout with the user's own tokenizer): trainable, not samplable.
    if kind in ("byte", "bpe", "gpt2-dir"):
        if kind != "byte" and not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ConfigError(f"data={path!r}: meta.json names tokenizer={kind} but tokenizer.json is missing; "
                              "prepare it again")
        actual = 256 if kind == "byte" else _saved_tokenizer(path).get_vocab_size()
        if vocab != actual:
            raise ConfigError(f"data={path!r}: meta.json says vocab_size={vocab} but its tokenizer has {actual}; "
                              "prepare it again")
    if model_vocab is not None and meta["vocab_size"] > model_vocab:
        raise ConfigError(f"data vocab_size={meta['vocab_size']} is larger than model.vocab_size={model_vocab}")
    return meta


def _tokenizer_kind(spec: str) -> str:
    return spec if spec in ("byte", "bpe") else "gpt2-dir"


def _prepared_for(data: str, tokenizer: str, workdir: str) -> str | None:
    """The prepared dir `data=` resolves to without reading any text: `data` itself, or
    `workdir`/data made from the same source by an earlier run (reused only then); else None."""
    if data and is_prepared(data):
        return data
    if data and os.path.isdir(data) and os.path.exists(os.path.join(data, "meta.json")):
        raise ConfigError(f"data={data!r} has meta.json but no train.bin")
    if data and os.path.isfile(os.path.join(data, "prepare.progress.json")):
        raise ConfigError(f"data={data!r} is an unfinished prepare (no meta.json yet): run the same jaxpar prepare "
                          "again to finish it")
    target = os.path.join(workdir, "data")
    if is_prepared(target):
        meta = read_meta(target)
        if meta.get("source") == (data or BUILTIN_CORPUS) and meta.get("tokenizer") == _tokenizer_kind(tokenizer):
            return target
    return None


def check_data(data: str, tokenizer: str, workdir: str) -> None:
    """`resolve_data`'s checks of where the data comes from, without reading or writing it
    (`jaxpar launch` runs them once, before any rank starts)."""
    from gpt2common.corpus_sources import input_paths

    if parse_mixture(data) is None and _prepared_for(data, tokenizer, workdir) is None and data:
        input_paths(data, "data")


def parse_mixture(spec: str, key: str = "data") -> list[tuple[str, float]] | None:
    """`a:0.7,b:0.3` (prepared dirs with weights; a part without one weighs 1) -> [(dir, weight)];
    None when `spec` is one path or raw text (a comma list of text files is one corpus)."""
    if not spec or spec in ("",) or is_prepared(spec):
        return None
    parts = []
    for part in spec.split(","):
        path, sep, w = part.rpartition(":")
        if not sep:
            path, w = part, "1"
        parts.append((path, w))
    if not all(is_prepared(p) for p, _ in parts) or (len(parts) == 1 and not spec.count(":")):
        return None
    out = []
    for p, w in parts:
        try:
            weight = float(w)
        except ValueError:
            weight = float("nan")
        if not (weight > 0 and weight != float("inf")):
            raise ConfigError(f"{key}={spec!r}: the weight {w!r} of {p!r} is not a positive number")
        out.append((p, weight))
    tokenizers = {}
    for p, _ in out:
        m = read_meta(p)
        tok_file = os.path.join(p, "tokenizer.json")
        digest = hashlib.sha256(Path(tok_file).read_bytes()).hexdigest()[:12] if os.path.isfile(tok_file) else ""
        tokenizers[p] = (m["tokenizer"], m["vocab_size"], digest)
    first = out[0][0]
    other = next((p for p, _ in out if tokenizers[p] != tokenizers[first]), None)
    if other is not None:
        (ka, va, _), (kb, vb, _) = tokenizers[first], tokenizers[other]
        raise ConfigError(f"{key}={spec!r}: {first!r} and {other!r} were prepared with different tokenizers "
                          f"({ka}/{va} and {kb}/{vb}); a mixture needs one tokenizer")
    return out


def tokenizer_for_init(init: str, data: str, tokenizer: str, given: bool) -> str:
    """The `tokenizer=` of a fine-tune (init=DIR) on raw text, for jaxpar and torchref alike: the
    tokenizer DIR ships (tokenizer.json, or vocab.json + merges.txt) unless tokenizer= is `given`;
    the byte default would feed a GPT-2 ids it never saw. A DIR with weights only keeps
    `tokenizer` (the printed and saved config shows which); prepared data brings its own ids."""
    if not init or given or (data and is_prepared(data)) or parse_mixture(data) is not None:
        return tokenizer
    from gpt2common import hf

    d = hf.cached_snapshot(init) or init
    if not os.path.isfile(os.path.join(d, "model.safetensors")):
        return tokenizer  # no HF weights: init= itself is refused, with its reason, when they are read
    return os.path.abspath(d) if has_tokenizer(d) else tokenizer


def _clear_prepared(d: str) -> None:
    """Remove what a prepare wrote into `d` (meta.json first: no reader takes it half-removed)."""
    if not os.path.isdir(d):
        return
    for name in ["meta.json", "prepare.progress.json", "tokenizer.json"] + sorted(os.listdir(d)):
        if (name.startswith(("train.", "val.")) and name.endswith((".bin", ".tmp"))) or name in (
                "meta.json", "prepare.progress.json", "tokenizer.json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, name))


def resolve_data(data: str, tokenizer: str, workdir: str, seq_len: int = 0, model_vocab: int | None = None) -> str:
    """`data=` -> prepared dir. Raw text (files, folders, the built-in corpus) is prepared into
    `workdir`/data (streamed, one process), checked (length, vocab) before training starts."""
    if parse_mixture(data) is not None:
        return data  # several prepared dirs, read in place
    if (found := _prepared_for(data, tokenizer, workdir)) is not None:
        return found
    target = os.path.join(workdir, "data")
    _clear_prepared(target)  # the run's own data dir, prepared from another source or tokenizer
    prepare_input(data, target, tokenizer, min_tokens=seq_len + 1 if seq_len else 0, model_vocab=model_vocab,
                  key="data", quiet=True)
    return target


def load_tokens(path: str, dtype: str = "<u2") -> np.ndarray:
    """memmap of a .bin file (uint16 unless `dtype` says otherwise); errors name the file."""
    if not os.path.isfile(path):
        raise ConfigError(f"data file {path!r} " + ("is not a regular file" if os.path.exists(path) else "does not exist"))
    size, item = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % item:
        what = "odd size" if item == 2 else "size not a multiple of 4"
        raise ConfigError(f"data file {path!r} is corrupt ({what} {size} bytes; expected {np.dtype(dtype).name} tokens)")
    if size == 0:
        raise ConfigError(f"data file {path!r} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


def load_split(path: str, split: str, meta: dict):
    """The `split` tokens of a prepared dir, as long as its meta.json says (a truncated or swapped
    file would train on other tokens than were prepared, without a word): one memmap, or a
    `ShardedTokens` over the shards meta.json lists."""
    from gpt2common.shards import ShardedTokens, shard_list

    shards = shard_list(path, split, meta)
    if shards is None:  # a single-file dir (before shards, or nanoGPT's layout)
        arr = load_tokens(os.path.join(path, f"{split}.bin"))
        want = meta.get(f"{split}_tokens")
        if isinstance(want, int) and len(arr) != want:
            raise ConfigError(f"{split}.bin in {path!r} has {len(arr)} tokens but meta.json says {want} "
                              "(truncated or replaced); prepare it again")
        return arr
    dtype = "<u4" if meta.get("dtype") == "uint32" else "<u2"
    arrays = []
    for s in shards:
        arr = load_tokens(os.path.join(path, s["file"]), dtype)
        if len(arr) != s["tokens"]:
            raise ConfigError(f"{s['file']} in {path!r} has {len(arr)} tokens but meta.json says {s['tokens']} "
                              "(truncated or replaced); prepare it again")
        arrays.append(arr)
    return arrays[0] if len(arrays) == 1 else ShardedTokens(arrays)


SCAN_BYTES = 512 << 20  # a split up to this size is scanned for its largest id; a larger one trusts meta.json


def largest_id(path: str, split: str, meta: dict, tokens) -> int:
    """The largest id of a split: one pass over it (a hand-edited file is caught), or, for a split
    over SCAN_BYTES that prepare wrote, its shards' max_id in meta.json (a GPT-2 corpus's 17 GB
    are not read at every start)."""
    from gpt2common.shards import shard_list

    shards = shard_list(path, split, meta)
    if shards and len(tokens) * tokens.dtype.itemsize > SCAN_BYTES:
        return max(s["max_id"] for s in shards)
    return int(tokens.max())


@dataclass(frozen=True)
class Dataset:
    """Token ids of one prepared dir, with the model's vocab checked."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    path: str
    mixture: tuple = ()  # ((weight, train, val), ...) of a `data=a:0.7,b:0.3` mixture

    @staticmethod
    def open(path: str, model_vocab: int, seq_len: int) -> Dataset:
        if (mix := parse_mixture(path)) is not None:
            parts = [Dataset.open(p, model_vocab, seq_len) for p, _ in mix]
            from gpt2common.shards import ShardedTokens

            total = sum(w for _, w in mix)
            return Dataset(ShardedTokens([d.train for d in parts]), ShardedTokens([d.val for d in parts]),
                           parts[0].vocab_size, path, tuple((w / total, d.train, d.val) for (_, w), d in zip(mix, parts)))
        meta = read_meta(path, model_vocab)
        train, val = load_split(path, "train", meta), load_split(path, "val", meta)
        for name, split, arr in (("train.bin", "train", train), ("val.bin", "val", val)):
            if len(arr) < seq_len + 1:
                raise ConfigError(f"{name} in {path!r} has {len(arr)} tokens, fewer than train.seq_len+1={seq_len + 1}")
            # An id >= vocab would index past the embedding table, which XLA clamps silently
            # instead of failing: meta.json's largest id per shard, or one pass over the file.
            top = largest_id(path, split, meta, arr)
            if top >= model_vocab:
                raise ConfigError(f"{name} in {path!r} holds token id {top} >= model.vocab_size={model_vocab}")
        return Dataset(train, val, int(meta["vocab_size"]), path)


def batch_offsets(n_tokens: int, seq_len: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Start offsets of the global batch for `step`: a pure function of (seed, step).

    Offsets are drawn from [0, n_tokens - seq_len - 1) (the last window is never drawn; kept so
    every run's batch stream stays as it was), at least [0, 1): a split of exactly seq_len + 1
    tokens, which `prepare` and `Dataset.open` accept, has the one window at 0 (numpy's
    `integers(0, 0)` raised ValueError there: a traceback at the first eval or step)."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, max(n_tokens - seq_len - 1, 1), size=batch_size, dtype=np.int64)


def get_batch(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each int32 (len(offsets), seq_len); targets are inputs shifted by one."""
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    win = np.asarray(tokens[idx], dtype=np.int32)
    return win[:, :-1], win[:, 1:]


def mixture_batch(sources, seq_len: int, batch_size: int, seed: int, step: int):
    """A batch whose rows come from the sources [(weight, tokens)] in proportion to the weights:
    each row's source and start drawn from (seed, step) alone, so it is as reproducible as one
    source's (resume, and torchref's identical rows)."""
    rng = np.random.default_rng([seed, step, len(sources)])
    src = rng.choice(len(sources), size=batch_size, p=[w for w, _ in sources])
    draw = rng.integers(0, 1 << 62, size=batch_size, dtype=np.int64)
    xs = np.empty((batch_size, seq_len), np.int32)
    ys = np.empty((batch_size, seq_len), np.int32)
    for k, (_, tokens) in enumerate(sources):
        rows = np.flatnonzero(src == k)
        if len(rows):
            off = draw[rows] % max(len(tokens) - seq_len - 1, 1)
            xs[rows], ys[rows] = get_batch(tokens, off, seq_len)
    return xs, ys


def train_batch(ds: Dataset, seq_len: int, batch_size: int, seed: int, step: int):
    """The global batch of optimizer step `step` (0-based)."""
    if ds.mixture:
        return mixture_batch([(w, t) for w, t, _ in ds.mixture], seq_len, batch_size, seed, step)
    return get_batch(ds.train, batch_offsets(len(ds.train), seq_len, batch_size, seed, step), seq_len)


def val_batch(ds: Dataset, seq_len: int, batch_size: int, seed: int, index: int):
    """Validation batches are fixed for a run (seed offset keeps them apart from train draws)."""
    if ds.mixture:
        return mixture_batch([(w, v) for w, _, v in ds.mixture], seq_len, batch_size, seed + 1_000_003, index)
    return get_batch(ds.val, batch_offsets(len(ds.val), seq_len, batch_size, seed + 1_000_003, index), seq_len)


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Window k covers tokens [k*T, k*T+T]: inputs its first T, targets its last T."""
    if max_windows < 0:
        raise ConfigError(f"eval.windows={max_windows} must be >= 0 (0: every window that fits)")
    n = (len(tokens) - 1) // seq_len
    if max_windows:
        n = min(n, max_windows)
    if n <= 0:
        raise ConfigError(f"eval data has {len(tokens)} tokens, fewer than train.seq_len+1={seq_len + 1}")
    offsets = np.arange(n, dtype=np.int64) * seq_len
    return get_batch(tokens, offsets, seq_len)
