"""jaxpar.models.precision: bf16 weight matmuls run as bf16 x bf16 -> fp32 dots forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.jaxpr_walk import dot_eqns

from jaxpar.models.precision import _transpose_specs, get_policy, mixed_einsum


def test_transpose_specs():
    assert _transpose_specs("btd,df->btf") == ("btf,df->btd", "btd,btf->df")
    assert _transpose_specs("btd,vd->btv") == ("btv,vd->btd", "btd,btv->vd")
    with pytest.raises(ValueError, match=r"einsum 'btd,dx->bt': an operand index appears nowhere else"):
        _transpose_specs("btd,dx->bt")


def _operands():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.bfloat16)  # activation (B, T, D)
    w = jnp.asarray(rng.standard_normal((16, 24)), jnp.float32)  # fp32 master weight (D, F)
    g = jnp.asarray(rng.standard_normal((2, 8, 24)), jnp.float32)  # cotangent of the fp32 output
    return x, w, g


def test_mixed_einsum_values_dtypes_and_dots(dot_form):
    x, w, g = _operands()
    y, vjp = jax.vjp(lambda a, b: mixed_einsum("btd,df->btf", a, b), x, w)
    dx, dw = vjp(g)
    # exact semantics: operands and cotangent rounded to bf16, products and sums in fp32
    x32, w16, g16 = x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32), g.astype(jnp.bfloat16)
    g16 = g16.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, jnp.einsum("btd,df->btf", x32, w16, precision=hi), rtol=1e-6, atol=1e-5)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32  # each cotangent in its operand's dtype
    np.testing.assert_allclose(dw, jnp.einsum("btd,btf->df", x32, g16, precision=hi), rtol=1e-6, atol=1e-5)
    ref_dx = jnp.einsum("btf,df->btd", g16, w16, precision=hi).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(ref_dx, np.float32))
    # every dot of forward + backward is bf16 x bf16 -> fp32 (the fast form on XLA:CPU with native bf16),
    # or fp32 x fp32 -> fp32 of the same bf16 values (AVX2-only hosts: jaxpar.models.precision.fp32_kernel_bf16_dots)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: mixed_einsum("btd,df->btf", a, b).sum(), (0, 1)))(x, w)
    dots = list(dot_eqns(jaxpr))
    assert len(dots) == 3
    for e in dots:
        want = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dot_form]
        assert [v.aval.dtype for v in e.invars] == [want, want]
        assert e.outvars[0].aval.dtype == jnp.float32


def test_fp32_policy_is_plain_einsum():
    x, w, _ = _operands()
    x = x.astype(jnp.float32)
    pol = get_policy("fp32")
    b = jnp.arange(24, dtype=jnp.float32)
    np.testing.assert_array_equal(pol.linear("btd,df->btf", x, w, b), jnp.einsum("btd,df->btf", x, w) + b)


def test_bf16_linear_bias_gradient_is_an_fp32_sum():
    """The bf16 policy adds a bias in fp32 (README: "biases added in fp32"), so its gradient is the fp32 sum
    of the bf16 cotangent over the (B, T) = 256 positions: within the fp32 summation bound
    256 * U_FP32 * sum|g| of the float64 sum (measured: exact). A bf16 add (y rounded, then + bias in
    bf16) sums it in bf16: 70x that bound here."""
    from jaxpar.tolerances import U_FP32

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 64, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(16, 8)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(4, 64, 8)), jnp.bfloat16)
    pol = get_policy("bf16")
    db = jax.grad(lambda b: jnp.sum((pol.linear("btd,df->btf", x, w, b) * g).astype(jnp.float32)))(b)
    g64 = np.asarray(g, np.float64)
    assert db.dtype == jnp.float32
    assert (np.abs(np.asarray(db, np.float64) - g64.sum((0, 1))) <= 256 * U_FP32 * np.abs(g64).sum((0, 1))).all()
