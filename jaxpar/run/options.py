"""The keys of the commands that are not `jaxpar train` settings (prepare, eval, sample, convert,
plot, launch): their names, types, defaults and meanings, in one place. The commands parse
their arguments against these dataclasses and `jaxpar <command> --help` prints them
(`jaxpar.run.help`). No JAX here: the CLI reads them before any device exists.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from gpt2common.grammar import setting


@dataclass(frozen=True)
class PrepareOptions:
    input: str = setting("", "files, folders or globs (comma-separated) of .txt .md .jsonl .jsonl.gz .jsonl.zst "
                             ".parquet .arrow, a saved HF dataset dir, or a dataset name in the local HF cache; "
                             "empty: built-in tiny Shakespeare")
    out: str = setting("", "new directory for meta.json and the token shards (required); an unfinished "
                           "prepare there is continued")
    tokenizer: str = setting("byte", "byte (256 ids) | bpe (trained here, 4096 ids) | a tokenizer dir "
                                     "(tokenizer.json, or vocab.json + merges.txt) | a tokenizer.json | a hub "
                                     "name in the local HF cache")
    text_key: str = setting("text", "the field of a JSONL line / Parquet or Arrow row that holds its text")
    workers: int = setting(0, "tokenizer processes; 0: the cores this process may use")
    val_fraction: float = setting(0.0005, "fraction of the documents (seeded) that are validation; a "
                                          "one-document input keeps its last 10% of tokens")
    seed: int = setting(0, "seed of the validation documents")
    shard_tokens: int = setting(100_000_000, "tokens per shard (a shard closes at the next document end)")


@dataclass(frozen=True)
class EvalOptions:
    checkpoint: str = setting("", "run directory to evaluate (this or hf=)")
    hf: str = setting("", "HF save_pretrained dir to evaluate (this or checkpoint=)")
    data: str = setting("", "prepared dir (its val.bin) or a .bin token file; with checkpoint= it defaults to the "
                            "run's own (<run>/data, else its config's data=), with hf= it is required")


@dataclass(frozen=True)
class SampleOptions:
    checkpoint: str = setting("", "run directory to sample from (required)")
    prompt: str = setting("\n", "text the generation continues")
    max_new_tokens: int = setting(100, "tokens to generate")
    temperature: float = setting(0.8, "softmax temperature; <= 0: greedy (argmax)")
    top_k: int = setting(40, "draw from the k most likely tokens only; <= 0: all")
    seed: int = setting(0, "seed of the draws (the same tokens on any mesh)")


@dataclass(frozen=True)
class ConvertOptions:
    hf: str = setting("", "HF save_pretrained dir to import (with out=)")
    out: str = setting("", "new run directory for the imported weights (with hf=)")
    checkpoint: str = setting("", "run directory to export (with to_hf=)")
    to_hf: str = setting("", "new dir for config.json, model.safetensors, tokenizer and generation_config.json")
    to_state: str = setting("", "new dir for the run's training state (with checkpoint=): weights, AdamW "
                            "moments, step; docs/state_format.md")
    step: int = setting(0, "with to_state=: the checkpoint step to write; 0: the newest")


@dataclass(frozen=True)
class PlotOptions:
    run: str = setting("", "run directory whose metrics.jsonl is plotted (required)")
    out: str = setting("", "PNG path; empty: <run>/curves.png")


@dataclass(frozen=True)
class LaunchOptions:
    nprocs: int = setting(0, "local processes to start (required, >= 1)")
    port: int = setting(0, "coordinator port on 127.0.0.1; 0: a free one")
    grace: int = setting(10, "seconds the others get after one process fails, before SIGKILL")


def names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def default(cls, name: str):
    """The default of option `name` of `cls` (its field default)."""
    return next(f.default for f in fields(cls) if f.name == name)


@dataclass(frozen=True)
class BisectOptions:
    """`jaxpar bisect A B` or `jaxpar bisect a=A b=B`: each a run description, one quoted string."""
    a: str = setting("", "first run: 'jaxpar KEY=VALUE...' | 'torchref strategy=single [KEY=VALUE...]' | "
                         "'hf=DIR [KEY=VALUE...]' (required)")
    b: str = setting("", "second run, the reference, in the same grammar (required)")


# The keys eval and sample take once (gpt2common.grammar.parse_kv's `once`: their inputs and options;
# config overrides after them keep last-wins). prepare, convert and plot take every key once.
ONCE_KEYS = {"eval": names(EvalOptions), "sample": names(SampleOptions)}
