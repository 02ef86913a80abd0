"""The one table of numeric bounds used by jaxpar's tests, torchref's tests and parity_tests.

Never loosened to make a test pass: a comparison over its bound is a bug to find.

Every entry is `Bound(value, measured, why)`:
  * `measured`: the largest value of the compared quantity seen on this host kind (x86-64 with
    avx512_bf16 + amx_bf16, 2 cores; jax 0.10.2, torch 2.13.0), over every case the tests run;
    every bound also holds on a second kind (AMD EPYC Zen 4, avx512_bf16 without AMX); one
    (`torchref.fp16wire.loss`) was re-measured there, where its stale measurement first failed;
  * `value` <= 4 x measured (tests/test_tolerances.py checks measured <= value <= 4 x measured;
    a comparison measured bitwise equal gets the bound 0).
    fp32 bounds are 4 x measured rounded down to one significant digit (so 2x-4x): an fp32
    comparison only reorders sums, each reordering costs a few ulps (U_FP32 = 2^-24), and that
    noise is deterministic on one host kind; 2x-4x covers other shapes of the same test.
  * bf16 / AMP bounds follow from the bf16 unit roundoff U_BF16 = 2^-8 and the depth of the
    computation (the derivation is in `why`); on hosts without native bf16 (AVX2 only, not
    measured here) they are doubled, see `BF16_HOST_FACTOR`.
Relative errors: of a loss |a - b| / |b|; of a tensor max|a - b| / max|b| ("inf") unless the
entry says l2 (||a - b||_2 / ||b||_2), which bf16 comparisons use: entries near zero carry no
relative accuracy in bf16.

Imports only the standard library: torchref's worker processes import this module and must
stay free of jax; parity_tests and tests import it from either side.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

U_FP32 = 2.0**-24  # fp32 unit roundoff (24 significand bits)
U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significand bits)
BF16_U = U_BF16  # torchref's older name
# The smallest normal fp32. XLA:CPU may flush a result below it to zero (FTZ) in one kernel and not in
# another: each operation then errs by up to TINY_FP32 absolute besides its u relative (seen on jax
# 0.12.1: autodiff's softmax backward flushes p·Σgp = -6.6e-39 where jaxpar's keeps it).
TINY_FP32 = 2.0**-126


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's `flags` of the first CPU (empty where there is none, e.g. macOS).

    $JAXPAR_CPU_FLAGS (comma-separated, e.g. `avx,avx2,fma`) replaces them: the one test seam that
    makes this process take another host kind's paths (NATIVE_BF16, the pinned bits, bench labels);
    tests/avx2_host sets it, with the libraries' ISA caps, to emulate an AVX2-only host."""
    seam = os.environ.get("JAXPAR_CPU_FLAGS")
    if seam is not None:
        return {f.strip() for f in seam.split(",") if f.strip()}
    return proc_cpu_flags()


def _cpuinfo(field: str) -> str:
    """The first CPU's `field` line of /proc/cpuinfo ("" where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(field)), "")
    except OSError:
        return ""


def proc_cpu_flags() -> set[str]:
    """/proc/cpuinfo's `flags` of the first CPU, whatever $JAXPAR_CPU_FLAGS says."""
    return set(_cpuinfo("flags").split())


def cpu_model() -> str:
    """/proc/cpuinfo's model name: two hosts with the same flags (Intel AMX vs AMD Zen 4 without it) differ."""
    return _cpuinfo("model name")


