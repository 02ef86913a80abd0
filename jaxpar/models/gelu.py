"""GELU (tanh approximation, HF "gelu_new") with a hand-written backward that saves only its input.

Why not `jax.nn.gelu(x, approximate=True)`: autodiff of it saves every intermediate the
backward reads (x**3, the tanh, the cdf, ...), several (B, T, 4D) arrays per layer. Under
`lax.scan` each one is stacked into an (L, B, T, 4D) residual buffer (a zero-fill plus a
dynamic-update-slice per layer), and in bf16 XLA:CPU splits the op chain into one fusion per
saved value, each writing a full (B, T, 4D) tensor. Here the forward is one elementwise pass
and the backward recomputes tanh from the saved input in one pass (a tanh per element is
cheaper on CPU than writing and re-reading extra (B, T, 4D) tensors).

Numerics: the math runs in fp32 whatever the input dtype (bf16 inputs are upcast once, the
result rounded once, instead of a bf16 rounding after every op); the fp32 forward is the same
expression as jax.nn.gelu's, so fp32 values are bit-identical to it; the derivative
0.5(1 + t) + 0.5x(1 - t²)·c(1 + 3a·x²), t = tanh(c(x + a·x³)), is evaluated at the same
(saved, input-dtype) x that autodiff would use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_C = np.float32(np.sqrt(2 / np.pi))  # sqrt(2/pi), as jax.nn.gelu rounds it in fp32
_A = np.float32(0.044715)


def _tanh_arg(x32):
    return _C * (x32 + _A * (x32**3))


@jax.custom_vjp
def gelu_tanh(x):
    """0.5·x·(1 + tanh(sqrt(2/π)(x + 0.044715x³))) computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * (0.5 * (1.0 + jnp.tanh(_tanh_arg(x32))))).astype(x.dtype)


def _gelu_fwd(x):
    return gelu_tanh(x), x  # residual: the input only (same shape and dtype as the output)


def _gelu_bwd(x, g):
    x32 = x.astype(jnp.float32)
    t = jnp.tanh(_tanh_arg(x32))
    dydx = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _C * (1.0 + 3.0 * _A * x32 * x32)
    return ((g.astype(jnp.float32) * dydx).astype(x.dtype),)


gelu_tanh.defvjp(_gelu_fwd, _gelu_bwd)
