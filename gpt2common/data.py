"""Tokenizers, uint16 memmap token files (nanoGPT layout) and the deterministic batch order.

A prepared dir holds `train.bin`, `val.bin` (uint16 token ids, little-endian) and
`meta.json` ({tokenizer, vocab_size, train_tokens, val_tokens, source}). Batches are
a pure function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted run would, and torchref draws the very same rows.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from gpt2common.grammar import ConfigError
from gpt2common.outdir import make_out
from gpt2common.writes import write_atomic

BUILTIN_CORPUS = "tinyshakespeare"  # shipped gzipped inside the package; works offline
VAL_FRACTION = 0.1
BPE_VOCAB_SIZE = 4096


def builtin_text() -> str:
    data = resources.files("gpt2common.corpus").joinpath("tinyshakespeare.txt.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")


def input_files(path: str, key: str = "input") -> list[Path]:
    """The file `path`, or every *.txt / *.md file under the folder `path` (sorted); ConfigError
    naming `key` when there is none. Checks without reading (`jaxpar launch` checks data= once)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".md"))
        if not files:
            raise ConfigError(f"{key}={path!r} is a folder with no .txt or .md files")
        return files
    if not p.is_file():
        raise ConfigError(f"{key}={path!r} " + ("is not a regular file or folder" if p.exists() else "does not exist"))
    return [p]


def read_input(path: str, key: str = "input") -> bytes:
    """The raw bytes of a file, or of every *.txt / *.md file under a folder (sorted, joined by
    blank lines). Bytes, not text: the byte tokenizer takes any encoding (Latin-1, binary) as is.
    Errors name `key`, the key the user gave the path with (prepare's input=, train's data=)."""
    try:
        raw = b"\n\n".join(f.read_bytes() for f in input_files(path, key))
    except OSError as e:
        raise ConfigError(f"{key}={path!r} cannot be read ({e.strerror})") from None
    if not raw:
        raise ConfigError(f"{key}={path!r} is empty")
    return raw


def read_text(path: str) -> str:
    """`read_input` decoded as UTF-8 (invalid bytes become U+FFFD)."""
    return read_input(path).decode("utf-8", errors="replace")


class Tokenizer:
    """encode/decode + vocab size; `byte` (256 ids), a trained BPE, or a GPT-2 tokenizer dir."""

    def __init__(self, kind: str, hf=None):
        self.kind, self._hf = kind, hf

    @property
    def vocab_size(self) -> int:
        return 256 if self._hf is None else self._hf.get_vocab_size()

    def encode(self, text: str | bytes, source: str = "", label: str = "") -> np.ndarray:
        """Token ids of `text`; bytes go to the byte tokenizer untouched. A BPE tokenizer needs
        text: bytes that are not UTF-8 become U+FFFD, with a warning naming how many and where
        they came from (`label`, else input=`source`)."""
        if self._hf is None:
            raw = text if isinstance(text, bytes) else text.encode("utf-8")
            return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                decoded = text.decode("utf-8", errors="replace")
                bad = decoded.count("\ufffd") - text.decode("utf-8", errors="ignore").count("\ufffd")
                sys.stderr.write(f"warning: {label or f'input={source!r}'} is not valid UTF-8 ({bad} undecodable sequences "
                                 f"replaced by U+FFFD); tokenizer=byte would keep the raw bytes\n")
                text = decoded
        return np.asarray(self._hf.encode(text).ids, dtype=np.uint16)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids)

    def save(self, out_dir: Path) -> None:
        if self._hf is not None:
            self._hf.save(str(out_dir / "tokenizer.json"))


def load_gpt2_tokenizer_dir(path: str) -> Tokenizer:
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        raise ConfigError(f"tokenizer={path!r} must hold vocab.json and merges.txt")
    try:
        return Tokenizer("gpt2-dir", ByteLevelBPETokenizer(vocab, merges))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"tokenizer={path!r}: vocab.json or merges.txt is corrupt ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)


def make_tokenizer(spec: str, text: str | None = None) -> Tokenizer:
    if spec == "byte":
        return Tokenizer("byte")
    if spec == "bpe":
        from tokenizers import ByteLevelBPETokenizer

        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator([text or ""], vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False)
        return Tokenizer("bpe", tok)
    if os.path.isdir(spec):
        return load_gpt2_tokenizer_dir(spec)
    raise ConfigError(f"tokenizer={spec!r} must be byte, bpe or a GPT-2 tokenizer dir (vocab.json + merges.txt)")


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


