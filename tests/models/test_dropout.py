"""model.dropout (HF resid/embd/attn pdrop): where it is applied and what the GPU attention choice does
with it. Reference: inverted dropout's closed form (kept x / (1 - rate), dropped 0) and the unchunked
MLP; gpt2-tiny shapes, one layer, fp32, eager (well under a second each)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import PRESETS
from jaxpar.models import gpt2
from jaxpar.models.attention_choice import Accelerator
from jaxpar.models.precision import get_policy

RATE = 0.25
MC = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=1, dropout=RATE)
PARAMS = jax.tree.map(jnp.asarray, gpt2.init_params(MC, 0))
TOK = jnp.asarray(np.random.default_rng(0).integers(0, MC.vocab_size, (2, 16)), jnp.int32)


def test_embedding_dropout_is_inverted_dropout_at_the_configured_rate():
    """embed(tokens, key): each of the (2, 16, 128) values of wte[tok] + wpe[:T] is either 0 or
    divided by 1 - rate, and about `rate` of them are 0 (4096 draws: 0.25 +- 5 sigma = 0.034)."""
    out = np.asarray(gpt2.GPT2(MC, PARAMS).embed(TOK, jax.random.key(1)))
    x = np.asarray(PARAMS["wte"]["weight"])[np.asarray(TOK)] + np.asarray(PARAMS["wpe"]["weight"])[:16][None]
    dropped = out == 0
    assert abs(dropped.mean() - RATE) < 0.034, dropped.mean()
    np.testing.assert_allclose(out[~dropped], (x / (1 - RATE))[~dropped], rtol=1e-6)


def test_chunked_mlp_drops_what_the_unchunked_mlp_drops():
    """train.mlp_chunks changes memory only: with dropout and one key, the chunked MLP's output equals
    the unchunked one's, dropped entries included (the residual dropout is drawn on the (B, T, D)
    output, the same shape either way)."""
    layer = jax.tree.map(lambda a: a[0], PARAMS["h"]["mlp"])
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 16, MC.n_embd)), jnp.float32)
    key = jax.random.key(2)
    one, four = (np.asarray(gpt2.MLP(MC, get_policy("fp32"), layer, chunks=k)(x, key)) for k in (1, 4))
    assert abs((one == 0).mean() - RATE) < 0.034  # dropout is on
    np.testing.assert_array_equal(one == 0, four == 0)
    np.testing.assert_allclose(four, one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dropout, precision, impl", [
    (0.0, "bf16", "cudnn"),  # the flash kernel where it applies
    (0.1, "bf16", "einsum"),  # it has no attention dropout: jaxpar's core, which drops the probs
    (0.0, "fp32", "einsum"),
])
def test_auto_attention_on_gpu_takes_cudnn_only_without_dropout(dropout, precision, impl):
    h100 = Accelerator("gpu", True, (9, 0), 91000)
    assert gpt2.attention_impl("auto", get_policy(precision), dropout, 64, h100) == impl


def test_fsdp_with_dropout_keeps_the_auto_sharded_step():
    """jaxpar.parallel.fsdp's explicit ZeRO-3 loss has no dropout (it asserts key is None: per-device
    draws would differ from the auto path's one mask for the global batch), so fsdp > 1 with
    model.dropout > 0 must keep the auto-sharded step. A stand-in mesh: `applies` reads its shape."""
    from types import SimpleNamespace

    from jaxpar.config import Config
    from jaxpar.parallel import fsdp

    mesh = SimpleNamespace(shape={"data": 1, "fsdp": 2, "tensor": 1, "pipe": 1})
    assert fsdp.applies(Config(model=dataclasses.replace(MC, dropout=0.0)), mesh)
    assert not fsdp.applies(Config(model=MC), mesh)  # dropout 0.25
    assert not fsdp.applies(Config(model=dataclasses.replace(MC, dropout=0.0)), SimpleNamespace(shape={"fsdp": 1}))
