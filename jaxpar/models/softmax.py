"""Causal softmax over attention scores with a hand-written backward that saves only the probabilities.

Why not autodiff: `jax.nn.softmax(jnp.where(causal, s, min))` makes jax save the mask (bool),
the masked scores, exp(s - max), the row sums and their derivative: three fp32 (B, N, T, T)
arrays and a (B, N, T, T) bool per layer, each stacked by the layer `lax.scan`. The softmax
backward needs only its output p:
    ds = p·(g - Σ_s g·p)
and masked entries have p == 0, so their ds is 0 with no mask saved (autodiff's `where` gives
them a zero cotangent too). One fp32 (B, N, T, T) residual per layer instead of three plus a mask.

Numerics: the forward is jax.nn.softmax of the same masked scores (fp32 values bit-identical
to the autodiff path); the backward equals autodiff's to fp32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


@jax.custom_vjp
def causal_softmax(s):
    """s (..., T, T) fp32 scores (query t, key s) -> probs over keys s <= t, same shape, fp32."""
    T = s.shape[-1]
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    return jax.nn.softmax(jnp.where(causal, s, jnp.finfo(F32).min), axis=-1)


def _fwd(s):
    p = causal_softmax(s)
    return p, p  # residual: the probabilities only


def _bwd(p, g):
    return (p * (g - jnp.sum(g * p, axis=-1, keepdims=True)),)


causal_softmax.defvjp(_fwd, _bwd)
