"""gpt2common, the package jaxpar and torchref share, stays free of jax and torch (a fresh interpreter
importing all of it loads neither), and the numpy initialiser that moved there from
jaxpar/models/gpt2.py gives the very weights it gave before, bit for bit."""

import hashlib
import json
import subprocess
import sys

import numpy as np

from gpt2common.init import init_params, param_shapes
from gpt2common.model import PRESETS, ModelConfig

HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "torch", "transformers", "jaxpar", "torchref")


def test_gpt2common_imports_neither_jax_nor_torch():
    code = ("import sys, json, pkgutil, importlib, gpt2common; "
            "mods = [m.name for m in pkgutil.walk_packages(gpt2common.__path__, 'gpt2common.')]; "
            "[importlib.import_module(m) for m in mods]; "
            f"print(json.dumps([mods, sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    mods, heavy = json.loads(r.stdout)
    assert {"gpt2common.grammar", "gpt2common.model", "gpt2common.init", "gpt2common.hf", "gpt2common.data",
            "gpt2common.outdir", "gpt2common.corpus"} <= set(mods)
    assert heavy == []


def _digest(params) -> str:
    """sha256 over (path, shape, bytes) of every leaf in sorted-key order, paths spelled as
    jax.tree_util.keystr spells them (the digests below were taken from jaxpar's jax-based init)."""
    h = hashlib.sha256()

    def walk(tree, prefix):
        for k in sorted(tree):
            if isinstance(tree[k], dict):
                walk(tree[k], f"{prefix}[{k!r}]")
            else:
                x = tree[k]
                h.update(f"{prefix}[{k!r}]".encode())
                h.update(str(x.shape).encode())
                h.update(np.ascontiguousarray(x).tobytes())

    walk(params, "")
    return h.hexdigest()


def test_init_is_bit_identical_to_jaxpars_former_init():
    tiny = init_params(PRESETS["gpt2-tiny"], 0)
    assert _digest(tiny) == "a2742aee5f9bc7431b95044a47a3563a7ea1d5f04b5d0c9bd2f6900e49f964e4"
    odd = ModelConfig(n_layer=3, n_embd=64, n_head=2, vocab_size=300, n_positions=64)
    assert _digest(init_params(odd, 7)) == "bbed5746d1e4815f9fa7a3333b4c3a4dde6e41f1b26031cb21b39e837b790c33"
    # keys come back sorted (as a jax tree map returns them), leaves float32 of param_shapes' shapes
    assert list(tiny) == ["h", "ln_f", "wpe", "wte"] and list(tiny["h"]) == ["attn", "ln_1", "ln_2", "mlp"]
    assert tiny["h"]["attn"]["c_attn"]["weight"].shape == param_shapes(PRESETS["gpt2-tiny"])["h"]["attn"]["c_attn"]["weight"]
    assert tiny["wte"]["weight"].dtype == np.float32
