"""The run directory `out=`: what a new run may write into, and what `resume=true` continues.

Rules (README "Reliability"):
* A new run goes into a missing or empty dir, or into the leftovers of a run that failed
  before its first checkpoint (only files a run writes, no step under `ckpt/`): nothing of
  value is lost, and the user need not delete it by hand. Anything else is refused.
* `resume=true` continues from the run's own `config.json`; the user's keys are applied on
  top, except those that would change the parameters' shapes or the data (refused).
* Nothing here writes: every check runs before the run's first byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from gpt2common.grammar import load_yaml, parse_value
from gpt2common.outdir import check_free, check_writable, entries
from jaxpar import config as C
from jaxpar.config import Config, ConfigError

CKPT_DIR = "ckpt"  # jaxpar.run.checkpoint.CKPT_DIR (not imported: that pulls in orbax and jax)
CONFIG_FILE = "config.json"
# What `jaxpar train` itself writes into a run dir (curves.png: `jaxpar plot`).
RUN_ENTRIES = {CONFIG_FILE, "metrics.jsonl", "data", "tb", CKPT_DIR, "curves.png"}
# Keys resume=true refuses to change: parameter shapes, the weights' origin, the token stream.
SHAPE_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")


def checkpoint_steps(out: str) -> list[int]:
    """Step dirs under `<out>/ckpt` (complete or not; orbax's temporaries have non-numeric names).
    A step dir is named str(step): ASCII digits. str.isdigit alone also takes '²' (int() raises:
    a ValueError traceback) and Arabic-Indic digits (counted as a step no checkpoint wrote)."""
    d = os.path.join(out, CKPT_DIR)
    if not os.path.isdir(d):
        return []
    return sorted(int(n) for n in os.listdir(d)
                  if n.isascii() and n.isdigit() and os.path.isdir(os.path.join(d, n)))


def is_restartable(out: str) -> bool:
    """True for the leftovers of a run that failed before its first checkpoint."""
    return set(entries(out)) <= RUN_ENTRIES and not checkpoint_steps(out)


def check_out_dir(cfg: Config, latest_step) -> tuple[int | None, bool]:
    """(step to resume from or None, True when a failed run's leftovers are started over).

    `latest_step(out)` returns the newest complete checkpoint step or None."""
    out = cfg.out
    check_writable(out)
    if cfg.resume:
        if not os.path.isdir(out):
            raise ConfigError(f"resume=true but out={out!r} does not exist")
        step = latest_step(out) if checkpoint_steps(out) else None
        if step is None:
            raise ConfigError(f"resume=true but out={out!r} holds no complete checkpoint"
                              + (" (start it over without resume=true)" if is_restartable(out) else ""))
        return step, False
    if os.path.isdir(out) and entries(out):
        if is_restartable(out):
            return None, True
        raise ConfigError(f"out={out!r} is not empty; pass resume=true to continue it or choose another out")
    return None, False


class _HFConfig(ValueError):
    """A transformers config.json (an object naming its `model_type`) where a run's should be."""


def _load_config(path: str) -> Config:
    """The Config saved in `path` (a run's config.json). Raises OSError when the file cannot be
    read, ValueError (not UTF-8, not JSON, a ConfigError from from_dict, _HFConfig), TypeError when
    it is not a saved Config, or RecursionError (JSON nested past the interpreter's stack: json is
    recursive)."""
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if isinstance(d, dict) and isinstance(d.get("model_type"), str):  # e.g. what `convert to_hf=` wrote
        raise _HFConfig(path)
    return C.from_dict(d)


def read_run_config(out: str) -> Config:
    """The saved config of the run in `out` (resume=true), or a one-line ConfigError."""
    if not os.path.isdir(out):
        raise ConfigError(f"resume=true but out={out!r} does not exist")
    path = os.path.join(out, CONFIG_FILE)
    try:
        return _load_config(path)
    except FileNotFoundError:
        raise ConfigError(f"resume=true but out={out!r} has no {CONFIG_FILE} (not a jaxpar run dir)") from None
    except OSError as e:  # a directory named config.json, no read permission
        raise ConfigError(f"resume=true but {path!r} cannot be read ({e.strerror})") from None
    except (ValueError, TypeError, RecursionError):  # ValueError: UnicodeDecodeError, JSONDecodeError, ConfigError
        raise ConfigError(f"resume=true but {path!r} is corrupt") from None


def run_config(checkpoint: str) -> Config:
    """The Config a run dir was trained with (its config.json), for the commands that read a
    run (`checkpoint=`), or ConfigError. No JAX."""
    try:
        return _load_config(os.path.join(checkpoint, CONFIG_FILE))
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: checkpoint= names a file
        raise ConfigError(f"checkpoint={checkpoint!r} has no {CONFIG_FILE} (not a jaxpar run dir)") from None
    except OSError as e:  # a directory named config.json, no read permission
        raise ConfigError(f"checkpoint={checkpoint!r}: {CONFIG_FILE} cannot be read ({e.strerror})") from None
    except _HFConfig:
        raise ConfigError(f"checkpoint={checkpoint!r} is an HF save_pretrained dir, not a jaxpar run dir: "
                          f"`jaxpar eval hf=` reads it, `jaxpar convert hf=` makes a run of it") from None
    except (ValueError, TypeError, RecursionError):  # ValueError: UnicodeDecodeError, JSONDecodeError, ConfigError
        raise ConfigError(f"checkpoint={checkpoint!r}: {CONFIG_FILE} is corrupt") from None


def _vocab_from_data(cfg: Config, given: dict) -> Config:
    """A prepared data dir whose vocab outgrows the preset's (a BPE corpus with model=gpt2-tiny)
    sets model.vocab_size to it, unless the user named model.vocab_size or init= (whose weights
    fix the vocab); a vocab the user set too small stays an error when the data is read."""
    from gpt2common import data as data_lib

    if "model.vocab_size" in given or cfg.init or not cfg.data or not data_lib.is_prepared(cfg.data):
        return cfg
    vocab = data_lib.read_meta(cfg.data)["vocab_size"]
    if vocab <= cfg.model.vocab_size:
        return cfg
    print(f"model.vocab_size={vocab}: the vocab of data={cfg.data!r} (the {cfg.model_name} preset has "
          f"{cfg.model.vocab_size})", file=sys.stderr)
    return C.validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab)))


