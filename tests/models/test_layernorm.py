"""jaxpar.models.layernorm.layer_norm: fp32-statistics LayerNorm whose backward saves x and two (B, T, 1) stats.
Reference: autodiff of the plain expression it replaced (the same forward, written out below)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from jaxpar.models.layernorm import layer_norm
from jaxpar.tolerances import TABLE, U_BF16

EPS = 1e-5
B, T, D = 4, 16, 96
rng = np.random.default_rng(0)
# rows with a non-zero mean and spread (the centring matters), weight and bias away from 1 and 0
X = (rng.standard_normal((B, T, D)) * 3 + rng.standard_normal((B, T, 1)) * 5).astype(np.float32)
W = (1 + 0.5 * rng.standard_normal(D)).astype(np.float32)
BIAS = (0.3 * rng.standard_normal(D)).astype(np.float32)
G = rng.standard_normal((B, T, D)).astype(np.float32)


def plain(x, w, b):
    """jaxpar's LayerNorm before the hand-written backward (autodiff saved four (B, T, D) fp32 arrays)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + EPS) * w + b).astype(x.dtype)


def mine(x, w, b):
    return layer_norm(x, w, b, EPS)


@jax.jit
def fwd_bwd(x, w, b, g):
    """(y, dx, dw, db) of layer_norm and of the plain expression."""
    out = []
    for f in (mine, plain):
        y, vjp = jax.vjp(f, x, w, b)
        out.append((y, *vjp(g)))
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_fp32_forward_bitwise_and_backward_equals_autodiff():
    (y, dx, dw, db), (y0, dx0, dw0, db0) = fwd_bwd(X, W, BIAS, G)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    bound = TABLE["layernorm.fp32.grad"].value
    for name, a, b in (("dx", dx, dx0), ("dw", dw, dw0), ("db", db, db0)):
        assert a.dtype == b.dtype == jnp.float32 and a.shape == b.shape, name
        assert np.max(np.abs(np.asarray(b))) > 0.1, name  # a real gradient, not zeros
        assert _rel(a, b) <= bound, (name, _rel(a, b))


def test_fp32_backward_equals_float64():
    """The textbook formula in float64 (independent of jax's autodiff)."""
    _, dx, dw, db = fwd_bwd(X, W, BIAS, G)[0]
    x, g = X.astype(np.float64), G.astype(np.float64)
    xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS)
    dxhat = g * W
    dx64 = (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True)) \
        / np.sqrt(x.var(-1, keepdims=True) + EPS)
    bound = TABLE["layernorm.fp32.grad"].value
    assert _rel(dx, dx64) <= bound, _rel(dx, dx64)
    assert _rel(dw, (g * xhat).sum((0, 1))) <= bound
    assert _rel(db, g.sum((0, 1))) <= bound


def test_bf16_in_bf16_out_with_fp32_math():
    xb, gb = jnp.asarray(X, jnp.bfloat16), jnp.asarray(G, jnp.bfloat16)
    (y, dx, dw, db), (y0, dx0, dw0, db0) = fwd_bwd(xb, W, BIAS, gb)
    assert y.dtype == dx.dtype == jnp.bfloat16 and dw.dtype == db.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))
    # dx: fp32 values that differ by summation order, rounded once to bf16: equal, or one bf16 ulp
    # apart (2 U_BF16 relative) where the fp32 value sat on a rounding boundary
    a, b = np.asarray(dx, np.float32), np.asarray(dx0, np.float32)
    assert np.all(np.abs(a - b) <= 2 * U_BF16 * np.abs(b)), float(np.max(np.abs(a - b)))
    assert np.mean(a == b) >= 0.95
    # weight and bias gradients never pass through bf16
    assert _rel(dw, dw0) <= TABLE["layernorm.fp32.grad"].value
    assert _rel(db, db0) <= TABLE["layernorm.fp32.grad"].value


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_saves_x_and_two_row_stats(capsys, dtype):
    # the point of the custom VJP: one (B, T, D) residual (the input, in its own dtype) and the
    # (B, T, 1) mean and rstd, where autodiff of the plain expression saves four fp32 (B, T, D)
    x = jnp.asarray(X[:2, :3, :16], dtype)
    w, b = jnp.asarray(W[:16]), jnp.asarray(BIAS[:16])
    print_saved_residuals(lambda x, w, b: jnp.sum(mine(x, w, b).astype(jnp.float32)), x, w, b)
    saved = [ln.split(" ")[0] for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    short = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    assert sorted(saved) == sorted([f"{short}[2,3,16]", "f32[2,3,1]", "f32[2,3,1]", "f32[16]"]), saved
    print_saved_residuals(lambda x, w, b: jnp.sum(plain(x, w, b).astype(jnp.float32)), x, w, b)
    theirs = [ln for ln in capsys.readouterr().out.splitlines() if "f32[2,3,16]" in ln]
    assert len(theirs) >= 3, theirs
