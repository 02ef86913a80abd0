"""The CPU attention core by causal query blocks (jaxpar/models/mixed_attention.py `_fwd_blocked`).

At T = 256 the core splits the queries into 4 blocks of 64 rows; block i sees keys [0, 64 (i+1))
only, so the six dots of the forward and backward skip the fully masked upper blocks of the
(T, T) scores: sum_i 64 * 64 (i+1) = 10/16 of T^2 score entries, i.e. 5/8 of the unblocked FLOPs
(benchmarks/README.md, profile_step.py). Pinned here: the block rule, the dot FLOPs of the compiled
forward+backward (fp32 and bf16), that every bf16 dot stays a bf16 YNNPACK dot, and the values
against the unblocked core. The values against a plain autodiff reference are in
tests/models/test_fp32_dots.py (fp32) and tests/models/test_mixed_attention.py (bf16), whose shapes include a
blocked T.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar.models.mixed_attention as ma
from jaxpar.tolerances import CAUSAL_BLOCKS_VS_UNBLOCKED
from tests.models.test_mixed_attention import _dots

F32, BF16 = jnp.float32, jnp.bfloat16
B, T, N, HD = 2, 256, 2, 16


def test_block_rule():
    """Blocks of >= 64 rows, at most 8 of them, only when they split T evenly."""
    assert {t: ma.causal_blocks(t) for t in (16, 64, 100, 128, 192, 256, 320, 1024, 2048)} == {
        16: 1, 64: 1, 100: 1, 128: 2, 192: 3, 256: 4, 320: 5, 1024: 8, 2048: 8}


def _fwd_bwd(dtype):
    rng = np.random.default_rng(0)
    q, k, v, g = (jnp.asarray(rng.standard_normal((B, T, N, HD)), F32).astype(dtype) for _ in range(4))

    def f(q, k, v, g):
        o, vjp = jax.vjp(lambda q, k, v: ma.causal_attention(q, k, v, dtype), q, k, v)
        return (o, *vjp(g))

    return jax.jit(f), (q, k, v, g)


def _dot_flops(hlo: str) -> int:
    """2 * (output elements) * (contracted size) summed over every dot of compiled HLO text."""
    shapes = {m.group(1): [int(d) for d in m.group(2).split(",") if d]
              for m in re.finditer(r"%([\w.\-]+) = \w+\[([\d,]*)\]", hlo)}
    total = 0
    for m in re.finditer(r"%[\w.\-]+ = \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\), [^\n]*?"
                         r"lhs_contracting_dims=\{([\d,]*)\}", hlo):
        out = math.prod(int(d) for d in m.group(1).split(",") if d)
        lhs = shapes[m.group(2)]
        total += 2 * out * math.prod(lhs[int(i)] for i in m.group(3).split(","))
    return total


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_masked_blocks_are_not_computed(dtype, monkeypatch):
    """Six dots, each 2 B N Hd per score entry: unblocked T^2 entries each, blocked 10/16 of them."""
    per_entry = 6 * 2 * B * N * HD
    fn, args = _fwd_bwd(dtype)
    assert _dot_flops(fn.lower(*args).compile().as_text()) == per_entry * T * T * 10 // 16
    monkeypatch.setattr(ma, "_BLOCK", 0)  # the unblocked core, for the reference count
    fn0, _ = _fwd_bwd(dtype)
    assert _dot_flops(fn0.lower(*args).compile().as_text()) == per_entry * T * T


# Runs on every host: XLA:CPU's choice of YNNPACK bf16 dots (ynn_support.cc) reads no CPU feature, and an
# emulated AVX2-only host (tests/avx2_host) compiles and runs the same dots (benchmarks/README.md, "Emulated AVX2-only host").
# Both forms run on every host (`dot_form`): AVX2-only hosts take the fp32-kernel one by default.
def test_blocked_bf16_dots_stay_bf16_ynnpack_dots(dot_form):
    """4 blocks x 6 dots, each bf16 x bf16 -> fp32 in YNNPACK (fp32-kernel form: each fp32); and it runs
    (a bf16 dot YNNPACK rejects late in compilation fails at run time)."""
    fn, args = _fwd_bwd(BF16)
    assert _dots(fn.lower(*args).compile().as_text()) == [("ynn", "f32", dot_form, dot_form)] * 24
    assert all(bool(jnp.all(jnp.isfinite(x.astype(F32)))) for x in fn(*args))


def test_blocked_equals_unblocked_fp32(monkeypatch):
    """Same products: o and dQ came out bit-equal on the AMD Zen 4 host (not pinned: the dot kernel's
    blocking over the shorter contraction may differ elsewhere); dK/dV sum the padded block
    contributions in another order (3.5e-7 of max here)."""
    fn, args = _fwd_bwd(F32)
    got = fn(*args)
    monkeypatch.setattr(ma, "_BLOCK", 0)
    ref = _fwd_bwd(F32)[0](*args)
    bound = CAUSAL_BLOCKS_VS_UNBLOCKED
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref, strict=True):
        scale = float(np.abs(b).max())
        assert scale > 0.05, name
        assert float(np.abs(a - b).max()) <= bound * scale, (name, float(np.abs(a - b).max()) / scale)
