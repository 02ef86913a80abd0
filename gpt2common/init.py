"""The numpy initialiser both frameworks start from: `init_params(cfg, seed)` gives the exact
float32 weights of `jaxpar train` and of `torchref train` (via `gpt2common.hf.to_hf_state_dict`).

Shapes follow jaxpar's stacked layout (jaxpar/models/gpt2.py's docstring): L layers, D=n_embd,
N heads, Hd=head_dim, F=4D, V vocab, P positions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpt2common.model import ModelConfig

Params = dict[str, Any]


def param_shapes(cfg: ModelConfig) -> Params:
    """Shape tuple of every parameter, same nested dict as the params."""
    L, D, N, Hd, V, P = cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.vocab_size, cfg.n_positions
    F = 4 * D
    block = {
        "ln_1": {"weight": (D,), "bias": (D,)},
        "attn": {"c_attn": {"weight": (D, 3, N, Hd), "bias": (3, N, Hd)},
                 "c_proj": {"weight": (N, Hd, D), "bias": (D,)}},
        "ln_2": {"weight": (D,), "bias": (D,)},
        "mlp": {"c_fc": {"weight": (D, F), "bias": (F,)}, "c_proj": {"weight": (F, D), "bias": (D,)}},
    }
    return {
        "wte": {"weight": (V, D)},
        "wpe": {"weight": (P, D)},
        "h": _map(lambda s: (L, *s), block),
        "ln_f": {"weight": (D,), "bias": (D,)},
    }


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """The shared numpy initialiser (jaxpar and torchref start from these exact weights).

    HF GPT-2 init: weights and embeddings ~ N(0, 0.02); the two residual projections
    (attn.c_proj, mlp.c_proj) ~ N(0, 0.02/sqrt(2L)); biases 0; LayerNorm weight 1.
    Draws happen in sorted-path order from one numpy Generator, float32. A path is written
    `['h']['attn']['c_attn']['weight']` (jax.tree_util.keystr's spelling, which fixed the order
    when this lived in jaxpar; tests/models/test_shared_boundary.py checks the weights are unchanged).
    Dicts come back with sorted keys, as a jax tree map returns them.
    """
    rng = np.random.default_rng(seed)
    values = {}
    for name, shape in sorted(_leaves(param_shapes(cfg))):
        if "ln_" in name:
            v = np.ones(shape, np.float32) if "weight" in name else np.zeros(shape, np.float32)
        elif name.endswith("['bias']"):
            v = np.zeros(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if "c_proj" in name else 0.02
            v = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)
        values[name] = v
    return _build(param_shapes(cfg), values, "")


def _map(fn, tree):
    return {k: _map(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _leaves(tree, prefix: str = ""):
    """(path string, leaf) pairs; the path spelled as jax.tree_util.keystr spells dict keys."""
    for k, v in tree.items():
        path = f"{prefix}[{k!r}]"
        if isinstance(v, dict):
            yield from _leaves(v, path)
        else:
            yield path, v


def _build(tree, values, prefix):
    return {k: _build(tree[k], values, f"{prefix}[{k!r}]") if isinstance(tree[k], dict) else values[f"{prefix}[{k!r}]"]
            for k in sorted(tree)}