def _native_bf16() -> bool:
    """True on x86 hosts whose CPU flags include avx512_bf16 or amx_bf16 (this host kind)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


NATIVE_BF16 = _native_bf16()
# Hosts without native bf16 run bf16 matmuls in emulation kernels whose accumulation and
# rounding points differ: one more rounding per product is allowed there. Never measured on a real
# AVX2 host; on an emulated one (tests/avx2_host, AMD Zen 4 with XLA, YNNPACK and torch capped to
# AVX2) every bf16 quantity came out within 1.0x its native value (benchmarks/README.md, "Emulated AVX2-only host").
BF16_HOST_FACTOR = 1.0 if NATIVE_BF16 else 2.0


@dataclass(frozen=True)
class Bound:
    value: float
    measured: float
    why: str


# Sizes the derivations use: gpt2-tiny (L=2 layers, D=128), the tests' batches (B=8, T=32).
_N_TOKENS = 8 * 32  # tokens in one loss (the mean over B x T)

TABLE: dict[str, Bound] = {
    # ----------------------------------------------------------------- jaxpar: sharded == single device
    # tests/parallel/test_sharding_equivalence.py (data=8, fsdp=8, tensor=4 data=2, 2x2x2; 5 AdamW steps),
    # tests/test_pipeline*.py (pipelined == one device), tests/run/test_multiprocess.py.
    "sharded.fp32.loss": Bound(1e-6, 3.77e-7, "5-step losses, worst of 4 meshes (2x2x2); sharding only reorders "
                                              "fp32 sums (partial matmuls + all-reduce, split batch means)"),
    "sharded.fp32.grad": Bound(2e-6, 6.85e-7, "step-1 gradient, inf, worst tensor (c_attn.weight) of 4 meshes"),
    "sharded.bf16.loss": Bound(1e-4, 3.75e-5, "bf16 2x2x2 vs bf16 one device, 5 steps. A priori each flipped bf16 "
                                              "rounding moves a value by <= U_BF16, but only roundings whose fp32 "
                                              "inputs differ (tensor-parallel partial sums, about U_FP32*sqrt(D) "
                                              "apart) can flip, so the loss moves ~U_BF16/100, not U_BF16"),
    "sharded.bf16.grad": Bound(2e-2, 6.15e-3, "step-1 gradient, inf, worst tensor (wte: the tied embedding sums "
                                              "lookup and logits grads of flipped roundings)"),
    "pipeline.fp32.forward": Bound(0.0, 0.0, "pipeline_blocks vs the sequential layer scan (3 layouts: non-uniform, "
                                             "circular with parked buffer, M < S), inf over the (B,T,D) output: "
                                             "bitwise equal, each row meets the same block code in the same order; "
                                             "the pipelined training steps are under sharded.fp32.* (measured "
                                             "2.1e-7 loss, 9.1e-7 grad for pipe=4 circular R=2)"),
    # tests/models/test_gelu.py: the GELU with a hand-written backward.
    "gelu.fp32.grad": Bound(1e-5, 3.14e-6, "jaxpar.models.gelu.gelu_tanh's hand-written derivative vs the "
                            "float64 one, inf relative, 65536 fp32 inputs ~ N(0, 16); jax's autodiff of "
                            "jax.nn.gelu measures the same 3.14e-6 (fp32 rounding of x^3 near |x| ~ 3)"),
    # tests/models/test_layernorm.py, tests/models/test_softmax.py: hand-written backwards vs autodiff and float64.
    "layernorm.fp32.grad": Bound(5e-7, 1.29e-7, "jaxpar.models.layernorm's backward (dx, dw, db) vs autodiff of the plain "
                                 "expression and vs float64, inf relative, (4, 16, 96) rows with mean ~ N(0, 25): "
                                 "both reorder fp32 sums over D (dx) or B*T (dw, db); autodiff itself is 1.29e-7 "
                                 "from float64"),
    "softmax.fp32.grad": Bound(9e-7, 2.33e-7, "jaxpar.models.softmax.causal_softmax's backward p(g - sum(g p)) vs autodiff "
                               "of the plain masked softmax, inf relative, (2, 3, 24, 24) scores ~ N(0, 9); "
                               "1.04e-7 from float64, autodiff itself 2.17e-7 from float64"),
    # tests/models/test_chunked.py: operator splitting (vocab / mlp chunks) and remat vs the plain model, one device.
    "chunked.fp32.loss": Bound(4e-7, 1.04e-7, "loss, worst of 4 (remat, vocab_chunks, mlp_chunks) settings: only "
                                              "the order of the chunk sums changes"),
    "chunked.fp32.grad": Bound(1e-6, 6.08e-7, "gradient, inf, worst tensor of the 4 settings"),
    # tests/models/test_chunked.py: precision=bf16 with train.mlp_chunks 2 and 32 vs bf16 unchunked (same policy).
    "chunked.bf16.grad_l2": Bound(U_BF16, 1.37e-3, "gradient, l2 per tensor, worst (ln_1.weight) of mlp_chunks 2..32 "
                                                   "(measured on the AMD Zen 4 host): chunked and plain "
                                                   "round at the same points (jaxpar.models.chunked: the chunks' input "
                                                   "gradients are summed in fp32 and rounded once), so only fp32 "
                                                   "sum orders differ; a value whose two sums straddle a bf16 "
                                                   "rounding boundary moves by one bf16 ulp (up to 2*U_BF16 "
                                                   "relative), and only a fraction of values do: U_BF16 in l2. "
                                                   "Emulated AVX2: 2.84e-3 at k=32. Summed in bf16 it was 6.4e-3 at "
                                                   "k=2, 9.9e-3 at k=32"),
    # tests/models/test_chunked.py: precision=bf16 with train.remat=selective|full and train.vocab_chunks vs bf16 plain.
    "knobs.bf16.grad_l2": Bound(8 ** 0.5 * U_BF16, 8.11e-3, "gradient, l2 per tensor, worst (h.ln_1.bias, "
                                                           "remat=selective, jax 0.12.0.1, native-bf16 dots forced by "
                                                           "$JAXPAR_CPU_FLAGS on an AVX2 EPYC; 7.83e-3 on the AMD Zen 4 "
                                                           "host; jax 0.10.2: remat=full 4.14e-3, selective 0). XLA "
                                                           "may keep a bf16 value in fp32 inside a fusion, and does so "
                                                           "differently in a recomputed forward than in the forward "
                                                           "(jax 0.12 in selective's checkpointed attention core too), "
                                                           "so the backward's matmuls take differently rounded "
                                                           "operands: q, k, v and the probabilities p, 4 per layer. "
                                                           "Layer 0's gradient carries both layers' (L=2; per layer "
                                                           "measured 8.95e-3 at layer 0, 6.81e-3 at layer 1): "
                                                           "sqrt(4*L)*U_BF16 = 1.1e-2. With "
                                                           "--xla_allow_excess_precision=false selective and full are "
                                                           "0. vocab_chunks 2.3e-7 (fp32 sum orders)"),
    # tests/run/test_multiprocess.py: `jaxpar launch nprocs=2` (2 processes x 2 devices, gloo) vs 1 x 4 devices.
    "multiprocess.fp32.loss": Bound(3e-7, 8.84e-8, "3-step losses, data=2 fsdp=2: the logged loss is reduced across "
                                                   "processes in another order"),
    "multiprocess.fp32.grad_norm": Bound(2.5e-7, 6.55e-8, "each step's pre-clip global gradient norm, 3 steps: the "
                                                        "gradient all-reduce sums the 4 shards in another order "
                                                        "across processes (gloo), so the states differ in ~2e4 "
                                                        "weights from step 1 (jax 0.10 and 0.12.1 alike); the norm "
                                                        "rounds them away on jax 0.10, not at step 3 on 0.12.1"),
    # tests/models/test_model.py: precision=bf16 logits vs fp32 on the odd shape (L=3), relative to max|logit|.
    "model.bf16.logits": Bound(5 ** 0.5 * U_BF16, 3.24e-3, "the head matmul rounds both operands to bf16 "
                                                             "(2 roundings) and each of the L=3 blocks adds one "
                                                             "rounding of the bf16 residual stream; independent, "
                                                             "in quadrature: sqrt(2 + L)*U_BF16 = 8.7e-3"),
    # tests/parallel/test_flax_model_sharding.py: a Flax NNX model of the user's own (examples/08) on
    # data=2 x fsdp=2 x tensor=2 vs one device, same weights.
    # tests/models/test_fp32_dots.py: fp32 on CPU (YNNPACK dot forms: mixed_einsum, causal_attention) vs the plain
    # path (jnp.einsum + autodiff), gpt2-tiny at 1 layer, remat none/selective, and the attention core alone.
    "fp32_dots.loss": Bound(0.0, 0.0, "loss: the forward is the same ops (only the backward's dot forms change)"),
    "fp32_dots.grad": Bound(1e-6, 2.75e-7, "gradient, inf, worst tensor (wte); attention core alone: 2.0e-7 (dK); "
                                           "the same products summed in another order"),
    # tests/models/test_causal_blocks.py: the CPU attention core by causal query blocks vs unblocked (B2 T256 N2 Hd16).
    "causal_blocks.fp32.grad": Bound(1e-6, 3.46e-7, "dK / dV (inf, relative to max): each query block's "
                                                    "contribution zero-padded and summed, another fp32 order; "
                                                    "o and dQ bit-equal (AMD Zen 4 host; 8.1e-7 at N6 Hd64)"),
    "flax_model.fp32.loss": Bound(4e-7, 1e-7, "losses of every step; sharding reorders fp32 sums"),
    "flax_model.fp32.grad": Bound(1e-6, 4e-7, "first step's gradients, inf, worst tensor"),
    # tests/run/test_bisect*.py: `jaxpar bisect`'s forward intermediates (embeddings, LayerNorms, attention
    # probs and outputs, MLP pre/post activation, residual stream, logits) of clean pairs, inf relative.
    "bisect.fp32.activation": Bound(3e-6, 9.56e-7, "worst intermediate of jaxpar vs torchref on gpt2-tiny (B8 T32): "
                                                   "h.0.mlp.c_proj, a sum over 4D products whose result is small "
                                                   "beside its terms, so the reordered fp32 sum's few ulps are "
                                                   "large relative to max|b|; the tests' shape (D32): 4.9e-7 vs "
                                                   "torchref, 4.0e-7 one device vs data=2 fsdp=2 tensor=2"),
    # ----------------------------------------------------------------- torchref strategies vs `single`
    # tests/torchref/test_torchref_strategies.py: single-ps, distributed-ps, horovod at 2 and 4 workers, 10 steps.
    "torchref.fp32.loss": Bound(6e-7, 1.72e-7, "10-step losses; per-worker means then an N-way average, bucket / "
                                               "fusion / ring order: a few fp32 roundoffs"),
    "torchref.fp32.grad": Bound(3e-6, 9.34e-7, "step-1 averaged gradient, inf, worst tensor (4 workers)"),
    "torchref.amp.loss": Bound(U_BF16 / 16, 6.83e-5, "AMP (autocast bf16) vs fp32 single, 10 steps. autocast rounds "
                                                      "each matmul's operands to bf16 (<= U_BF16 relative); a loss is "
                                                      "the mean of N = B*T = 256 per-token losses whose rounding "
                                                      "errors are independent: U_BF16/sqrt(N) = U_BF16/16 = 2.4e-4"),
    "torchref.amp.grad_l2": Bound(2 * U_BF16, 3.89e-3, "AMP step-1 gradient, l2 over all tensors. Backward of a "
                                                        "matmul is two products, each with two bf16-rounded operands: "
                                                        "four independent U_BF16 errors add in quadrature, "
                                                        "sqrt(4)*U_BF16 = 2*U_BF16 = 7.8e-3"),
    "torchref.fp16wire.loss": Bound(2e-6, 6.18e-7, "horovod compression=fp16 (2 workers) vs fp32 single, 10 steps. "
                                                   "Each worker's gradient is cast to fp16 (2^-11 relative for "
                                                   "normal values) and the two are summed in fp16, so the average g "
                                                   "carries an absolute error ~2^-12 of the workers' gradients; "
                                                   "where g is small (cancelling workers, |g| near eps) that flips "
                                                   "its sign (280 of 462,336 at step 1) and AdamW's first update "
                                                   "lr*g/(|g|+eps) turns each into a full lr-size change. 17.5% of "
                                                   "g (6.2% exactly 0) lies below fp16's smallest normal 6.1e-5, but "
                                                   "rounding only those moves the loss 2.1e-7, only the normal ones "
                                                   "6.7e-7 (benchmarks/fp16_wire_rounding.py). 6.18e-7 measured on "
                                                   "the AMD Zen 4 host with update 1 at lr/3; when it "
                                                   "ran at lr 0: 1.57e-7 there, 1.83e-7 on the AMX host (not re-"
                                                   "measured since; it passed 6e-7 there). 1-ulp jitter of the fp32 "
                                                   "gradients: 6.18e-7 to 6.66e-7: not host rounding"),
    # ----------------------------------------------------------------- parity_tests: jaxpar vs PyTorch
    # Single-device model parity (fp32): parity_tests/test_model_parity.py, gpt2-tiny and an odd shape.
    "parity.model.logits_abs": Bound(2e-6, 7.15e-7, "max |logit diff|; logits are O(1), fp32 rounding through 2-3 "
                                                    "layers"),
    "parity.model.loss": Bound(8e-7, 2.06e-7, "the loss of one batch at the shared init, relative; worst of the "
                                               "two shapes (odd)"),
    "parity.model.grad": Bound(2e-6, 6.39e-7, "every parameter's gradient, inf, worst tensor"),
    "parity.model.update": Bound(4e-5, 1.06e-5, "||dp_a - dp_b|| / ||dp_b|| per tensor after 1 and 3 AdamW steps fed "
                                                "the same gradients: ~10 fp32 ops per element on identical inputs, "
                                                "then p + dp rounds at ulp(|p|) (LayerNorm weights 1.0: ulp 1.2e-7 vs "
                                                "|dp| ~ lr = 1e-3)"),
    # Training trajectories (10 steps) and step-1 gradients against the PyTorch reference:
    # parity_tests/test_training_parity.py (+ the slow matrix), torchref strategies vs jaxpar.
    "parity.fp32.loss": Bound(1e-6, 3.14e-7, "10-step losses of every fp32 row of the full matrix (7 jaxpar meshes "
                                             "incl. pipelines, 3 torchref strategies) and torchref strategies vs "
                                             "jaxpar: the two frameworks' fp32 sums in different orders"),
    "parity.fp32.grad": Bound(3e-6, 9.34e-7, "step-1 gradient, inf, worst tensor of every fp32 row (pipe=2 and "
                                             "2x2x2 meshes; torchref 4 workers)"),
    # bf16 rows: jaxpar precision=bf16 and torchref *-amp against the fp32 reference (derivations as
    # torchref.amp.*: U_BF16/sqrt(B*T) for a loss, sqrt(4)*U_BF16 for a gradient tensor in l2).
    "parity.bf16.loss": Bound(U_BF16 / 16, 7.71e-5, "10-step losses, worst bf16 row of the full matrix (jaxpar 3-D "
                                                    "bf16; torchref AMP 6.6e-5): U_BF16/sqrt(N), N = B*T = 256 "
                                                    "tokens per loss"),
    "parity.bf16.grad_l2": Bound(2 * U_BF16, 6.46e-3, "step-1 gradient, l2 per tensor, worst bf16 row (jaxpar 3-D "
                                                      "bf16; single bf16 5.8e-3, AMP 5.3e-3): four bf16-rounded "
                                                      "operands per backward matmul, sqrt(4)*U_BF16"),
}


def _v(name: str, bf16: bool = False) -> float:
    return TABLE[name].value * (BF16_HOST_FACTOR if bf16 else 1.0)


# ---- the names the tests import (kept: other branches use them)
SHARDED_VS_SINGLE = {
    "fp32": {"loss": _v("sharded.fp32.loss"), "grad": _v("sharded.fp32.grad")},
    "bf16": {"loss": _v("sharded.bf16.loss", True), "grad": _v("sharded.bf16.grad", True)},
}
PIPELINE_FORWARD = _v("pipeline.fp32.forward")
CHUNKED_VS_PLAIN = {"loss": _v("chunked.fp32.loss"), "grad": _v("chunked.fp32.grad")}
CHUNKED_BF16_GRAD_L2 = _v("chunked.bf16.grad_l2", True)
KNOBS_BF16_GRAD_L2 = _v("knobs.bf16.grad_l2", True)
FP32_DOTS_VS_PLAIN = {"loss": _v("fp32_dots.loss"), "grad": _v("fp32_dots.grad")}
CAUSAL_BLOCKS_VS_UNBLOCKED = _v("causal_blocks.fp32.grad")
FLAX_MODEL_SHARDED_VS_SINGLE = {"loss": _v("flax_model.fp32.loss"), "grad": _v("flax_model.fp32.grad")}
MULTIPROCESS_VS_SINGLE = {"loss": _v("multiprocess.fp32.loss"), "grad_norm": _v("multiprocess.fp32.grad_norm")}
BF16_LOGITS_REL = _v("model.bf16.logits", True)

# torchref (tests/torchref/test_torchref_strategies.py, test_torchref_compare.py)
LOSS_RTOL_FP32 = _v("torchref.fp32.loss")
GRAD_TOL_FP32 = _v("torchref.fp32.grad")
LOSS_RTOL_AMP = _v("torchref.amp.loss", True)
LOSS_RTOL_FP16_WIRE = _v("torchref.fp16wire.loss")
GRAD_NORM_RTOL_AMP = _v("torchref.amp.grad_l2", True)

# parity_tests
MODEL = {"logits_abs": _v("parity.model.logits_abs"), "loss_rel": _v("parity.model.loss"),
         "grad_rel": _v("parity.model.grad"), "update_rel": _v("parity.model.update")}
TRAJECTORY = {
    "fp32": {"loss_rel": _v("parity.fp32.loss"), "grad_rel": _v("parity.fp32.grad")},
    "bf16": {"loss_rel": _v("parity.bf16.loss", True), "grad_l2_rel": _v("parity.bf16.grad_l2", True)},
}


# ----------------------------------------------------------------- a-priori bounds (property tests)
# The hand-written replacements' property tests (docs/testing.md) draw their inputs over the whole
# domain, so no one measured value bounds them: each comparison's bound is derived from the
# arithmetic instead, a function of the drawn sizes and magnitudes. The rule, from Higham's
# "Accuracy and Stability of Numerical Algorithms" (ch. 3): a sum of n terms or a chain of n
# roundings computed in a format of unit roundoff u is within gamma(n, u) * S of exact, S the same
# expression evaluated on absolute values. Two implementations of one function each within B of
# exact are within 2B of each other: every bound below is that 2B (`PAIR`).

PAIR = 2.0  # two implementations, each within the bound of the exact value


def gamma(n: float, u: float = U_FP32) -> float:
    """Higham's gamma_n = n·u / (1 - n·u): the relative bound of n roundings (a sum of n + 1 terms
    in any order, a product of n factors) in a format of unit roundoff u."""
    if n * u >= 1:
        raise ValueError(f"gamma({n}, {u}): n·u >= 1, no bound")
    return n * u / (1 - n * u)


def bias_correction_error(beta: float, count: int) -> float:
    """Relative error of 1 - beta**count computed in fp32 (optax.tree.bias_correction, jaxpar.optim):
    beta rounds to fp32 (u), the power multiplies that by count and rounds twice more, so beta**count
    is within (count + 2)·u·beta**count of exact; the subtraction cancels to 1 - beta**count and
    rounds once more. At count 1, beta = 0.999: 1e3·u (the cancellation, not fp32 noise)."""
    if beta == 0:
        return U_FP32
    b = beta**count
    return (count + 2) * U_FP32 * b / (1 - b) + U_FP32


def adamw_step_bounds(n, p, gc, m, v, *, b1, b2, eps, wd, lr, count, clip_eps_rel=0.0):
    """Per-element bounds (mu, nu, params) on |a - b| for two implementations of one
    clip_by_global_norm -> AdamW step, on one element of a tree of n fp32 elements. Arguments are
    float64 arrays (or floats) of the exact quantities: p the old weight, gc the clipped gradient,
    m, v the old moments; clip_eps_rel the relative amount by which a reference's clip factor
    differs from clip / norm by construction (torch's clip_grad_norm_ divides by norm + 1e-6:
    1e-6 / norm; optax and jaxpar.optim: 0).

    Per implementation (then x PAIR):
      clip factor   e_c = (n/2 + 3)·u + clip_eps_rel: the norm is a sum of n squares (n·u relative,
                    all terms positive), its sqrt halves that and rounds (u); g / norm · clip two more;
      mu            (e_c + 6u)·(b1|m| + (1-b1)|gc|): the two products, the sum, the rounding of
                    1 - b1 and torch's lerp form m + (1-b1)(g - m) (<= 5 roundings of that sum);
      nu            (2e_c + 6u)·nu (every term non-negative; gc enters squared);
      update        u = (mu/bc1) / (sqrt(nu/bc2) + eps): mu's error and its bias correction
                    (`bias_correction_error`) over the denominator, plus |u| times the denominator's
                    relative error (half nu's and bc2's, the sqrt, the eps add) and the division;
      params        lr·|du| + 5u·(|p| + lr|u| + lr·wd|p|): the decay product and sum, lr·update and
                    the final add (torch's p·(1 - lr·wd) and lr/bc1 split one of them in two).
    """
    u = U_FP32
    e_c = (n / 2 + 3) * u + clip_eps_rel
    a_m = b1 * abs(m) + (1 - b1) * abs(gc)
    mu = b1 * m + (1 - b1) * gc
    nu = b2 * v + (1 - b2) * gc * gc
    d_mu = (e_c + 6 * u) * a_m
    e_nu = 2 * e_c + 6 * u
    bc1, bc2 = 1 - b1**count, 1 - b2**count
    e1, e2 = bias_correction_error(b1, count), bias_correction_error(b2, count)
    root = (nu / bc2) ** 0.5
    den = root + eps
    upd = mu / bc1 / den
    e_den = (0.5 * (e_nu + e2) + 2 * u) * root / den + u
    d_upd = (d_mu / bc1 + abs(mu) / bc1 * e1) / den + abs(upd) * (e_den + u)
    d_p = lr * d_upd + 5 * u * (abs(p) + lr * abs(upd) + lr * wd * abs(p))
    return PAIR * d_mu, PAIR * e_nu * nu, PAIR * d_p
