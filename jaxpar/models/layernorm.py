"""LayerNorm with fp32 statistics and a hand-written backward that saves its input and two row stats.

Why not autodiff: the plain expression `(x - mean) * rsqrt(var + eps) * w + b` makes jax save
every intermediate its backward reads: x - mean, the normalised x, (x - mean)·rstd·w and the
fp32 output, four (B, T, D) fp32 arrays plus rstd and its derivative per LayerNorm (the fp32
output doubles as the next matmul's input in fp32 mode). Under the layer `lax.scan` each is
stacked into an (L, B, T, D) buffer. Here the residuals are x itself (the input dtype: bf16
under the bf16 policy) and mean, rstd (B, T, 1) fp32; the backward recomputes
x̂ = (x - mean)·rstd in one elementwise pass, as jaxpar.models.gelu.gelu_tanh recomputes its tanh.

Numerics: the forward is the same expression in the same order as before, so its fp32 values
are bit-identical. The backward is the textbook one, in fp32 whatever the input dtype:
    dx̂ = g·w,   dx = rstd·(dx̂ - mean(dx̂) - x̂·mean(dx̂·x̂)),   dw = Σ_{B,T} g·x̂,   db = Σ_{B,T} g
Autodiff of the plain expression gives the same values to fp32 rounding (it also carries the
term through the mean inside the variance, analytically zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _stats(x32, eps: float):
    """(B, T, D) fp32 -> mean, rstd (B, T, 1): the statistics over the last dim."""
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return mean, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, weight, bias, eps):
    """x (..., D) any float dtype, weight/bias (D,) fp32 -> (..., D) in x's dtype; math in fp32."""
    return _fwd(x, weight, bias, eps)[0]


def _fwd(x, weight, bias, eps):
    x32 = x.astype(F32)
    mean, rstd = _stats(x32, eps)
    y = (x32 - mean) * rstd * weight + bias
    # residuals: the input as given (bf16 under the bf16 policy), two (..., 1) fp32 stats, weight
    return y.astype(x.dtype), (x, mean, rstd, weight)


def _bwd(eps, res, g):
    x, mean, rstd, weight = res
    g32 = g.astype(F32)
    xhat = (x.astype(F32) - mean) * rstd  # (..., D)
    dxhat = g32 * weight
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    rows = tuple(range(g.ndim - 1))  # every dim but D: the weight is shared by all of them
    dw = jnp.sum(g32 * xhat, axis=rows).astype(weight.dtype)
    db = jnp.sum(g32, axis=rows).astype(weight.dtype)
    return dx.astype(x.dtype), dw, db


layer_norm.defvjp(_fwd, _bwd)
