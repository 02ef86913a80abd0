"""Dtype policy: which dtype every tensor and every matmul's accumulation and output use.

bf16 (default):
  * params, gradients, their reduction over data/fsdp, optimizer state: fp32;
  * matmul operands: bf16 (weights cast from the fp32 masters at the point of use);
  * matmul accumulation: fp32 always;
  * matmul output: on CPU fp32 (`preferred_element_type=float32`), then bias added in fp32
    and cast to bf16 once; on GPU/TPU bf16 (cuBLAS/MXU accumulate in fp32 anyway and write
    bf16; an fp32 output would double the tensor-parallel all-reduce bytes);
  * activations between ops: bf16; LayerNorm statistics, softmax, logits and loss: fp32;
  * biases added in fp32 (`add_bias`), so bias gradients are fp32 sums.
  Why fp32 matmul outputs on CPU: XLA:CPU runs a bf16 x bf16 -> fp32 dot on the native bf16
  units (avx512_bf16/AMX) but a bf16 -> bf16 dot through a slow path: 2048x384 @ 384x1536
  measured 347 vs 750 GFLOP/s on an idle avx512_bf16 host (3.5x apart on a loaded one,
  benchmarks/README.md). `einsum` below keeps all three dots of a matmul's forward and
  backward in that fast form: the backward casts the incoming fp32 cotangent to bf16 (what
  torch.autocast does), and the weight gradient leaves the dot in fp32 (not rounded to bf16).
  Attention's batched dots: jaxpar/models/mixed_attention.py (`Policy.attention_core`), in forms pinned by
  tests: XLA:CPU runs a bf16 x bf16 -> fp32 dot only in YNNPACK, and a bf16 dot that YNNPACK
  rejects late in compilation fails at run time ("Unsupported element type for DotThunk").
  CPUs without avx512_bf16/AMX (AVX2-only hosts): every such dot runs instead as an fp32 dot of the
  same bf16 values (`dot_operand`, `fp32_kernel_bf16_dots`): YNNPACK's AVX2 bf16 kernel is slower
  than its fp32 one. Same operands, products and fp32 accumulation; activations stay bf16.
fp32: every tensor and every matmul in fp32, for exact comparisons (parity, sharding tests); off
  CPU the model's dots are traced at `float32` precision (`Policy.matmul_precision`: JAX's default
  there is TF32 on GPU).
  On CPU the weight matmuls go through `mixed_einsum` too (fp32 x fp32 -> fp32) and the attention
  core through jaxpar/models/mixed_attention.py, for the dot forms, not the dtypes: jax's own transpose of
  `btd,df->btf` w.r.t. the weight is a 2-D dot contracting dim 0 of both (B*T, D) and (B*T, F)
  operands, which XLA:CPU runs in Eigen (68-108 GFLOP/s, CPU time, loaded 2-core host) after a
  transposed copy of the other operand; written `btd,btf->df` it becomes a canonical YNNPACK dot
  (~140 GFLOP/s, as every other weight dot). Values: the same products, summed in another order
  (loss within 1e-7 relative; tests/models/test_fp32_dots.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


def _transpose_specs(spec: str) -> tuple[str, str]:
    """'btd,df->btf' -> ('btf,df->btd', 'btd,btf->df'): the einsums giving each operand's
    cotangent. Valid when every index of an operand also appears in the other operand or the
    output (no index summed within one operand), which holds for every matmul in the model."""
    ins, out = spec.split("->")
    a, b = ins.split(",")
    if any(c not in b + out for c in a) or any(c not in a + out for c in b):
        raise ValueError(f"einsum {spec!r}: an operand index appears nowhere else")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


# What an fp32 transposed copy costs per element, relative to a plain copy (1), when its operand is an
# elementwise function's output: XLA:CPU fuses that function into the copy and recomputes it per element
# instead of reading the materialized output (gelu: bias add and 0.5*x*(1 + tanh) from the saved tanh).
# Measured on the 2-core Zen 4 host (CPU time, jit alone): the (512, 3072) gelu copy 5.6 ns/element, the
# (2048, 1536) one 9.7, a plain transposed copy 1.0 (benchmarks/README.md, profile_step.py); the lower ratio.
# bf16 copies are plain (the bf16 cast is materialized first): the weight applies to fp32 only.
RECOMPUTED_COPY_COST = 5


# bf16 dots as fp32 dots of bf16-valued operands (`dot_operand`): None = where the CPU has no native bf16
# (jaxpar.tolerances.NATIVE_BF16 False); True / False force either form (tests, benchmarks: set before tracing).
FP32_KERNEL_BF16_DOTS: bool | None = None


def fp32_kernel_bf16_dots() -> bool:
    """Whether bf16 dots run as fp32 dots of their bf16-valued operands: on XLA:CPU without avx512_bf16/AMX.

    Why: there YNNPACK's bf16 x bf16 -> fp32 kernel (AVX2) is slower than its fp32 kernel on the same
    shapes, and the dots are most of the step (figures: benchmarks/README.md, bf16_dot_form.py). Same numerics: the operands hold bf16 values (bf16 products are exact
    in fp32) and the dot accumulates in fp32 either way; only the kernel's summation order may differ."""
    if FP32_KERNEL_BF16_DOTS is not None:
        return FP32_KERNEL_BF16_DOTS
    from jaxpar.tolerances import NATIVE_BF16

    return _fp32_out_dots() and not NATIVE_BF16