def prepare(text: str | bytes, out_dir: str, tokenizer: str = "byte", source: str = "", min_tokens: int = 0,
            model_vocab: int | None = None, key: str = "data") -> dict:
    """Tokenize `text`, split 90/10 into train.bin / val.bin, write meta.json. Returns meta.

    Checks come before the first write: each split must hold `min_tokens` tokens (one
    training window, seq_len+1) and the tokenizer's vocab must fit `model_vocab`. Errors name
    `key`, the key `source` was given by (train's data=, prepare's input=)."""
    tok = make_tokenizer(tokenizer, text.decode("utf-8", errors="replace") if isinstance(text, bytes)
                         and tokenizer == "bpe" else text)
    if tok.vocab_size > 65536:
        raise ConfigError(f"tokenizer vocab_size={tok.vocab_size} does not fit uint16 (max 65536)")
    if model_vocab is not None and tok.vocab_size > model_vocab:
        raise ConfigError(f"data vocab_size={tok.vocab_size} is larger than model.vocab_size={model_vocab}")
    ids = tok.encode(text, source)
    n_val = max(int(len(ids) * VAL_FRACTION), 1)
    if min(len(ids) - n_val, n_val) < min_tokens:
        need = f"train.seq_len+1={min_tokens}" if key == "data" else f"{min_tokens} tokens"
        raise ConfigError(f"{key}={source!r} gives {len(ids)} tokens ({len(ids) - n_val} train, {n_val} val); "
                          f"each split needs at least {need}")
    out = Path(out_dir)
    make_out(out_dir)  # a refusal check_writable cannot foresee (/proc) is one line
    # Write to temp names and rename, so a crash never leaves a half-written prepared dir.
    for name, arr in (("train.bin", ids[:-n_val]), ("val.bin", ids[-n_val:])):
        write_atomic(out / name, arr.astype("<u2").tobytes())  # numpy's tofile loses the errno of a short write
    tok.save(out)
    meta = {"tokenizer": tok.kind, "vocab_size": tok.vocab_size, "train_tokens": int(len(ids) - n_val),
            "val_tokens": int(n_val), "source": source}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


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
    target = os.path.join(workdir, "data")
    if is_prepared(target):
        meta = read_meta(target)
        if meta.get("source") == (data or BUILTIN_CORPUS) and meta.get("tokenizer") == _tokenizer_kind(tokenizer):
            return target
    return None


def check_data(data: str, tokenizer: str, workdir: str) -> None:
    """`resolve_data`'s checks of where the data comes from, without reading or writing it
    (`jaxpar launch` runs them once, before any rank starts)."""
    if _prepared_for(data, tokenizer, workdir) is None and data:
        input_files(data, "data")


def resolve_data(data: str, tokenizer: str, workdir: str, seq_len: int = 0, model_vocab: int | None = None) -> str:
    """`data=` -> prepared dir. Raw text (file/folder/built-in) is prepared into `workdir`/data,
    checked (length, vocab) before anything is written there."""
    if (found := _prepared_for(data, tokenizer, workdir)) is not None:
        return found
    target = os.path.join(workdir, "data")
    source = data or BUILTIN_CORPUS
    text = builtin_text() if not data else read_input(data, "data")
    prepare(text, target, tokenizer, source=source, min_tokens=seq_len + 1 if seq_len else 0, model_vocab=model_vocab)
    return target


def load_tokens(path: str) -> np.ndarray:
    """uint16 memmap of a .bin file; errors name the file."""
    if not os.path.isfile(path):
        raise ConfigError(f"data file {path!r} " + ("is not a regular file" if os.path.exists(path) else "does not exist"))
    size = os.path.getsize(path)
    if size % 2:
        raise ConfigError(f"data file {path!r} is corrupt (odd size {size} bytes; expected uint16 tokens)")
    if size == 0:
        raise ConfigError(f"data file {path!r} is empty")
    return np.memmap(path, dtype="<u2", mode="r")


def load_split(path: str, split: str, meta: dict) -> np.ndarray:
    """`<split>.bin` of a prepared dir, as long as its meta.json says (a truncated or swapped
    file would train on other tokens than were prepared, without a word)."""
    arr = load_tokens(os.path.join(path, f"{split}.bin"))
    want = meta.get(f"{split}_tokens")
    if isinstance(want, int) and len(arr) != want:
        raise ConfigError(f"{split}.bin in {path!r} has {len(arr)} tokens but meta.json says {want} "
                          "(truncated or replaced); prepare it again")
    return arr


@dataclass(frozen=True)
class Dataset:
    """Token ids of one prepared dir, with the model's vocab checked."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    path: str

    @staticmethod
    def open(path: str, model_vocab: int, seq_len: int) -> Dataset:
        meta = read_meta(path, model_vocab)
        train, val = load_split(path, "train", meta), load_split(path, "val", meta)
        for name, arr in (("train.bin", train), ("val.bin", val)):
            if len(arr) < seq_len + 1:
                raise ConfigError(f"{name} in {path!r} has {len(arr)} tokens, fewer than train.seq_len+1={seq_len + 1}")
            # One pass over the file: an id >= vocab would index past the embedding table, which
            # XLA clamps silently instead of failing.
            top = int(arr.max())
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


def train_batch(ds: Dataset, seq_len: int, batch_size: int, seed: int, step: int):
    """The global batch of optimizer step `step` (0-based)."""
    return get_batch(ds.train, batch_offsets(len(ds.train), seq_len, batch_size, seed, step), seq_len)


def val_batch(ds: Dataset, seq_len: int, batch_size: int, seed: int, index: int):
    """Validation batches are fixed for a run (seed offset keeps them apart from train draws)."""
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
