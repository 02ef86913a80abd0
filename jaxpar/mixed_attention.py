"""Causal attention core for bf16 on XLA:CPU: all six dots bf16 x bf16 -> fp32 in YNNPACK.

Why a hand-written backward. XLA:CPU sends a dot to YNNPACK's bf16 kernel only when, at the
start of its pipeline (the OperandUpcaster right after DotDecomposer, xla/service/cpu/
cpu_compiler.cc), `IsDotSupportedByYnn` (xla/backends/cpu/ynn_support.cc) accepts it: dtypes
(bf16, bf16 -> f32), every max(m, k, n) >= 8 and m, n > 1, and both operands *row-major in
canonical form*: lhs [batch..., m, k], rhs [batch..., k, n] in memory. Every other bf16 dot is
upcast to an fp32 dot there (Eigen or YNNPACK fp32: ~5x slower here). DotDecomposer makes an
operand canonical with a physical transpose (+ reshape when it merges dims) only when the dot
is not canonical already; a dot that is canonical but column-major (contracting dim before the
free dim, e.g. `bnts,btnh->bsnh` contracting t of the probs) stays column-major and is upcast,
and a transpose written in jax is folded into the dot's dimension numbers (TransposeFolding /
AlgebraicSimplifier), so it cannot help.

jax's autodiff of the plain core (`gpt2.Attention._core`) gives four backward dots with fp32
cotangents (fp32 x bf16 -> upcast) and a bf16-output probs.V dot (bf16 x bf16 -> bf16 is not in
YNNPACK's list either): measured, 5 of 6 attention dots ran as fp32 dots at ~20 GFLOP/s while
the weight matmuls ran at ~100 (the same loaded host; benchmarks/README.md). Here every dot is
bf16 x bf16 -> fp32 in a form XLA keeps canonical:
  scores, dP       'btnh,bsnh->bnts'  both operands transposed by DotDecomposer (batch b, n)
  o, dQ            'bnts,bsnh->btnh'  probs/dS already [b, n, t, s] = [batch, m, k]
  dV, dK           sum over t of probs/dS x dO/Q: the t axis is split in two (t = 2u + w) so
                   DotDecomposer merges (u, w) by transpose + reshape, which no pass folds
                   away (a one-axis contraction here is canonical-but-column-major, or, with
                   the operands swapped, gets swapped back by the simplifier: both upcast or,
                   worse, leave a bf16 dot YNNPACK then rejects: "Unsupported element type for
                   DotThunk::Execute: BF16 x BF16 = F32"). Odd T keeps fp32 dots for these two.

Numerics (the bf16 policy): q, k, v, probs and cotangents enter dots as bf16, every dot
accumulates and returns fp32; scores, softmax and its backward are fp32 (from the saved fp32
probs, as autodiff of the plain core). The differences to the plain core's autodiff: dP leaves
its dot in fp32 (plain: rounded to bf16) and dS is rounded to bf16 before the dQ/dK dots
(plain: fp32), as torch.autocast does. No dropout: callers use the plain core when dropping.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _scores_probs(q, k):
    """(B, T, N, Hd) bf16 x2 -> fp32 causal softmax probs (B, N, T, T)."""
    t, hd = q.shape[1], q.shape[-1]
    s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=F32) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    return jax.nn.softmax(jnp.where(causal, s, jnp.finfo(F32).min), axis=-1)


def _sum_over_t(p, x, dtype):
    """out[b, s, n, h] = sum_t p[b, n, t, s] x[b, t, n, h]: (B, N, T, S) x (B, T, N, H) -> (B, S, N, H) fp32.

    T even: t split into (T/2, 2) so the dot contracts two dims (see the module docstring);
    T odd: an fp32 dot of the same bf16-rounded operands (what XLA would make of a bf16 one)."""
    b, t, n, h = x.shape
    if t % 2:
        return jnp.einsum("bnts,btnh->bsnh", p.astype(dtype).astype(F32), x.astype(dtype).astype(F32))
    p5 = p.astype(dtype).reshape(b, n, t // 2, 2, p.shape[-1])
    x5 = x.astype(dtype).reshape(b, t // 2, 2, n, h)
    return jnp.einsum("bnuws,buwnh->bsnh", p5, x5, preferred_element_type=F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def causal_attention(q, k, v, dtype=jnp.bfloat16):
    """softmax(q kᵀ / sqrt(Hd), causal) v: (B, T, N, Hd) x3 in `dtype` -> (B, T, N, Hd) `dtype`."""
    return _fwd(q, k, v, dtype)[0]


def _fwd(q, k, v, dtype):
    probs = _scores_probs(q, k)
    o = jnp.einsum("bnts,bsnh->btnh", probs.astype(dtype), v, preferred_element_type=F32)
    # residuals: q, k, v (slices of the saved qkv) and the fp32 probs, as autodiff would save
    return o.astype(dtype), (q, k, v, probs)


def _bwd(dtype, res, g):
    q, k, v, probs = res
    hd = q.shape[-1]
    g = g.astype(dtype)
    dp = jnp.einsum("btnh,bsnh->bnts", g, v, preferred_element_type=F32)  # (B, N, T, S) fp32
    dv = _sum_over_t(probs, g, dtype)  # (B, S, N, Hd)
    # softmax backward in fp32; masked entries have probs == 0, so their dS is 0
    ds = probs * (dp - jnp.sum(dp * probs, axis=-1, keepdims=True)) / math.sqrt(hd)
    dq = jnp.einsum("bnts,bsnh->btnh", ds.astype(dtype), k, preferred_element_type=F32)
    dk = _sum_over_t(ds, q, dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


causal_attention.defvjp(_fwd, _bwd)