def _tokenizer_from_init(cfg: Config, given: dict) -> Config:
    """init=DIR's own tokenizer for raw text (gpt2common.data.tokenizer_for_init), recorded in
    config.json, so a resume tokenizes alike."""
    from gpt2common import data as data_lib

    tok = data_lib.tokenizer_for_init(cfg.init, cfg.data, cfg.tokenizer, "tokenizer" in given)
    return cfg if tok == cfg.tokenizer else dataclasses.replace(cfg, tokenizer=tok)


def resolve_train(kv: dict, config_file: str | None, writer: bool = True) -> Config:
    """`jaxpar train` settings. With resume=true the run's own config.json is the base and only
    the keys given (YAML, then key=value) are applied; keys that change shapes or data are refused.
    A `writer` (train, not inspect or dry_run=true) is refused an out that a live run holds."""
    file_kv = load_yaml(config_file) if config_file else {}  # the one read of the YAML file
    given = {**file_kv, **kv}
    resume = parse_value(bool, given.get("resume", False), "resume")
    out = str(given.get("out", Config().out))
    # Before anything else reads the run: a live run's config and checkpoints are its own. Every
    # process of a job checks here, before joining the job, so before process 0 takes the lock.
    if writer and not parse_value(bool, given.get("dry_run", False), "dry_run"):
        check_free(out)
    if not resume:  # (resume=true refuses init= itself: the checkpoint holds the weights)
        check_init_model_keys(given)
        return _vocab_from_data(_tokenizer_from_init(C.resolve_kv(kv, base=None, file_kv=file_kv), given), given)
    saved = read_run_config(out)
    # The checkpoint holds the weights (init= is spent) and the plan was applied when the run began.
    base = C.Config(**{**{f: getattr(saved, f) for f in saved.__dataclass_fields__}, "init": "", "init_state": "",
                       "plan": "", "dry_run": False})
    cfg = C.resolve_kv(kv, base=base, file_kv=file_kv)
    for k in ("init", "init_state"):
        if given.get(k):
            raise ConfigError(f"{k}={given[k]!r} cannot be combined with resume=true (the checkpoint holds the weights)")
    changed = [(f"model.{k}", getattr(cfg.model, k), getattr(saved.model, k)) for k in SHAPE_KEYS
               if getattr(cfg.model, k) != getattr(saved.model, k)]
    changed += [(k, getattr(cfg, k), getattr(saved, k)) for k in ("data", "tokenizer") if getattr(cfg, k) != getattr(saved, k)]
    if changed:
        shown = ", ".join(f"{k}={new!r} (run has {old!r})" for k, new, old in changed)
        raise ConfigError(f"resume=true cannot change {shown}: start a new run in another out")
    return _sequence_parallel_on(cfg, given)


def _sequence_parallel_on(cfg: Config, given: dict) -> Config:
    """A resume restores onto any mesh: a run's inherited tensor.sequence_parallel=true that the
    new mesh cannot take (no tensor axis, or one seq_len does not divide) is turned off, and said;
    it moves where the residual stream lives, not what is computed. Given anew, it stays (and the
    layout refuses it with its reason). A -1 tensor axis is resolved later: left to the layout."""
    from jaxpar.parallel.layout import sequence_parallel_problem

    if not cfg.tensor.sequence_parallel or "tensor.sequence_parallel" in given or cfg.mesh.tensor == -1:
        return cfg
    if (why := sequence_parallel_problem(cfg.mesh, cfg.train.seq_len)) is None:
        return cfg
    print(f"tensor.sequence_parallel=false: the run used sequence parallelism, which this mesh cannot take "
          f"({why.removeprefix('tensor.sequence_parallel=true ')}); resumed without it", file=sys.stderr)
    return C.validate(dataclasses.replace(cfg, tensor=dataclasses.replace(cfg.tensor, sequence_parallel=False)))


def check_init_model_keys(given: dict) -> None:
    """`model=` / `model.*` keys given beside init= that disagree with its weights are refused
    (gpt2common.hf.check_init_model_keys), judged before validation, which would otherwise judge
    them against the default preset and blame the wrong thing. `given`: the YAML file's keys, then
    key=value's."""
    from gpt2common import hf

    hf.check_init_model_keys(given, lambda weights, kv: C.apply_overrides(C.Config(model=weights), kv).model)
