"""The documents of a corpus, read incrementally: what `jaxpar prepare` tokenizes.

A document is a label (where it came from, for messages) and its text as an iterator of pieces
(`str`), so that no document is held whole: a .txt/.md file is one document read in
`PIECE_BYTES` blocks (a 1 GB file without a newline is never one string); a JSONL line or a
Parquet / Arrow row is one document, held no longer than its row batch.

Inputs: a file, a folder (recursive, sorted), a glob, several of these joined by commas; a
local HF `datasets` dir (`save_to_disk`: state.json + *.arrow, or a DatasetDict's `train`); a
dataset in the local HF cache by name (`owner/name`: the hub snapshot's files, else the
`datasets` library's Arrow cache), offline only. Formats by suffix: .txt .md .jsonl .jsonl.gz
.jsonl.zst .parquet .arrow. Reading uses pyarrow (Parquet, Arrow), gzip and zstandard.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpt2common.grammar import ConfigError

PIECE_BYTES = 1 << 20  # a .txt document is read and decoded 1 MiB at a time
TEXT_SUFFIXES = (".txt", ".md")
ROW_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".arrow")
SUFFIXES = TEXT_SUFFIXES + ROW_SUFFIXES
ROW_BATCH = 1024  # Parquet / Arrow rows decoded at a time


@dataclass(frozen=True)
class Doc:
    label: str             # file, or file:line / file:row, for messages
    pieces: Iterator[str]  # the text, in order; "".join(pieces) is the document


def _suffix(p: str) -> str | None:
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if p.endswith(s)), None)


def _hf_cache_files(name: str) -> list[str] | None:
    """The files of dataset `name` in the local HF cache: the hub snapshot (as `init=` resolves a
    model), else the `datasets` library's Arrow cache (`<owner>___<name>/**.arrow`). None if absent."""
    from gpt2common.hf import HUB_ID

    if os.path.exists(name) or not HUB_ID.fullmatch(name):
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        snap = snapshot_download(name, repo_type="dataset", local_files_only=True)
        found = [f for f in _walk(snap) if _suffix(f)]
        if found:
            return found
    except (ImportError, LocalEntryNotFoundError, ValueError, OSError):
        pass
    d = os.path.join(_datasets_cache(), name.replace("/", "___"))
    if os.path.isdir(d):
        # datasets writes <name>/<config>/<version>/<hash>/<name>-train-0000N-of-0000M.arrow
        found = [f for f in _walk(d) if f.endswith(".arrow") and "-train" in os.path.basename(f)]
        return found or None
    return None


def _datasets_cache() -> str:
    """The `datasets` library's cache (HF_DATASETS_CACHE, else HF_HOME/datasets)."""
    from gpt2common.hf import hf_home

    return os.environ.get("HF_DATASETS_CACHE", os.path.join(hf_home(), "datasets"))


def hf_cache_dirs() -> str:
    """Where a dataset name is looked for: the hub cache, then the `datasets` cache."""
    from gpt2common.hf import hub_cache_dir

    return f"{hub_cache_dir()} and {_datasets_cache()}"


def _walk(root: str) -> list[str]:
    return sorted(str(f) for f in Path(root).rglob("*") if f.is_file() or (f.is_symlink() and f.exists()))


def _saved_dataset(d: str) -> list[str] | None:
    """The Arrow files of a `datasets` save_to_disk dir in order (a DatasetDict: its train split)."""
    if os.path.isfile(os.path.join(d, "dataset_dict.json")):
        d = os.path.join(d, "train")
    state = os.path.join(d, "state.json")
    if not os.path.isfile(state):
        return None
    try:
        files = [f["filename"] for f in json.loads(Path(state).read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"input={d!r}: state.json of the saved dataset is corrupt") from None
    return [os.path.join(d, f) for f in files]


def input_paths(spec: str, key: str = "input") -> list[str]:
    """Every file `spec` names, in reading order. ConfigError naming `key` when there is none."""
    out: list[str] = []
    for part in [p for p in spec.split(",") if p] if "," in spec else [spec]:
        if (saved := _saved_dataset(part) if os.path.isdir(part) else None) is not None:
            out += saved
        elif os.path.isdir(part):
            files = [f for f in _walk(part) if _suffix(f)]
            if not files:
                raise ConfigError(f"{key}={part!r} is a folder with no {', '.join(SUFFIXES)} files")
            out += files
        elif os.path.isfile(part):
            out.append(part)
        elif glob.has_magic(part):
            files = sorted(f for f in glob.glob(part, recursive=True) if os.path.isfile(f) and _suffix(f))
            if not files:
                raise ConfigError(f"{key}={part!r} matches no {', '.join(SUFFIXES)} file")
            out += files
        elif (cached := _hf_cache_files(part)) is not None:
            out += cached
        elif os.path.exists(part):
            raise ConfigError(f"{key}={part!r} is not a regular file or folder")
        elif _looks_like_hub_name(part):
            raise ConfigError(f"{key}={part!r} does not exist, nor is it a dataset in the local HF cache "
                              f"({hf_cache_dirs()})")
        else:
            raise ConfigError(f"{key}={part!r} does not exist")
    return out


def _looks_like_hub_name(s: str) -> bool:
    from gpt2common.hf import HUB_ID

    return bool(HUB_ID.fullmatch(s)) and not _suffix(s)


def _text_pieces(path: str, raw: bool, warn) -> Iterator[str | bytes]:
    """A text file's content in blocks: bytes as they are (`raw`: the byte tokenizer takes any
    encoding), else UTF-8 decoded incrementally, invalid bytes replaced by U+FFFD with one
    `warn` naming the file and how many sequences were replaced."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    bad = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(PIECE_BYTES):
                if raw:
                    yield block
                    continue
                s = dec.decode(block)
                bad += s.count("\ufffd") - block.count("\ufffd".encode())
                if s:
                    yield s
            if not raw and (s := dec.decode(b"", final=True)):
                bad += s.count("\ufffd")
                yield s
        if bad and warn is not None:
            warn(f"input file {path!r} is not valid UTF-8 ({bad} undecodable sequences replaced by U+FFFD); "
                 "tokenizer=byte would keep the raw bytes")
    except OSError as e:
        raise ConfigError(f"input file {path!r} cannot be read ({e.strerror})") from None


def _field(row, text_key: str, label: str) -> str:
    if not isinstance(row, dict) or text_key not in row:
        raise ConfigError(f"{label}: no field text_key={text_key!r}")
    text = row[text_key]
    if not isinstance(text, str):
        raise ConfigError(f"{label}: field {text_key!r} is {type(text).__name__}, not a string")
    return text


def _jsonl_docs(path: str, text_key: str) -> Iterator[Doc]:
    try:
        if path.endswith(".gz"):
            raw = gzip.open(path, "rb")
        elif path.endswith(".zst"):
            import zstandard

            raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True)
        else:
            raw = open(path, "rb")
        with raw, io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="\n") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                label = f"{path}:{n}"
                try:
                    row = json.loads(line)
                except ValueError:
                    raise ConfigError(f"{label}: not a JSON object") from None
                yield Doc(label, iter((_field(row, text_key, label),)))
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise ConfigError(f"input file {path!r} is corrupt or unreadable ({_reason(e)})") from None
    except Exception as e:  # zstandard.ZstdError is no OSError
        if type(e).__name__ == "ZstdError":
            raise ConfigError(f"input file {path!r} is corrupt or unreadable ({_reason(e)})") from None
        raise


def _reason(e: BaseException) -> str:
    if getattr(e, "strerror", None):
        return e.strerror
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def _arrow_batches(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.endswith(".parquet"):
        yield from pq.ParquetFile(path).iter_batches(batch_size=ROW_BATCH)
        return
    with pa.memory_map(path) as src:
        try:
            reader = pa.ipc.open_stream(src)  # datasets writes the Arrow streaming format
        except pa.ArrowInvalid:
            src.seek(0)
            reader = pa.ipc.open_file(src)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
            return
        yield from reader


def _row_docs(path: str, text_key: str) -> Iterator[Doc]:
    import pyarrow as pa

    row = 0
    try:
        for batch in _arrow_batches(path):
            if text_key not in batch.schema.names:
                raise ConfigError(f"{path}: no column text_key={text_key!r} (columns: {', '.join(batch.schema.names)})")
            col = batch.column(text_key)
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                raise ConfigError(f"{path}: column {text_key!r} is {col.type}, not a string")
            for text in col.to_pylist():
                row += 1
                if text is None:
                    raise ConfigError(f"{path}:{row}: field {text_key!r} is null, not a string")
                yield Doc(f"{path}:{row}", iter((text,)))
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"input file {path!r} is corrupt or unreadable ({_reason(e)})") from None


def documents(paths: list[str], text_key: str = "text", raw: bool = False, warn=None) -> Iterator[Doc]:
    """Every document of `paths`, in order (files in the given order, rows in file order); `raw`:
    a text file's pieces are its bytes (for the byte tokenizer)."""
    for p in paths:
        suffix = _suffix(p)
        if suffix in ROW_SUFFIXES:
            yield from (_row_docs if suffix in (".parquet", ".arrow") else _jsonl_docs)(p, text_key)
        else:  # .txt, .md, or a file named directly whatever its suffix: one document
            yield Doc(p, _text_pieces(p, raw, warn))


def is_single_document(paths: list[str]) -> bool:
    """One text document: the tail split of its tokens stands in for a split by documents."""
    return len(paths) == 1 and _suffix(paths[0]) not in ROW_SUFFIXES
