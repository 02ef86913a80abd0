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
                   at run time (tests/models/test_mixed_attention.py runs every form it pins).

Causal query blocks (`_fwd_blocked`, T >= 128 split evenly into blocks of >= 64 rows, at most 8):
block i computes its scores, probs and the four backward dots against keys [0, (i+1)·b) only, so
the fully masked upper blocks are never computed, as torch's flash attention kernel skips them:
(nb + 1) / (2 nb) of the FLOPs (T = 256: 4 blocks, 5/8). Measured on a 2-core AMD Zen 4 host (CPU
time, one process, old/new): the fp32 core alone 1.25x at B8 T256 N6 Hd64; whole step mid fp32
1.05x, mid bf16 1.035x (benchmarks/README.md, profile_step.py). o and dQ equal the unblocked core's;
dK/dV add the blocks' zero-padded contributions, another fp32 order (tests/models/test_causal_blocks.py).
The saved probs shrink to the same (nb + 1) / (2 nb), as jaxpar.planner's activation model counts
them on CPU devices (`causal_blocks`, DeviceSpec.causal_blocks).

Numerics (the bf16 policy): q, k, v, probs and cotangents enter dots as bf16, every dot
accumulates and returns fp32; scores, softmax and its backward are fp32 (from the saved fp32
probs, as autodiff of the plain core). The differences to the plain core's autodiff: dP leaves
its dot in fp32 (plain: rounded to bf16) and dS is rounded to bf16 before the dQ/dK dots
(plain: fp32), as torch.autocast does. No dropout: callers use the plain core when dropping.
On CPUs without native bf16 every dot takes jaxpar.models.precision's fp32-kernel form (`_dot`, `dot_operand`):
an fp32 dot of the same bf16 values, in the same canonical forms.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.models.precision import dot_operand
from jaxpar.models.softmax import causal_softmax

F32 = jnp.float32


def _dot(spec: str, x, y, dtype):
    """einsum(spec) of x, y as `dtype` operands (jaxpar.models.precision.dot_operand), accumulated and returned in fp32."""
    return jnp.einsum(spec, dot_operand(x, dtype), dot_operand(y, dtype), preferred_element_type=F32)


def _scores(q, k):
    """(B, Tq, N, Hd) x (B, Tk, N, Hd) -> fp32 scores q·k / sqrt(Hd), (B, N, Tq, Tk)."""
    hd = q.shape[-1]
    s = _dot("btnh,bsnh->bnts", q, k, q.dtype) / math.sqrt(hd)
    return s


def _scores_probs(q, k):
    """(B, T, N, Hd) bf16 x2 -> fp32 causal softmax probs (B, N, T, T)."""
    return causal_softmax(_scores(q, k))  # forward only: _bwd below differentiates it by hand