def dot_operand(x, dtype):
    """x as a matmul operand of the policy's `dtype`: `x.astype(dtype)`, except bf16 where
    `fp32_kernel_bf16_dots()`: fp32 holding x rounded to bf16 (bf16 x: exact upcast; fp32 x:
    reduce_precision to bf16's 8 exponent / 7 mantissa bits, the same round-to-nearest-even as the
    cast, which XLA's excess-precision passes may not drop as they may drop a convert pair)."""
    if dtype != jnp.bfloat16 or not fp32_kernel_bf16_dots():
        return x.astype(dtype)
    if x.dtype == jnp.bfloat16:
        return x.astype(jnp.float32)
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def mixed_einsum(spec: str, a, b, dtype=jnp.bfloat16, a_elementwise: bool = False):
    """einsum of a, b cast to `dtype`, accumulated and returned in fp32; the backward dots
    are `dtype` x `dtype` -> fp32 too (bf16: see `dot_operand`), each cotangent returned in its operand's dtype. The
    weight gradient is written `btd,btf->df` (operand-first, (B, T) kept apart): the form
    XLA:CPU makes canonical for YNNPACK, in bf16 and fp32 alike (module docstring).
    a_elementwise: `a` is an elementwise function's output (the MLP's gelu), which a transposed
    fp32 copy of `a` recomputes per element (`RECOMPUTED_COPY_COST`, `_weight_grad`)."""
    return jnp.einsum(spec, dot_operand(a, dtype), dot_operand(b, dtype), preferred_element_type=jnp.float32)


def _mixed_fwd(spec, a, b, dtype, a_elementwise):
    # residuals: the operands as given (an fp32 master weight is alive anyway; no 2nd copy)
    return mixed_einsum(spec, a, b, dtype, a_elementwise), (a, b)


