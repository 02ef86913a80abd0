"""fp32 on XLA:CPU: every dot of the train step is a YNNPACK dot, with the values of jax's autodiff.

jax's own transpose of a weight matmul (`btd,df->btf` w.r.t. the weight) and of the attention
core's `dK` reach XLA:CPU as dots it runs in Eigen, 1.3-3x slower than YNNPACK here, after
transposed copies (jaxpar/models/precision.py). The fp32 policy on CPU therefore runs the weight matmuls
through `mixed_einsum` and the attention core through `mixed_attention.causal_attention`, whose
backward dots XLA makes canonical. Pinned here: the dot census of the compiled fp32 step, and
loss + every gradient equal to the plain path (jnp.einsum + autodiff, what GPU runs) to fp32
summation order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar.models.precision as precision
from jaxpar.config import PRESETS
from jaxpar.models import gpt2, mixed_attention
from jaxpar.models.mixed_attention import causal_attention
from jaxpar.tolerances import FP32_DOTS_VS_PLAIN as TOL
from tests.models.test_mixed_attention import _dots
from tests.models.test_weight_grad import _transposes

F32 = jnp.float32
MC = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=1)
T = 128  # B*T = 256 > 4D*3/4: c_proj's weight gradient takes the swapped operand order (precision._weight_grad)


def _loss_and_grads(plain: bool):
    """Compiled HLO, loss and gradients of gpt2-tiny (1 layer, B=2, T=128) in fp32, jitted; plain=True
    takes the path the policy takes off CPU (jnp.einsum weight matmuls, autodiff of the plain core)."""
    params = jax.tree.map(jnp.asarray, gpt2.init_params(MC, 0))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, MC.vocab_size, (2, T + 1)), jnp.int32)
    with pytest.MonkeyPatch.context() as mp:
        if plain:
            mp.setattr(precision, "_fp32_out_dots", lambda: False)
        step = jax.jit(jax.value_and_grad(lambda p: gpt2.GPT2(MC, p, policy="fp32").loss(tok[:, :-1], tok[:, 1:])))
        hlo = step.lower(params).compile().as_text()
        value, grads = step(params)
    return hlo, float(value), grads


@pytest.fixture(scope="module")
def runs():
    return {"new": _loss_and_grads(plain=False), "plain": _loss_and_grads(plain=True)}


def test_every_dot_of_the_fp32_step_is_a_ynnpack_dot(runs):
    """Per layer 4 weight matmuls x 3 dots and the attention core's 6 per causal query block (2 at
    T = 128: mixed_attention._fwd_blocked), plus the tied head's 3; the plain path has 6 attention
    dots. Which of the plain path's dots XLA:CPU hands to YNNPACK is the compiler's choice (jax 0.10
    to 0.12.0 ran both MLP weight gradients and dK in Eigen; 0.12.1 runs all 21 in YNNPACK), so only
    its count is pinned; test_mixed_attention.test_the_dot_census_tells_ynnpack_from_eigen checks
    that the census labels an Eigen dot 'xla'."""
    assert mixed_attention.causal_blocks(T) == 2
    dots = _dots(runs["new"][0])
    assert dots == [("ynn", "f32", "f32", "f32")] * (MC.n_layer * (4 * 3 + 6 * 2) + 3), sorted(set(dots))
    plain = _dots(runs["plain"][0])
    assert len(plain) == MC.n_layer * (4 * 3 + 6) + 3 and {d[1:] for d in plain} == {("f32", "f32", "f32")}, plain


def test_the_fp32_step_never_transposes_the_gelu_output(runs):
    """c_proj's weight gradient transposes its (B, T, D) cotangent, not the (B, T, 4D) gelu output
    (precision._weight_grad): no transpose in the step moves that many elements."""
    shapes = _transposes(runs["new"][0])
    assert (MC.n_embd, 2, T) in shapes, shapes
    assert max(math.prod(s) for s in shapes) < 4 * MC.n_embd * 2 * T, shapes


def test_fp32_loss_and_grads_equal_the_plain_path(runs):
    (_, loss, grads), (_, ref_loss, ref) = runs["new"], runs["plain"]
    assert abs(loss - ref_loss) <= TOL["loss"] * abs(ref_loss), (loss, ref_loss)  # bound 0: equal
    assert abs(loss - math.log(MC.vocab_size)) < 0.5  # a real loss at init, not zeros
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)
    for (path, g), r in zip(flat, ref_flat, strict=True):
        g, r = np.asarray(g), np.asarray(r)
        scale = np.abs(r).max()
        assert scale > 0, path
        assert np.abs(g - r).max() <= TOL["grad"] * scale, (jax.tree_util.keystr(path), np.abs(g - r).max() / scale)


# T = 256: the core by 4 causal query blocks (mixed_attention._fwd_blocked)
@pytest.mark.parametrize("shape", [(2, 16, 2, 16), (1, 7, 3, 8), (2, 1, 2, 8), (1, 256, 2, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp32_attention_core_equals_autodiff_of_the_plain_core(shape):
    """causal_attention(dtype=fp32): output and the three input gradients vs jax.vjp of the plain
    fp32 core (softmax of masked scaled scores, then probs.V) at HIGHEST precision."""
    rng = np.random.default_rng(sum(shape))
    q, k, v, g = (jnp.asarray(rng.standard_normal(shape), F32) for _ in range(4))
    hi = jax.lax.Precision.HIGHEST

    def plain(q, k, v):
        t = q.shape[1]
        s = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) / math.sqrt(q.shape[-1])
        p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(F32).min), axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", p, v, precision=hi)

    def both(f):
        o, vjp = jax.vjp(f, q, k, v)
        return (o, *vjp(g))

    got = jax.jit(lambda: both(lambda q, k, v: causal_attention(q, k, v, F32)))()
    ref = jax.jit(lambda: both(plain))()
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref, strict=True):
        assert a.dtype == F32 and a.shape == shape
        scale = float(np.abs(b).max())
        if shape[1] == 1 and name in ("dq", "dk"):  # softmax over one key: scores get no gradient
            assert scale == 0 and float(np.abs(a).max()) == 0, name
            continue
        assert scale > 0.05, name
        assert float(np.abs(a - b).max()) <= TOL["grad"] * scale, (name, float(np.abs(a - b).max()) / scale)
