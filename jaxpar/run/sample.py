"""`jaxpar sample`: autoregressive generation from a run's checkpoint, on one device or a mesh.

No KV cache: each new token re-runs the model on a fixed (1, W) buffer, W = prompt +
max_new_tokens capped at n_positions, so there is one compile. Causal attention makes
the padding after position i irrelevant to the logits at i. On a mesh the buffer is
repeated to one row per data replica / pipeline microbatch (`infer.make_next_logits`); the
sampling itself (temperature, top-k, the PRNG draw) runs on the host's first device from the
logits of row 0, so a fixed seed gives the same tokens on any mesh.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from gpt2common import data as data_lib
from gpt2common.grammar import ConfigError, parse_value
from jaxpar.run.options import SampleOptions


def sample_token(logits, temperature: float, top_k: int, key):
    """One token id from (V,) logits: argmax when temperature <= 0, else a draw from
    softmax(logits / temperature) restricted to the top_k largest logits (top_k <= 0: all)."""
    if temperature <= 0:
        return jnp.argmax(logits)
    # Shifted by the max first (the softmax is unchanged): logits / 1e-45 overflow to inf and the
    # draw is garbage, while (logits - max) / t only goes to -inf, leaving the argmax, the limit.
    logits = (logits - jnp.max(logits)) / temperature
    if top_k > 0:
        kth = jnp.sort(logits)[-min(top_k, logits.shape[-1])]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits)


def generate(cfg, params, prompt_ids: np.ndarray, max_new_tokens: int, temperature: float, top_k: int, seed: int,
             precision: str = "fp32", next_logits: Callable | None = None) -> np.ndarray:
    """Prompt + `max_new_tokens` sampled ids. `next_logits(params, buf (W,), pos) -> (V,)`
    defaults to the plain model on the default device (`infer.make_next_logits` for a mesh)."""
    from jaxpar.models import gpt2

    mc = cfg.model
    W = min(mc.n_positions, len(prompt_ids) + max_new_tokens)
    ids = list(int(i) for i in prompt_ids)
    if next_logits is None:
        next_logits = jax.jit(lambda p, buf, pos: gpt2.GPT2(mc, p, policy=precision)(buf[None])[0, pos])

    key = jax.random.PRNGKey(seed)
    for _ in range(max_new_tokens):
        window = ids[-W:]
        buf = np.zeros(W, np.int32)
        buf[: len(window)] = window
        logits = jnp.asarray(np.asarray(next_logits(params, buf, len(window) - 1)))
        sub = None
        if temperature > 0:
            key, sub = jax.random.split(key)
        ids.append(int(sample_token(logits, temperature, top_k, sub)))
    return np.asarray(ids, np.int32)


def tokenizer_source(run: str, cfg) -> tuple[data_lib.Tokenizer | None, str]:
    """(the tokenizer of a run, the GPT-2 tokenizer dir it was read from or ""): its prepared data
    (`<run>/data`, else `data=`), else, for a run made by `jaxpar convert hf=DIR`, the GPT-2
    tokenizer files (vocab.json + merges.txt) of that DIR. (None, "") when the run has neither."""
    def gpt2_dir(path: str) -> bool:
        return bool(path) and all(os.path.isfile(os.path.join(path, f)) for f in ("vocab.json", "merges.txt"))

    for prepared in (os.path.join(run, "data"), cfg.data):
        if prepared and data_lib.is_prepared(prepared):
            tok = data_lib.load_tokenizer(prepared)
            # raw text the run tokenized itself with tokenizer=<GPT-2 dir>: that dir is the source
            return tok, cfg.tokenizer if tok.kind == "gpt2-dir" and gpt2_dir(cfg.tokenizer) else ""
    init = cfg.init or ""
    if gpt2_dir(init):
        tok = data_lib.load_gpt2_tokenizer_dir(init)
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"checkpoint={run!r}: the tokenizer in {init} has {tok.vocab_size} tokens, more than "
                              f"model.vocab_size={cfg.model.vocab_size}")
        return tok, init
    return None, ""


def find_tokenizer(run: str, cfg):
    """`tokenizer_source`'s tokenizer, or the one-line error saying where it was looked for."""
    tok, _ = tokenizer_source(run, cfg)
    if tok is None:
        raise ConfigError(f"checkpoint={run!r}: cannot find the tokenizer (no prepared data in {run}/data, "
                          f"and init={cfg.init or ''!r} holds no vocab.json + merges.txt)")
    return tok


def run_sample(kv: dict, cfg) -> int:
    """kv: the sample options (checkpoint, prompt, ...); cfg: the run's config with the user's
    mesh / pipeline / precision overrides (validated, devices not yet set up)."""
    from jaxpar.parallel.mesh import setup_devices

    run = kv["checkpoint"]
    tok = find_tokenizer(run, cfg)
    d = SampleOptions()
    n = parse_value(int, kv.get("max_new_tokens", d.max_new_tokens), "max_new_tokens")
    temp = parse_value(float, kv.get("temperature", d.temperature), "temperature")
    top_k = parse_value(int, kv.get("top_k", d.top_k), "top_k")
    seed = parse_value(int, kv.get("seed", d.seed), "seed")
    if n <= 0:
        raise ConfigError(f"max_new_tokens={n} must be positive")
    if not 0 <= seed < 2**32:  # the PRNG key takes a 32-bit seed
        raise ConfigError(f"seed={seed} must be in [0, 2**32)")
    # argv holds undecodable bytes as surrogates (PEP 383): back to the bytes the user typed, which
    # the byte tokenizer takes as they are (a BPE one replaces them, with a warning)
    prompt = kv.get("prompt", d.prompt).encode("utf-8", "surrogateescape")
    ids = tok.encode(prompt, label="prompt")
    if len(ids) == 0:
        ids = tok.encode("\n")
    setup_devices(cfg.mesh)
    from jaxpar.run import infer

    runner = infer.build_runner(cfg, min_batch=True)
    params = runner.load(run)
    W = min(cfg.model.n_positions, len(ids) + n)
    step = infer.make_next_logits(runner, W)

    def next_logits(p, buf, pos):  # (V,) on the host; a NaN would sample token 0 forever
        logits = np.asarray(step(p, buf, pos))
        if not np.isfinite(logits).all():
            raise ConfigError(f"checkpoint={run!r}: the logits at position {pos} are not finite: the weights "
                              "are not usable")
        return logits

    out = generate(runner.cfg, params, ids, n, temp, top_k, seed, next_logits=next_logits)
    if jax.process_index() == 0:
        print(tok.decode(out))
    return 0
