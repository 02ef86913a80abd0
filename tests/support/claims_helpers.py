"""Code shared by the test_claims_* / test_policy_* files.

`xla_cache(dir)`: a persistent XLA compilation cache for the duration of a module fixture, so
that runs compiling the same step (a run and its resume) compile it once. Compiles dominate
these tests on a 2-core machine (~10 s for gpt2-tiny's train step under load; a cache hit ~0.1 s).
The previous settings are restored afterwards, so other test files see no cache.

`hf_model(cfg, params)`: HF transformers' GPT2LMHeadModel on jaxpar weights (eval mode, fp32),
the independent reference for losses and logits.
"""

from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def xla_cache(path: str):
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.set_cache_dir(str(path))
    cc.reset_cache()
    try:
        yield
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        cc.reset_cache()


def hf_model(model_cfg, params):
    """GPT2LMHeadModel (transformers) holding `params` (jaxpar layout), eval mode (no dropout)."""
    import torch
    import transformers

    from gpt2common import hf

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf.hf_config_dict(model_cfg))).eval()
    sd = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in hf.to_hf_state_dict(model_cfg, params).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(m == "lm_head.weight" or m.endswith(".attn.bias") for m in missing), missing
    model.tie_weights()
    return model


def hf_mean_nll(model, batches) -> float:
    """Mean token cross-entropy (float64 mean of fp32 per-token values) over [(x, y), ...] int arrays."""
    import torch

    nll = []
    with torch.no_grad():
        for x, y in batches:
            logits = model(torch.from_numpy(np.asarray(x, np.int64))).logits
            nll.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(
                np.asarray(y, np.int64)).reshape(-1), reduction="none").numpy())
    return float(np.concatenate(nll).astype(np.float64).mean())
