"""GPT-2 model: presets, parameter counts and logits against HF transformers, HF round trip."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cli_helpers import run

from gpt2common import hf
from jaxpar.config import PRESETS, ModelConfig
from jaxpar.models import gpt2
from jaxpar.tolerances import BF16_LOGITS_REL

torch = pytest.importorskip("torch", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")
transformers = pytest.importorskip("transformers", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")

# HF GPT2LMHeadModel parameter counts (tied lm_head counted once).
HF_COUNTS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_counts_match_hf(name):
    cfg = PRESETS[name]
    shapes = gpt2.param_shapes(cfg)
    n = int(sum(np.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))))
    assert n == cfg.num_params()
    if name in HF_COUNTS:
        assert n == HF_COUNTS[name]
    else:  # gpt2-tiny: build the HF model itself (small) and count
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf.hf_config_dict(cfg)))
        assert n == sum(p.numel() for p in m.parameters()) == 462_336


def test_hf_config_counts_gpt2():
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf.hf_config_dict(PRESETS["gpt2-tiny"])))
    assert m.config.tie_word_embeddings and m.config.activation_function == "gelu_new"


# Odd head count, vocab not a power of two.
ODD = ModelConfig(n_layer=3, n_embd=60, n_head=5, vocab_size=101, n_positions=40)


def test_logits_match_hf_through_convert(tmp_path):
    """Random tiny model -> HF dir -> `jaxpar convert` -> logits equal HF torch's (fp32, <= 1e-5)."""
    params = gpt2.init_params(ODD, seed=3)
    hf.save_hf(tmp_path / "hf", ODD, params)
    r = run(["convert", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}"])
    assert r.returncode == 0, r.stderr
    from jaxpar.run.commands import load_model

    cfg, loaded = load_model(str(tmp_path / "run"))
    assert cfg.model == ODD
    toks = np.random.default_rng(0).integers(0, ODD.vocab_size, (3, 40))
    m = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ref = m(torch.tensor(toks)).logits.numpy()
    got = np.asarray(gpt2.GPT2(ODD, loaded)(jnp.asarray(toks, jnp.int32)))
    assert got.shape == ref.shape == (3, 40, 101)
    assert np.abs(got - ref).max() <= 1e-5


def test_hf_round_trip_is_exact(tmp_path):
    """HF dir -> jaxpar run dir -> HF dir reproduces every tensor bit for bit."""
    from safetensors.numpy import load_file

    hf.save_hf(tmp_path / "a", ODD, gpt2.init_params(ODD, seed=5))
    assert run(["convert", f"hf={tmp_path / 'a'}", f"out={tmp_path / 'run'}"]).returncode == 0
    r = run(["convert", f"checkpoint={tmp_path / 'run'}", f"to_hf={tmp_path / 'b'}"])
    assert r.returncode == 0, r.stderr
    a, b = load_file(tmp_path / "a" / hf.WEIGHTS), load_file(tmp_path / "b" / hf.WEIGHTS)
    assert sorted(a) == sorted(b) and len(a) == 4 + 12 * ODD.n_layer
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads((tmp_path / "b" / "config.json").read_text())


def test_bf16_logits_close_to_fp32():
    """bf16 compute keeps fp32 logits; error bounded by a few bf16 ulps of the activations."""
    params = gpt2.init_params(ODD, seed=1)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, 101, (2, 16)), jnp.int32)
    l32 = gpt2.GPT2(ODD, params, policy="fp32")(toks)
    l16 = gpt2.GPT2(ODD, params, policy="bf16")(toks)
    assert l16.dtype == jnp.float32
    # bound: jaxpar/tolerances.py "model.bf16.logits" (sqrt(2 + L) bf16 roundings; measured 3.2e-3)
    assert float(jnp.abs(l16 - l32).max()) <= BF16_LOGITS_REL * float(jnp.abs(l32).max())


def test_init_is_hf_distribution():
    cfg = PRESETS["gpt2-tiny"]
    p = gpt2.init_params(cfg, 0)
    assert np.array_equal(p["h"]["ln_1"]["weight"], np.ones((2, 128), np.float32))
    assert not p["h"]["mlp"]["c_fc"]["bias"].any()
    assert abs(p["wte"]["weight"].std() - 0.02) < 0.001
    assert abs(p["h"]["mlp"]["c_proj"]["weight"].std() - 0.02 / np.sqrt(4)) < 0.001
    q = gpt2.init_params(cfg, 0)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)))


def test_layer_norm_epsilon_reaches_every_layernorm():
    """model.layer_norm_epsilon off its default (1e-3; activations at init have variance ~4e-4, so eps
    moves every LayerNorm's output by ~100%): logits equal HF torch's built with the same eps (fp32,
    <= 1e-5), ln_1, ln_2 and ln_f alike."""
    import dataclasses

    from torchref import model as tm

    cfg = dataclasses.replace(ODD, n_layer=1, layer_norm_epsilon=1e-3)
    params = gpt2.init_params(cfg, seed=3)
    m = tm.build_model(hf.hf_config_dict(cfg), hf.to_hf_state_dict(cfg, params)).eval()
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        ref = m(torch.tensor(toks)).logits.numpy()
    got = np.asarray(gpt2.GPT2(cfg, jax.tree.map(jnp.asarray, params))(jnp.asarray(toks, jnp.int32)))
    assert np.abs(got - ref).max() <= 1e-5