def _weight_grad(spec: str, a, g, a_cost: float = 1):
    """einsum(spec, a, g) -> fp32: a weight gradient such as `btf,btd->fd`, a and g in the dot dtype.

    YNNPACK wants the LHS row-major with the contracting dim last, so XLA:CPU makes the operand
    that owns the weight's leading dim the LHS and copies it transposed, (B*T, F) -> (F, B*T), first.
    The other operand order transposes the other operand plus the (D, F) result instead; taken when
    that costs less, counting a plain copy 1 per element and a copy of `a` `a_cost` per element
    (`RECOMPUTED_COPY_COST` when the copy recomputes a's elementwise producer). c_proj's dW
    (a = the gelu output, (B*T, 4D); g (B*T, D)) swaps when 4D*B*T*a_cost > D*B*T + 4D*D: in bf16
    (a_cost 1) when 4D < 3*B*T (mid, small; not gpt2's B*T = 512); in fp32 (a_cost 5) when
    19*B*T > 4D, i.e. at every config we run (gpt2: 7.9M vs 2.8M; 1.025x step CPU time). No other
    weight swaps at the configs we run (the head's, weighing its fused dlogits copy, measured 0.99x).
    The optimization_barrier keeps XLA's simplifier from folding the result's transpose back into
    the dot as a dim-0-contracting LHS, which YNNPACK rejects (fp32 then runs in Eigen; bf16 fails
    at run time: "Unsupported element type for DotThunk"). Same products, summed in another order
    by YNNPACK's blocking: fp32 within 4.4e-7 of the largest entry, bf16 operands bit-identical
    there (tests/models/test_weight_grad.py). jax 0.12's XLA lowers the result transpose at a jit's
    output as a `transpose` op + copy (jax 0.10: bitcast + copy), one more pass over F*D elements
    there only; inside the training step both compile the same transposes and copies.
    Assumes the contracted dims lead in both operands ((B, T, ...)), as in every model matmul.
    """
    ins, w = spec.split("->")
    sa, sg = ins.split(",")
    size = dict(zip(sa, a.shape)) | dict(zip(sg, g.shape))
    n = math.prod(size[c] for c in sa if c not in w)  # contracted: B*T
    fa = math.prod(size[c] for c in w if c in sa)  # the weight's dims from a (F)
    fg = math.prod(size[c] for c in w if c not in sa)  # ... and from g (D)
    a_first = w[0] in sa  # XLA's LHS, the operand it copies transposed: a for 'fd'
    copy_a, copy_g = n * fa * a_cost, n * fg  # what a transposed copy of each operand costs
    cpu_swap = (copy_g if a_first else copy_a) + fa * fg < (copy_a if a_first else copy_g)
    if not (cpu_swap and _fp32_out_dots()):  # off XLA:CPU (GPU: cuBLAS takes any operand order) never
        return jnp.einsum(spec, a, g, preferred_element_type=jnp.float32)
    # the other operand on the LHS, its weight dims first ('btd,btf->df' for 'fd'), then back to w's order
    (s1, x1), (s2, x2) = ((sg, g), (sa, a)) if a_first else ((sa, a), (sg, g))
    order = "".join(c for c in w if c in s1) + "".join(c for c in w if c not in s1)
    r = jnp.einsum(f"{s1},{s2}->{order}", x1, x2, preferred_element_type=jnp.float32)
    return jnp.transpose(jax.lax.optimization_barrier(r), [order.index(c) for c in w])


def _mixed_bwd(spec, dtype, a_elementwise, res, g):
    a, b = res
    ta, tb = _transpose_specs(spec)
    g = dot_operand(g, dtype)
    da = jnp.einsum(ta, g, dot_operand(b, dtype), preferred_element_type=jnp.float32)
    a_cost = RECOMPUTED_COPY_COST if a_elementwise and dtype == jnp.float32 else 1
    db = _weight_grad(tb, dot_operand(a, dtype), g, a_cost)
    return da.astype(a.dtype), db.astype(b.dtype)


mixed_einsum.defvjp(_mixed_fwd, _mixed_bwd)


def _fp32_out_dots() -> bool:
    """Matmuls return fp32 on the CPU backend only (see the module docstring)."""
    return jax.default_backend() == "cpu"


