"""The tokenizer half of an HF export: `tokenizer.json` + `tokenizer_config.json` that
`transformers.AutoTokenizer.from_pretrained(dir)` loads as a PreTrainedTokenizerFast giving the
very ids the run trained on (`gpt2common.data.Tokenizer`), plus, when the run's tokenizer came
from a GPT-2 tokenizer dir, that dir's `vocab.json` and `merges.txt`.

The byte tokenizer (id = byte value, 256 ids) has no file of its own; it is written as a BPE with
GPT-2's byte-to-printable-character alphabet and no merges, behind the ByteLevel pre-tokenizer
(no regex split, no prefix space) and decoder: encoding maps each UTF-8 byte to its id, decoding
maps ids back to bytes and then to text with invalid sequences replaced by U+FFFD, as
`Tokenizer.decode` does. Only the `tokenizers` library is needed, not transformers.
"""

from __future__ import annotations

import json
import os
import shutil

from gpt2common.data import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GPT2_FILES = ("vocab.json", "merges.txt")
EOT = "<|endoftext|>"  # GPT-2's end-of-text token, present in GPT-2 tokenizer dirs


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (openai/gpt-2 encoder.py), which the
    `tokenizers` ByteLevel pre-tokenizer and decoder use: printable Latin-1 bytes stand for
    themselves, the other 68 bytes map to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """A `tokenizers.Tokenizer` whose ids are the UTF-8 bytes of the text (id b <-> byte b)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def save_tokenizer(path: str, tok: Tokenizer, model_max_length: int, source_dir: str = "") -> list[str]:
    """Write the tokenizer files of `tok` into `path`; `source_dir`: the GPT-2 tokenizer dir it was
    read from, whose vocab.json and merges.txt go along. Returns the names written."""
    hf_tok = byte_tokenizer() if tok.kind == "byte" else tok._hf
    if hasattr(hf_tok, "_tokenizer"):  # tokenizers' ByteLevelBPETokenizer wraps the Tokenizer it saves
        hf_tok = hf_tok._tokenizer
    hf_tok.save(os.path.join(path, TOKENIZER_FILE))
    written = [TOKENIZER_FILE, CONFIG_FILE]
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False}
    if hf_tok.token_to_id(EOT) is not None:  # GPT-2's convention: <|endoftext|> is bos, eos and unk
        conf.update(bos_token=EOT, eos_token=EOT, unk_token=EOT)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(conf, f, indent=2)
    if source_dir and all(os.path.isfile(os.path.join(source_dir, n)) for n in GPT2_FILES):
        for name in GPT2_FILES:
            shutil.copyfile(os.path.join(source_dir, name), os.path.join(path, name))
        written += GPT2_FILES
    return written
