"""Cut a long document into segments whose token ids, concatenated, are the ids of the whole.

`jaxpar prepare` encodes a document of any size (a 1 GB text file without a newline) in
bounded memory: it encodes at most `SEG_CHARS` characters at a time. A cut is safe where the
tokenizer itself never merges across it. An HF tokenizer runs normalizer -> pre-tokenizer ->
model per pre-token, and GPT-2's pre-tokenizer is a regex with one character of look-ahead, so
whether a position is a boundary is decided by its neighbourhood. A cut at k is taken when, on a
window of `WINDOW` characters either side, (1) k is a pre-token boundary and (2) encoding the two
halves gives the ids of encoding the window. Candidates are whitespace -> non-whitespace
transitions, searched backwards from the limit; the byte tokenizer cuts anywhere.

Held to "ids of the whole" by tests/run/test_prepare_stream.py's property test (hypothesis),
whose texts draw whitespace runs, long words, digits, punctuation, special tokens and non-ASCII.
"""

from __future__ import annotations

from collections.abc import Iterator

SEG_CHARS = 1 << 20  # characters encoded at a time
WINDOW = 256         # characters either side of a candidate cut that are checked
MAX_TRIES = 64       # candidates tried before a hard cut


def _encode(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def _boundaries(hf, text: str) -> set[int]:
    pre = hf.pre_tokenizer
    if pre is None:
        return set()
    return {end for _, (_, end) in pre.pre_tokenize_str(text)}


def safe_cut(hf, buf: str, limit: int) -> int | None:
    """A position in (0, limit] where `buf` can be cut without changing its ids, or None."""
    tries = 0
    k = limit
    lo = max(1, limit - 64 * WINDOW)
    while k > lo and tries < MAX_TRIES:
        # the next whitespace -> non-whitespace transition at or before k
        while k > lo and not (buf[k - 1].isspace() and not buf[k].isspace()):
            k -= 1
        if k <= lo:
            break
        tries += 1
        # GPT-2 glues one leading space to the word after it: cut before that space
        cut = k - 1 if buf[k - 1] == " " and k - 1 > lo else k
        a, b = max(0, cut - WINDOW), min(len(buf), cut + WINDOW)
        win = buf[a:b]
        if (cut - a) in _boundaries(hf, win) and _encode(hf, win[: cut - a]) + _encode(hf, win[cut - a:]) == _encode(hf, win):
            return cut
        k -= 1
    return None


def segments(pieces: Iterator[str], hf, seg_chars: int = SEG_CHARS, warn=None) -> Iterator[str]:
    """The document `"".join(pieces)` as segments of at most about `seg_chars` characters, each
    cut where `safe_cut` finds it safe. `hf`: a `tokenizers.Tokenizer`, or None (the byte
    tokenizer: any cut is safe). `warn(msg)` is told of a hard cut (no safe cut within reach)."""
    buf = None  # str, or bytes for the byte tokenizer (it keeps any encoding as is)
    for piece in pieces:
        buf = piece if buf is None else buf + piece
        while len(buf) > seg_chars + WINDOW:
            cut = seg_chars if hf is None else safe_cut(hf, buf, seg_chars)
            if cut is None:
                cut = seg_chars
                if warn is not None:
                    warn(f"no safe token boundary in the {64 * WINDOW} characters before character {seg_chars}; "
                         "the ids at this cut may differ from encoding the document whole")
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf
