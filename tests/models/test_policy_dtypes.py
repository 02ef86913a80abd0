"""The precision policy read from the traced program, not inferred from loss bounds.

precision=bf16 promises (README, jaxpar/models/precision.py): matmul operands in bf16; LayerNorm
statistics, softmax, logits and loss in fp32. The forward jaxpr of gpt2-tiny's loss lists every
dot, reduction and transcendental with its dtypes; the tables below are the hand count of the
model's ops (reference: the model's equations, one block body of the scan, per op):

  dots (7): c_attn, q·k scores, probs·v, attn c_proj, c_fc, mlp c_proj, logits (x·wteᵀ)
  reductions on fp32 inputs: LayerNorm mean and variance (2 per LN: ln_1, ln_2, ln_f), softmax
  max and sum, logsumexp max and sum, the target-logit pick, the mean over tokens.

Gradient reduction in fp32 is checked on the compiled sharded step (test_policy_shardings.py);
torchref's autocast dtype in test_policy_amp.py.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jcore
from support.jaxpr_walk import all_eqns

from jaxpar.config import PRESETS
from jaxpar.models import gpt2, precision
from jaxpar.models.precision import get_policy

MC = PRESETS["gpt2-tiny"]
B, T, D, N, V = 2, 16, MC.n_embd, MC.n_head, MC.vocab_size
F, HD = 4 * D, D // N
WATCHED = ("dot_general", "reduce_sum", "reduce_max", "reduce_min", "argmax", "exp", "log", "rsqrt", "sqrt",
           "logistic", "log1p", "expm1")


def eqns(mc, precision: str, key=None):
    """Every equation of the forward loss jaxpr, nested jaxprs (scan body, pjit, custom_jvp) included."""

    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    yield from all_eqns(jax.make_jaxpr(lambda p, x, y: gpt2.GPT2(mc, p, policy=get_policy(precision)).loss(x, y, key))(
        gpt2.abstract_params(mc), tok, tok).jaxpr)


def ops(precision: str, mc=MC, key=None) -> collections.Counter:
    """Counter of (primitive, input shapes, input dtypes, output dtype) over the forward loss jaxpr."""
    found: collections.Counter = collections.Counter()
    for e in eqns(mc, precision, key):
        if e.primitive.name in WATCHED:
            ins = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in e.invars)
            found[(e.primitive.name, ins, str(e.outvars[0].aval.dtype))] += 1
    return found


def expected(compute: str, mixed_attention: bool = True) -> collections.Counter:
    """The hand count. compute: dtype of activations and matmul operands ('bfloat16' | 'float32');
    mixed_attention=False: the plain attention core (dropout), whose probs·v dot returns `compute`."""
    c, f = compute, "float32"
    # weight matmuls on CPU (where these tests run): bf16 x bf16 -> fp32 dots, bias added in fp32,
    # then one cast to bf16 (jaxpar/models/precision.py; XLA:CPU's fast bf16 form). On GPU they return bf16.
    w = f
    dot = lambda a, b, out: ("dot_general", ((a, c), (b, c)), out)  # noqa: E731
    red = lambda prim, shape: (prim, ((shape, f),), f)  # noqa: E731
    return collections.Counter({
        dot((B, T, D), (D, 3, N, HD), w): 1,  # c_attn
        dot((B, T, N, HD), (B, T, N, HD), f): 1,  # scores, fp32 out (preferred_element_type)
        # v·probs (probs cast to the compute dtype); on CPU bf16 an fp32-out dot then one cast
        # (jaxpar/models/mixed_attention.py: bf16 x bf16 -> bf16 is no YNNPACK kernel)
        dot((B, T, N, HD), (B, N, T, T), w if c == "bfloat16" and mixed_attention else c): 1,
        dot((B, T, N, HD), (N, HD, D), w): 1,  # attn c_proj
        dot((B, T, D), (D, F), w): 1,  # c_fc
        dot((B, T, F), (F, D), w): 1,  # mlp c_proj
        dot((B, T, D), (V, D), f): 1,  # logits, fp32 out
        red("reduce_sum", (B, T, D)): 6,  # LayerNorm mean + variance: ln_1, ln_2 (scan body), ln_f
        ("rsqrt", (((B, T, 1), f),), f): 3,  # LayerNorm 1/sqrt(var + eps)
        red("reduce_max", (B, N, T, T)): 1,  # softmax
        ("exp", (((B, N, T, T), f),), f): 1,
        red("reduce_sum", (B, N, T, T)): 1,
        red("reduce_max", (B, T, V)): 1,  # logsumexp
        ("exp", (((B, T, V), f),), f): 1,
        red("reduce_sum", (B, T, V)): 2,  # logsumexp sum, target-logit pick
        ("log", (((B, T), f),), f): 1,
        red("reduce_sum", (B, T)): 1,  # mean over tokens
    })


@pytest.fixture
def bf16_kernel(monkeypatch):
    """The bf16 x bf16 -> fp32 dot form on every host (AVX2-only hosts take the fp32-kernel form below)."""
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", False)


def test_bf16_policy_matmuls_bf16_statistics_softmax_logits_loss_fp32(bf16_kernel):
    """Reference: hand count of the model's ops (module docstring)."""
    assert ops("bf16") == expected("bfloat16")


def _dot_operand_sources(jaxpr):
    """(producer primitive, its input dtype, its mantissa_bits) of each operand of every dot, nested jaxprs included."""
    made_by = {}
    for e in jaxpr.eqns:
        made_by.update({o: e for o in e.outvars})
        if e.primitive.name == "dot_general":
            yield tuple((made_by[v].primitive.name, str(made_by[v].invars[0].aval.dtype),
                         made_by[v].params.get("exponent_bits"), made_by[v].params.get("mantissa_bits"))
                        if v in made_by else ("input", str(v.aval.dtype), None, None) for v in e.invars)
        for v in e.params.values():
            for j in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(j, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    yield from _dot_operand_sources(getattr(j, "jaxpr", j))


def test_bf16_policy_fp32_kernel_form_dots_take_bf16_values(monkeypatch):
    """AVX2-only hosts (jaxpar.models.precision.fp32_kernel_bf16_dots): the same hand count with fp32 dot operands,
    each one made right before its dot by an exact upcast of a bf16 array or a rounding to bf16's 8
    exponent / 7 mantissa bits: c_attn, c_fc, both c_projs and the logits take a bf16 activation and a
    rounded fp32 weight; scores take q, k (bf16, upcast) and probs·v the rounded fp32 probs and bf16 v."""
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", True)
    want = collections.Counter({(k[0], tuple((shape, "float32") for shape, _ in k[1]) if k[0] == "dot_general" else k[1],
                                 k[2]): n for k, n in expected("bfloat16").items()})
    assert ops("bf16") == want
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, x, y: gpt2.GPT2(MC, p, policy=get_policy("bf16")).loss(x, y))(
        gpt2.abstract_params(MC), tok, tok).jaxpr
    up, rounded = ("convert_element_type", "bfloat16", None, None), ("reduce_precision", "float32", 8, 7)
    assert collections.Counter(_dot_operand_sources(jaxpr)) == {(up, rounded): 6, (up, up): 1}


def test_bf16_with_dropout_plain_attention_core_keeps_fp32_scores_and_softmax(bf16_kernel):
    """Reference: the hand count; attention dropout runs gpt2.Attention._core (mixed_attention has
    no dropout), whose scores and softmax are fp32 and probs·v a compute-dtype dot. Dropout adds
    no watched op (bernoulli draws are integer bit ops and a compare)."""
    import dataclasses

    assert ops("bf16", dataclasses.replace(MC, dropout=0.1), jax.random.key(0)) == expected(
        "bfloat16", mixed_attention=False)


def test_fp32_policy_has_no_bf16_op():
    """Reference: hand count; precision=fp32 (parity, sharding tests) must compute every op in fp32."""
    assert ops("fp32") == expected("float32")


def test_bf16_logits_are_never_rounded_to_bf16():
    """The (B, T, V) logits stay fp32 from the dot onwards: no float value of that shape is ever bf16
    (a bf16 round trip after an fp32 dot keeps every dot's dtype above intact but loses ~u·|logit|).
    Reference: the README's policy; vocab 200 so no other activation (B, T, F=512) shares the shape."""
    import dataclasses

    shape, found = (B, T, 200), collections.Counter()
    for e in eqns(dataclasses.replace(MC, vocab_size=200), "bf16"):
        for v in e.outvars:
            if tuple(v.aval.shape) == shape and jnp.issubdtype(v.aval.dtype, jnp.floating):
                found[str(v.aval.dtype)] += 1
    assert found["float32"] >= 3 and set(found) == {"float32"}, found  # dot output, logsumexp, target pick
