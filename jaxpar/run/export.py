"""`jaxpar convert checkpoint=<run> to_hf=<dir>`: a run as a transformers model directory.

Written: config.json + model.safetensors (gpt2common.hf), the run's tokenizer (tokenizer.json +
tokenizer_config.json for `AutoTokenizer`, and vocab.json + merges.txt when the run read a GPT-2
tokenizer dir; gpt2common.hf_tokenizer) and generation_config.json (jaxpar sample's defaults).
Every file gets the mode the umask gives a new file, as save_pretrained's do. The checks (a
readable run, an empty writable target, a tokenizer that fits) run before the first byte.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from gpt2common import hf, hf_tokenizer
from gpt2common.outdir import check_writable, make_out
from jaxpar.config import Config, ConfigError
from jaxpar.run.options import SampleOptions

GENERATION_FILE = "generation_config.json"


def check_target(to_hf: str) -> None:
    """to_hf= must be creatable and empty (an export never mixes with other files)."""
    check_writable(to_hf, "to_hf")
    if os.path.isdir(to_hf) and os.listdir(to_hf):
        raise ConfigError(f"to_hf={to_hf!r} is not empty")


def export_hf(checkpoint: str, to_hf: str, cfg: Config, load_params: Callable[[], dict]) -> list[str]:
    """Write the HF dir of the run `checkpoint` (its config `cfg`; `load_params()` reads its
    weights) into `to_hf`, which `check_target` accepted; returns the names written, sorted."""
    import json

    from jaxpar.run.sample import tokenizer_source

    tok, source_dir = tokenizer_source(checkpoint, cfg)
    params = load_params()
    make_out(to_hf, "to_hf")  # its first write, after the checkpoint is read: save_hf's makedirs only finds it
    hf.save_hf(to_hf, cfg.model, params)
    if tok is None:  # e.g. a run converted from an HF dir that held weights only
        sys.stderr.write(f"warning: checkpoint={checkpoint!r} names no tokenizer (no prepared data, no vocab.json + "
                         f"merges.txt in init=): {to_hf} holds the model only\n")
    else:
        hf_tokenizer.save_tokenizer(to_hf, tok, cfg.model.n_positions, source_dir)
    d = SampleOptions()
    with open(os.path.join(to_hf, GENERATION_FILE), "w") as f:
        json.dump(hf.generation_config_dict(cfg.model, d.temperature, d.top_k, d.max_new_tokens), f, indent=2)
    return sorted(os.listdir(to_hf))