@dataclass(frozen=True)
class Policy:
    name: str
    compute_dtype: jnp.dtype  # activations and matmul operands
    param_dtype: jnp.dtype = jnp.float32  # master weights, grads, optimizer state
    accum_dtype: jnp.dtype = jnp.float32  # LN stats, softmax, logits, loss

    @property
    def attention_core(self) -> bool:
        """Whether the attention core is jaxpar.models.mixed_attention's hand-written one (CPU, bf16 and
        fp32: dots in forms YNNPACK takes; see the module docstring)."""
        return self.compute_dtype in (jnp.bfloat16, jnp.float32) and _fp32_out_dots()

    def matmul_precision(self):
        """The context every matmul of the model is traced in. fp32 off CPU: `float32` dots, because
        JAX's default there computes fp32 dots in reduced precision (TF32 on NVIDIA GPUs since Ampere,
        bf16 passes on TPU: docs.jax.dev "Matmul precision"; one H200 ran jaxpar's fp32 x fp32 dots as
        `cutlass_80_tensorop_s1688gemm`, a TF32 kernel), and precision=fp32 promises fp32 for exact
        comparisons. JAX bakes the precision into each dot when it is traced, the backward's
        transposes included, so entering it around the forward covers both. Elsewhere no change (CPU
        dots are fp32 already; bf16 operands are not 32-bit)."""
        if self.compute_dtype == jnp.float32 and jax.default_backend() != "cpu":
            return jax.default_matmul_precision("float32")
        return contextlib.nullcontext()

    def cast(self, x):
        """Cast a (fp32) parameter or activation to the compute dtype."""
        return x.astype(self.compute_dtype)

    def einsum(self, spec: str, a, b, a_elementwise: bool = False):
        """fp32 result of a weight matmul (no batch dims) with compute-dtype operands (logits).
        a_elementwise: `a` is an elementwise function's output (gelu); see `mixed_einsum`."""
        if self.compute_dtype == jnp.float32 and not _fp32_out_dots():
            return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
        # CPU: bf16 x bf16 -> fp32, or fp32 with YNNPACK's backward forms. GPU bf16: the same custom
        # VJP, for its backward: jax's own transpose feeds the fp32 cotangent (the (B, T, V) dlogits)
        # to fp32 x fp32 dots, TF32 on Hopper; mixed_einsum casts it to bf16 first (as torch.autocast
        # does). Measured on one H200, GPT-2 350M B8 T1024: the head's two backward dots took 11.8 of
        # the step's 68 ms at 133-150 TFLOP/s (benchmarks/README.md, "gpu_mfu.py").
        return mixed_einsum(spec, a, b, self.compute_dtype, a_elementwise)

    def linear(self, spec: str, x, w, bias=None, x_elementwise: bool = False):
        """einsum(x, w) (+ bias in fp32), in the compute dtype: every matmul of the blocks.
        x_elementwise: x is an elementwise function's output (gelu); see `mixed_einsum`."""
        if self.compute_dtype == jnp.float32 or _fp32_out_dots():
            y = self.einsum(spec, x, w, x_elementwise)  # fp32
            return (y if bias is None else y + bias).astype(self.compute_dtype)
        y = jnp.einsum(spec, self.cast(x), self.cast(w))  # bf16 out (fp32 accumulation in the unit)
        return y if bias is None else add_bias(y, bias)


def add_bias(y, bias):
    """y + bias computed in fp32 and cast back to y's dtype. With bf16 activations the bias
    gradient is then an fp32 sum over every (batch, seq) position of the cotangent; a bf16 add
    would sum it in bf16 (measured: 3.4e-2 relative error on gpt2-tiny's c_attn.bias, vs 6.6e-3
    worst-case for any parameter with the fp32 add)."""
    return (y.astype(jnp.float32) + bias).astype(y.dtype)


POLICIES = {"bf16": Policy("bf16", jnp.bfloat16), "fp32": Policy("fp32", jnp.float32)}


FP32 = POLICIES["fp32"]


def get_policy(name: str) -> Policy:
    return POLICIES[name]
