"""model.attention: jax.nn.dot_product_attention (xla) equals jaxpar's einsum core, and bad choices are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import PRESETS, ConfigError, resolve
from jaxpar.models import gpt2
from jaxpar.models.precision import get_policy
from jaxpar.train import check_model_vs_mesh

MC = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=1, n_embd=32, n_head=2, vocab_size=64)


def _attention(attention: str) -> gpt2.Attention:
    mc = dataclasses.replace(MC, attention=attention)
    p = jax.tree.map(jnp.asarray, gpt2.init_params(mc, 0))["h"]["attn"]
    layer = jax.tree.map(lambda a: a[0], p)  # unstack the single layer
    return gpt2.Attention(mc, get_policy("fp32"), layer)


def test_xla_dot_product_attention_equals_einsum_core_fp32():
    ref, xla = _attention("auto"), _attention("xla")
    assert (ref.impl, xla.impl) == ("einsum", "xla")  # CPU: auto = jaxpar's einsum core
    q, k, v, g = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 16, 2, 16)), jnp.float32)
                  for i in range(4))

    def out_and_grads(core):  # output (B, T, N, Hd) and its vjp with g for (q, k, v), one compile
        def f(q, k, v):
            o, vjp = jax.vjp(lambda *a: core(*a, None), q, k, v)
            return o, vjp(g)
        return jax.jit(f)(q, k, v)

    (o_ref, d_ref), (o_xla, d_xla) = out_and_grads(ref._core), out_and_grads(xla._sdpa)
    assert float(jnp.abs(o_ref).max()) > 0.1  # a real contraction, not zeros
    for a, b in zip((o_xla, *d_xla), (o_ref, *d_ref), strict=True):
        assert float(jnp.abs(a - b).max()) <= 1e-6 * float(jnp.abs(b).max())


@pytest.mark.parametrize("args,msg", [
    (["model.attention=flash"], "model.attention='flash' must be one of auto, xla, cudnn"),
    (["model.attention=xla", "model.dropout=0.1"],
     "model.attention=xla has no attention dropout (model.dropout=0.1); use model.attention=auto"),
])
def test_attention_choice_errors(args, msg):
    with pytest.raises(ConfigError) as e:
        resolve(["model=gpt2-tiny", *args])
    assert str(e.value) == msg


def test_cudnn_refused_without_gpu():
    cfg = resolve(["model=gpt2-tiny", "model.attention=cudnn"])
    with pytest.raises(ConfigError) as e:
        check_model_vs_mesh(cfg.model, cfg)
    assert str(e.value) == ("model.attention=cudnn needs a GPU (this backend: cpu); "
                            "use model.attention=auto or xla")