def _sum_over_t(p, x, dtype):
    """out[b, s, n, h] = sum_t p[b, n, t, s] x[b, t, n, h]: (B, N, T, S) x (B, T, N, H) -> (B, S, N, H) fp32.

    Operand order matters (module docstring): written x-first, XLA swaps the operands back into
    a column-major bf16 dot YNNPACK then rejects, and the step fails at run time."""
    return _dot("bnts,btnh->bsnh", p, x, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def causal_attention(q, k, v, dtype=jnp.bfloat16):
    """softmax(q kᵀ / sqrt(Hd), causal) v: (B, T, N, Hd) x3 in `dtype` -> (B, T, N, Hd) `dtype`."""
    return _fwd(q, k, v, dtype)[0]


# Causal query blocks: at least _BLOCK rows each, at most _MAX_BLOCKS of them (0: never block).
# T = 256 -> 4 blocks of 64, 1024 -> 8 of 128; T = 64 (or any T not split evenly) -> 1, the unblocked core.
_BLOCK, _MAX_BLOCKS = 64, 8


def causal_blocks(T: int) -> int:
    """How many query blocks `causal_attention` splits T into (1: the unblocked core). The planner's
    activation model (jaxpar.planner.activations) counts the saved probs with it."""
    if not _BLOCK:
        return 1
    b = max(_BLOCK, -(-T // _MAX_BLOCKS))
    return T // b if T % b == 0 and T >= 2 * b else 1


def _fwd(q, k, v, dtype):
    if causal_blocks(q.shape[1]) > 1:
        return _fwd_blocked(q, k, v, dtype)
    probs = _scores_probs(q, k)
    o = _dot("bnts,bsnh->btnh", probs, v, dtype)
    # residuals: q, k, v (slices of the saved qkv) and the fp32 probs, as autodiff would save
    return o.astype(dtype), (q, k, v, probs)


def _fwd_blocked(q, k, v, dtype):
    """The core by query blocks of b rows: block i (rows [i*b, (i+1)*b)) sees keys [0, (i+1)*b) only,
    so the fully masked upper blocks of the (T, T) scores are never computed. With nb blocks the six
    dots do (nb + 1) / (2 nb) of the unblocked FLOPs (T = 256: 4 blocks, 5/8), as torch's flash kernel skips them.
    Residual: one fp32 probs block (B, N, b, (i+1)*b) per query block instead of (B, N, T, T)."""
    T = q.shape[1]
    b = T // causal_blocks(T)
    outs, probs = [], []
    for lo in range(0, T, b):
        hi = lo + b
        s = _scores(q[:, lo:hi], k[:, :hi])  # (B, N, b, hi)
        causal = jnp.tril(jnp.ones((b, hi), dtype=bool), k=lo)  # row t (absolute lo + t) sees keys s <= lo + t
        p = jax.nn.softmax(jnp.where(causal, s, jnp.finfo(F32).min), axis=-1)  # as jaxpar.models.softmax, offset mask
        outs.append(_dot("bnts,bsnh->btnh", p, v[:, :hi], dtype))
        probs.append(p)
    return jnp.concatenate(outs, axis=1).astype(dtype), (q, k, v, tuple(probs))


def _bwd_blocked(dtype, res, g):
    """Backward of `_fwd_blocked`: the four dots per query block over its visible keys; dQ blocks are
    concatenated, the dK/dV contributions ((B, (i+1)*b, N, Hd) each) zero-padded to T and summed."""
    q, k, v, probs = res
    T, hd = q.shape[1], q.shape[-1]
    b = T // len(probs)
    g = g.astype(dtype)
    dqs, dk, dv = [], 0.0, 0.0
    for lo, p in zip(range(0, T, b), probs):
        hi = lo + b
        gi = g[:, lo:hi]
        dp = _dot("btnh,bsnh->bnts", gi, v[:, :hi], dtype)  # (B, N, b, hi)
        ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True)) / math.sqrt(hd)
        dqs.append(_dot("bnts,bsnh->btnh", ds, k[:, :hi], dtype))
        pad = ((0, 0), (0, T - hi), (0, 0), (0, 0))
        dv = dv + jnp.pad(_sum_over_t(p, gi, dtype), pad)
        dk = dk + jnp.pad(_sum_over_t(ds, q[:, lo:hi], dtype), pad)
    return jnp.concatenate(dqs, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _bwd(dtype, res, g):
    if isinstance(res[3], tuple):  # probs saved by query blocks: _fwd_blocked
        return _bwd_blocked(dtype, res, g)
    q, k, v, probs = res
    hd = q.shape[-1]
    g = g.astype(dtype)
    dp = _dot("btnh,bsnh->bnts", g, v, dtype)  # (B, N, T, S) fp32
    dv = _sum_over_t(probs, g, dtype)  # (B, S, N, Hd)
    # softmax backward in fp32; masked entries have probs == 0, so their dS is 0
    ds = probs * (dp - jnp.sum(dp * probs, axis=-1, keepdims=True)) / math.sqrt(hd)
    dq = _dot("bnts,bsnh->btnh", ds, k, dtype)
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
