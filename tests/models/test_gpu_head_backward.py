"""On GPU in bf16 the tied head's backward dots take bf16 operands (jaxpar.models.precision.Policy.einsum).

jax's own transpose of `einsum(bf16, bf16, preferred_element_type=fp32)` feeds the fp32 (B, T, V)
cotangent to fp32 x fp32 dots (TF32 on Hopper: 133-150 TFLOP/s on one H200, 11.8 of GPT-2 350M's
68 ms step). The GPU path is taken here on CPU by turning off CPU's fp32-output dots, as
tests/planner/test_planner_cost.py does; the dots are read off the jaxpr of the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.jaxpr_walk import dot_eqns

from jaxpar.models import precision


def _dots(jaxpr) -> list[tuple]:
    """(lhs dtype, rhs dtype, out dtype) of every dot_general in `jaxpr` and its sub-jaxprs."""
    return [(e.invars[0].aval.dtype, e.invars[1].aval.dtype, e.outvars[0].aval.dtype) for e in dot_eqns(jaxpr)]


def test_gpu_bf16_head_backward_dots_are_bf16_with_fp32_outputs(monkeypatch):
    monkeypatch.setattr(precision, "_fp32_out_dots", lambda: False)
    pol = precision.get_policy("bf16")
    B, T, D, V = 2, 64, 16, 40  # B*T*D + D*V < B*T*V: the shapes where CPU's YNNPACK form would swap
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, D)), jnp.bfloat16)  # ln_f output
    w = jnp.asarray(np.random.default_rng(1).normal(size=(V, D)), jnp.float32)  # the fp32 master wte
    g = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, V)), jnp.float32)  # fp32 dlogits

    def f(x, w):
        return jnp.sum(pol.einsum("btd,vd->btv", x, w) * g)

    closed = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)
    dots = _dots(closed.jaxpr)
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert dots == [(bf16, bf16, f32)] * 3, dots  # logits, dx, dwte
    # and none of CPU's operand-order trick (precision._weight_grad): its barrier would only block fusion
    assert "optimization_barrier" not in str(closed)
    dx, dw = jax.grad(f, argnums=(0, 1))(x, w)
    assert (dx.dtype, dw.dtype) == (bf16, f32)
    # the values: the cotangent rounded to bf16 (as torch.autocast), products summed in fp32
    ref_dw = jnp.einsum("btd,btv->vd", x.astype(f32), g.astype(bf16).astype(f32), precision="highest")
    assert float(jnp.max(jnp.abs(dw - ref_dw))) <= 1e-5 * float(jnp.max(jnp.abs(ref_dw)))


@pytest.mark.parametrize("fp32_out", [True, False])
def test_fp32_policy_head_dots_stay_fp32(monkeypatch, fp32_out):
    monkeypatch.setattr(precision, "_fp32_out_dots", lambda: fp32_out)
    pol = precision.get_policy("fp32")
    x, w = jnp.ones((1, 2, 4), jnp.float32), jnp.ones((3, 4), jnp.float32)
    dots = _dots(jax.make_jaxpr(jax.grad(lambda x, w: pol.einsum("btd,vd->btv", x, w).sum(), argnums=(0, 1)))(x, w).jaxpr)
    f32 = jnp.dtype(jnp.float32)
    assert len(dots) == 3 and all(d == (f32, f32, f32) for d in dots), dots
