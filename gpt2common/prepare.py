"""`jaxpar prepare`: a corpus of any size -> token shards, streamed, in bounded memory.

Documents (`corpus_sources`) are cut into segments (`segment`), grouped into tasks of about
`TASK_CHARS` characters and tokenized by `workers` processes (tokenizers' batch encoding);
results come back in task order, so the output depends only on the input and the settings,
never on the worker count. Each document is followed by the tokenizer's end-of-text id
(`<|endoftext|>`) when it has one (nanoGPT's rule); a tokenizer without one (byte, a BPE trained
without it) gets a blank line ("\\n\\n") between documents instead, as folders were joined before.

Validation is chosen by documents: document i is validation when a hash of (seed, i) falls
below `val_fraction` (default 0.0005, nanoGPT's); if that picks none, the last document is. A
one-document input (one text file, the built-in corpus) keeps the tail split: its last 10% of
tokens.

Layout (`out`): `train.bin`, `train.1.bin`, ... and `val.bin`, `val.1.bin`, ...: little-endian
uint16 ids (uint32 when the vocab needs it); a train shard closes at the first document end
past `shard_tokens`. `meta.json` (written last) lists every shard with its tokens, largest id
and sha256. Until then `prepare.progress.json` records the shards that are complete and the
document they end at: the same command again continues from there, and a kill -9 leaves
nothing that training accepts (no meta.json). A shard is written as `<name>.tmp` and renamed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gpt2common.grammar import ConfigError
from gpt2common.segment import SEG_CHARS, segments
from gpt2common.writes import WriteFailed, refused_write, write_atomic

EOT = "<|endoftext|>"
SEPARATOR = "\n\n"            # between documents when the tokenizer has no end-of-text id
TASK_CHARS = 4 << 20          # characters per task sent to a worker
SHARD_TOKENS = 100_000_000    # llm.c's shard size
VAL_FRACTION = 0.0005         # nanoGPT's openwebtext split
TAIL_FRACTION = 0.1           # a one-document input: its last 10% of tokens
PROGRESS = "prepare.progress.json"


@dataclass(frozen=True)
class Settings:
    """What decides the output: a continued run must match the interrupted one on each."""
    source: str
    tokenizer: str
    text_key: str = "text"
    val_fraction: float = VAL_FRACTION
    seed: int = 0
    shard_tokens: int = SHARD_TOKENS
    seg_chars: int = SEG_CHARS


def shard_name(split: str, k: int) -> str:
    return f"{split}.bin" if k == 0 else f"{split}.{k}.bin"


def is_val(seed: int, doc: int, fraction: float) -> bool:
    h = hashlib.blake2b(f"{seed}/{doc}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") < fraction * 2.0**64


# ----------------------------------------------------------------------------- workers
_W: dict = {}


def _init(tok_json: str | None, eot: int | None, sep: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: `workers` is the parallelism
    if multiprocessing.parent_process() is not None:  # a pool worker: Ctrl-C is the parent's to handle
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    hf = None
    if tok_json is not None:
        from tokenizers import Tokenizer

        hf = Tokenizer.from_str(tok_json)
    _W.update(hf=hf, eot=eot, sep=sep)


def _ids(texts: list) -> list[np.ndarray]:
    hf = _W["hf"]
    if hf is None:  # the byte tokenizer: id = byte (bytes pieces are kept as they are)
        return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), np.uint8).astype(np.uint32)
                for t in texts]
    return [np.asarray(e.ids, np.uint32) for e in hf.encode_batch(texts, add_special_tokens=False)]


def _encode_task(task: list[tuple[int, bool, bool, str]]) -> list[tuple[int, bool, np.ndarray]]:
    """task: (document, first segment?, last segment?, text) -> (document, last?, ids)."""
    texts = []
    for doc, first, _, text in task:
        if first and doc > 0 and _W["eot"] is None:
            text = (SEPARATOR.encode() if isinstance(text, bytes) else SEPARATOR) + text
        texts.append(text)
    out = []
    for (doc, _, last, _), ids in zip(task, _ids(texts)):
        if last and _W["eot"] is not None:
            ids = np.append(ids, np.uint32(_W["eot"]))
        out.append((doc, last, ids))
    return out


def _ordered(tasks, workers: int, init_args):
    """Results of `_encode_task` over `tasks`, in order, with at most 2 * workers tasks in flight
    (Pool.imap would read the whole input ahead into its queue)."""
    if workers <= 1:
        _init(*init_args)
        yield from map(_encode_task, tasks)
        return
    mp = multiprocessing
    # spawn: the parent may hold JAX's threads, which fork would copy mid-state
    with mp.get_context("spawn").Pool(workers, initializer=_init, initargs=init_args) as pool:
        pending: deque = deque()
        for t in tasks:
            pending.append(pool.apply_async(_encode_task, (t,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ----------------------------------------------------------------------------- writing
class _Shards:
    """The shards of one split: appends to `<name>.tmp`, renamed when closed."""

    def __init__(self, out: Path, split: str, dtype: str, done: list[dict]):
        self.out, self.split, self.dtype, self.done = out, split, dtype, list(done)
        self.f = None

    def _open(self):
        self.name = self.out / shard_name(self.split, len(self.done))  # what a refused write names
        self.path = self.out / (self.name.name + ".tmp")
        with refused_write(self.name):
            self.f = open(self.path, "wb")
        self.tokens, self.max_id, self.sha = 0, 0, hashlib.sha256()

    def write(self, ids: np.ndarray) -> None:
        if self.f is None:
            self._open()
        if len(ids):
            b = ids.astype(self.dtype).tobytes()
            with refused_write(self.name):  # a full disk is one line naming the shard, not a traceback
                self.f.write(b)
            self.sha.update(b)
            self.tokens += len(ids)
            self.max_id = max(self.max_id, int(ids.max()))

    def close(self) -> None:
        if self.f is None:
            return
        with refused_write(self.name):
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            self.f = None
            os.replace(self.path, self.name)
        name = self.name.name
        self.done.append({"file": name, "tokens": self.tokens, "max_id": self.max_id, "sha256": self.sha.hexdigest()})

    def take_tail(self, n: int) -> np.ndarray:
        """Remove and return the last `n` tokens of the open shard (the last document, for val)."""
        self.f.flush()
        size = np.dtype(self.dtype).itemsize
        with open(self.path, "rb") as f:
            f.seek((self.tokens - n) * size)
            tail = np.frombuffer(f.read(), self.dtype).astype(np.uint32)
        self.f.truncate((self.tokens - n) * size)
        self.f.seek(0, os.SEEK_END)
        self.tokens -= n
        with open(self.path, "rb") as f:  # the running hash and max are recomputed over what remains
            rest = np.frombuffer(f.read(), self.dtype)
        self.sha = hashlib.sha256(rest.tobytes())
        self.max_id = int(rest.max()) if len(rest) else 0
        return tail


class _Progress:
    """Plain lines every `every` seconds on a pipe; a rich progress bar on a terminal."""

    def __init__(self, total_bytes: int, quiet: bool):
        self.t0, self.total, self.quiet = time.time(), total_bytes, quiet
        self.last = self.t0  # the first plain line after 10 s: a short prepare prints only its summary
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            # stderr: stdout carries meta.json
            self.bar = Progress(TextColumn("prepare"), BarColumn(), TextColumn("{task.fields[what]}"),
                                TimeRemainingColumn(), transient=True, console=Console(stderr=True))
            self.bar.start()
            self.task = self.bar.add_task("", total=max(total_bytes, 1), what="")

    def update(self, done_bytes: int, docs: int, tokens: int) -> None:
        now = time.time()
        rate = tokens / max(now - self.t0, 1e-9)
        what = f"{done_bytes / 1e6:.0f}/{self.total / 1e6:.0f} MB, {docs:,} docs, {tokens:,} tokens, {rate:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=min(done_bytes, self.total), what=what)
        elif not self.quiet and now - self.last >= 10:
            self.last = now
            eta = (self.total - done_bytes) / max(done_bytes / max(now - self.t0, 1e-9), 1e-9)
            sys.stderr.write(f"prepare: {what}, ETA {eta:.0f} s\n")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ----------------------------------------------------------------------------- the run
def _tasks(docs, hf, seg_chars: int, skip: int, stats: dict, warn):
    """Tasks of about TASK_CHARS characters from the documents after the first `skip`."""
    task, chars = [], 0
    for i, doc in enumerate(docs):
        stats["docs"] = i + 1
        if i < skip:
            for _ in doc.pieces:  # read past (a JSONL/Parquet row is one piece)
                pass
            continue
        empty = True
        segs = segments(doc.pieces, hf, seg_chars, warn=lambda m, d=doc: warn(f"{d.label}: {m}"))
        prev = next(segs, None)
        first = True
        while prev is not None:
            nxt = next(segs, None)
            task.append((i, first, nxt is None, prev))
            chars += len(prev)
            stats["bytes"] += len(prev)
            first, empty, prev = False, False, nxt
            if chars >= TASK_CHARS:
                yield task
                task, chars = [], 0
        if empty:  # an empty document still ends with its end-of-text id
            task.append((i, True, True, b"" if hf is None else ""))
    if task:
        yield task


def _count_tokens(docs, hf, st: Settings, workers: int, init_args) -> int:
    stats = {"docs": 0, "bytes": 0}
    return sum(len(ids) for res in _ordered(_tasks(docs, hf, st.seg_chars, 0, stats, lambda m: None), workers,
                                               init_args) for _, _, ids in res)


def warn_once():
    """A `warn(message)` that writes each message to stderr once (the corpus may be read twice:
    a BPE's training pass, a one-document input's count pass)."""
    warned: set[str] = set()

    def warn(m: str) -> None:
        if m not in warned:
            warned.add(m)
            sys.stderr.write(f"warning: {m}\n")
    return warn


def run(docs_fn, out: str, tok, st: Settings, workers: int = 1, single: bool = False, total_bytes: int = 0,
        quiet: bool = False, min_tokens: int = 0, key: str = "input", warn=None) -> dict:
    """Tokenize the documents `docs_fn()` yields into `out` (which exists and is ours). Returns
    meta. Continues from `out`/prepare.progress.json when its settings are `st`."""
    t0 = time.time()
    outp = Path(out)
    hf = tok.hf_tokenizer()
    eot = hf.token_to_id(EOT) if hf is not None else None
    dtype = "<u2" if tok.vocab_size <= 1 << 16 else "<u4"
    init_args = (hf.to_str() if hf is not None else None, eot, SEPARATOR)
    prog_path = outp / PROGRESS
    state = {"settings": asdict(st), "train": [], "val": [], "docs_done": 0, "val_docs": 0}
    if prog_path.exists():
        try:
            saved = json.loads(prog_path.read_text())
        except (OSError, ValueError):
            raise ConfigError(f"out={out!r}: {PROGRESS} is corrupt; delete out and prepare again") from None
        if saved.get("settings") != asdict(st):
            diff = sorted(k for k in asdict(st) if saved.get("settings", {}).get(k) != asdict(st)[k])
            raise ConfigError(f"out={out!r} holds an unfinished prepare with other settings ({', '.join(diff)}); "
                              "run the same command again, or choose a new out=")
        state = saved
        for split in ("train", "val"):
            for s in state[split]:
                p = outp / s["file"]
                if not p.is_file() or p.stat().st_size != s["tokens"] * np.dtype(dtype).itemsize:
                    raise ConfigError(f"out={out!r}: {s['file']} is missing or not the size {PROGRESS} records; "
                                      "delete out and prepare again")
        sys.stderr.write(f"prepare: continuing after {len(state['train'])} finished shards "
                         f"({state['docs_done']:,} documents)\n")
    for f in outp.glob("*.tmp"):  # a killed run's open shards
        if f.name.startswith(("train.", "val.")):
            f.unlink()
    n_train_total = None
    if single:
        n = _count_tokens(docs_fn(), hf, st, workers, init_args) if hf is not None else total_bytes
        n_train_total = n - max(int(n * TAIL_FRACTION), 1)
    train = _Shards(outp, "train", dtype, state["train"])
    val = _Shards(outp, "val", dtype, state["val"])
    stats = {"docs": state["docs_done"], "bytes": 0}
    bar = _Progress(total_bytes, quiet)
    warn = warn or warn_once()

    cur_doc, doc_start, val_docs, written = -1, 0, state["val_docs"], 0
    last_is_val = False
    try:
        for res in _ordered(_tasks(docs_fn(), hf, st.seg_chars, state["docs_done"], stats, warn), workers, init_args):
            for doc, _, ids in res:
                if doc != cur_doc:  # a new document starts: a full train shard is closed first
                    if not single and train.f is not None and train.tokens >= st.shard_tokens:
                        train.close()
                        val.close()
                        state.update(train=train.done, val=val.done, docs_done=doc, val_docs=val_docs)
                        write_atomic(prog_path, json.dumps(state))
                    cur_doc, doc_start = doc, train.tokens if train.f is not None else 0
                    last_is_val = not single and is_val(st.seed, doc, st.val_fraction)
                    val_docs += last_is_val
                if single:
                    cut = max(0, min(len(ids), n_train_total - written))
                    train.write(ids[:cut])
                    if cut < len(ids):
                        val.write(ids[cut:])
                    written += len(ids)
                else:
                    (val if last_is_val else train).write(ids)
            bar.update(stats["bytes"], stats["docs"], sum(s["tokens"] for s in train.done) + train.tokens)
        docs = stats["docs"]
        if docs == 0:
            raise ConfigError(f"{key}={st.source!r} holds no documents")
        if not single and val_docs == 0 and not val.done and (val.f is None or val.tokens == 0):
            if docs < 2:
                raise ConfigError(f"{key}={st.source!r} holds one document; validation needs a second (or one .txt "
                                  "file, whose last 10% is validation)")
            val.write(train.take_tail(train.tokens - doc_start))  # the last document
            val_docs = 1
        for s in (train, val):  # shard 0 of each split exists, even empty (in-memory text, min_tokens=0)
            if s.f is None and not s.done:
                s._open()
        train.close()
        val.close()
    except WriteFailed:
        for s in (train, val):  # no half-written shard stays behind
            if s.f is not None:
                s.f.close()
                s.f = None
                s.path.unlink(missing_ok=True)
        raise
    finally:
        bar.stop()
        for s in (train, val):
            if s.f is not None:
                s.f.close()
    n_tr, n_va = sum(s["tokens"] for s in train.done), sum(s["tokens"] for s in val.done)
    if min(n_tr, n_va) < min_tokens:
        need = f"train.seq_len+1={min_tokens}" if key == "data" else f"{min_tokens} tokens"
        raise ConfigError(f"{key}={st.source!r} gives {n_tr + n_va} tokens ({n_tr} train, {n_va} val); "
                          f"each split needs at least {need}")
    meta = {"tokenizer": tok.kind, "vocab_size": tok.vocab_size, "train_tokens": n_tr, "val_tokens": n_va,
            "source": st.source, "documents": docs, "val_documents": 1 if single else val_docs,
            "eot_id": eot, "dtype": "uint16" if dtype == "<u2" else "uint32",
            "split": "tail" if single else "documents", "val_fraction": TAIL_FRACTION if single else st.val_fraction,
            "seed": st.seed, "shards": {"train": train.done, "val": val.done}}
    write_atomic(outp / "meta.json", json.dumps(meta, indent=2))
    prog_path.unlink(missing_ok=True)
    secs = time.time() - t0
    if not quiet:
        if single:
            sys.stderr.write(f"prepare: one document: validation is its last {TAIL_FRACTION:.0%} of tokens "
                             f"({n_va:,} of {n_tr + n_va:,})\n")
        sys.stderr.write(f"prepared: {n_tr + n_va:,} tokens ({n_tr:,} train, {n_va:,} val), {docs:,} documents, "
                         f"{len(train.done) + len(val.done)} shards, {secs:.1f} s, "
                         f"{total_bytes / 1e6 / max(secs, 1e-9):.1f} MB/s\n")
    return meta
