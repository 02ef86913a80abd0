"""Causal attention core for bf16 on XLA:CPU: all six dots bf16 x bf16 -> fp32 in YNNPACK.

Why a hand-written backward. XLA:CPU sends a dot to YNNPACK's bf16 kernel only when, at the
start of its pipeline (the OperandUpcaster right after DotDecomposer, xla/service/cpu/
cpu_compiler.cc), `IsDotSupportedByYnn` (xla/backends/cpu/ynn_support.cc) accepts it: dtypes
(bf16, bf16 -> f32), every max(m, k, n) >= 8 and m, n > 1, and both operands *row-major in
canonical form*: lhs [batch..., m, k], rhs [batch..., k, n] in memory. Every other bf16 dot is
upcast to an fp32 dot there (Eigen or YNNPACK fp32: ~5x slower here). DotDecomposer makes an
operand canonical with a physical transpose (+ reshape when it merges dims) only when the dot
is not canonical already: a 2-D weight gradient `nd,nf->df` (one contracting dim, first in
both operands) counts as canonical, stays column-major and is upcast (measured ~100 vs ~300
GFLOP/s for the same dot from (B, T, D) operands, `btd,btf->df`, whose two contracting dims
DotDecomposer merges by transpose + reshape: why jaxpar's weight matmuls keep (B, T) apart).
A transpose written in jax does not help: it is folded into the dot's dimension numbers
(TransposeFolding / AlgebraicSimplifier) or, written before the upcaster runs, its result
carries a column-major layout.

jax's autodiff of the plain core (`gpt2.Attention._core`) gives four backward dots with fp32
cotangents (fp32 x bf16 -> upcast) and a bf16-output probs.V dot (bf16 x bf16 -> bf16 is not in
YNNPACK's list either): measured, 5 of 6 attention dots ran as fp32 dots at ~20 GFLOP/s while
the weight matmuls ran at ~100 (the same loaded host; benchmarks/README.md). Here every dot is
bf16 x bf16 -> fp32 in a form XLA keeps canonical:
  scores, dP       'btnh,bsnh->bnts'  both operands transposed by DotDecomposer (batch b, n)
  o, dQ            'bnts,bsnh->btnh'  probs/dS already [b, n, t, s] = [batch, m, k]
  dV, dK           'bnts,btnh->bsnh' probs/dS first: XLA computes dVᵀ = dOᵀ·P with dO transposed
                   by DotDecomposer. Written dO-first ('btnh,bnts->bsnh') the simplifier swaps the
                   operands into a column-major bf16 dot that YNNPACK rejects after the upcaster
                   kept it bf16: "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"
                   at run time (tests/test_mixed_attention.py runs every form it pins).

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

from jaxpar.softmax import causal_softmax

F32 = jnp.float32


def _scores_probs(q, k):
    """(B, T, N, Hd) bf16 x2 -> fp32 causal softmax probs (B, N, T, T)."""
    hd = q.shape[-1]
    s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=F32) / math.sqrt(hd)
    return causal_softmax(s)  # forward only: _bwd below differentiates it by hand


def _sum_over_t(p, x, dtype):
    """out[b, s, n, h] = sum_t p[b, n, t, s] x[b, t, n, h]: (B, N, T, S) x (B, T, N, H) -> (B, S, N, H) fp32.

    Operand order matters (module docstring): written x-first, XLA swaps the operands back into
    a column-major bf16 dot YNNPACK then rejects, and the step fails at run time."""
    return jnp.einsum("bnts,btnh->bsnh", p.astype(dtype), x.astype(dtype), preferred_element_type=F32)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def causal_attention_qkv(qkv, dtype=jnp.bfloat16):
    """causal_attention on the fused projection's output: (B, T, 3, N, Hd) `dtype` -> (B, T, N, Hd).

    Same values as `causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])`, forward and
    backward bit for bit; only the layout work of the backward differs. Sliced outside the
    custom_vjp, autodiff returns d(qkv) as the sum of three zero-padded slices (pad + add), and
    XLA:CPU fuses that with the transpose of the dot outputs (YNNPACK returns dq/dk/dv as
    (B, N, Hd, T)) into one loop fusion that visits all three inputs for each of the 3x more
    output elements (small bf16 config: 0.74 ms per layer, 9% of the step's thunk time). Here the
    backward stacks them instead: one transposing copy, no pads."""
    return _fwd_qkv(qkv, dtype)[0]


def _fwd_qkv(qkv, dtype):
    return _fwd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dtype)


def _bwd_qkv(dtype, res, g):
    return (jnp.stack(_bwd(dtype, res, g), axis=2),)  # (B, T, 3, N, Hd)


causal_attention_qkv.defvjp(_fwd_qkv, _bwd_qkv)
