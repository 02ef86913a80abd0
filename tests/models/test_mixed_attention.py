"""bf16 on XLA:CPU: every matmul of the train step is a bf16 x bf16 -> fp32 YNNPACK dot.

XLA:CPU upcasts a bf16 dot to fp32 (~5x slower here) unless YNNPACK takes it in canonical
row-major form (jaxpar/models/mixed_attention.py has the rule). Pinned on the compiled HLO: the weight
matmuls forward and backward (the tied head's dW included) and the attention core's six dots,
plus the attention core's values at the policy's rounding points.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import PRESETS, ModelConfig
from jaxpar.models import gpt2
from jaxpar.models.mixed_attention import causal_attention, causal_attention_qkv
from jaxpar.models.precision import get_policy
from jaxpar.tolerances import U_BF16

F32, BF16 = jnp.float32, jnp.bfloat16
HI = jax.lax.Precision.HIGHEST


def _bf(x):
    return jnp.asarray(x, F32).astype(BF16)


def _reference(q, k, v, g):
    """causal_attention's forward and vjp written with fp32 HIGHEST einsums and the same rounding
    points (jaxpar/models/mixed_attention.py docstring): only fp32 summation order differs."""
    q32, k32, v32, g32 = (a.astype(F32) for a in (q, k, v, g))
    t, hd = q.shape[1], q.shape[-1]
    s = jnp.einsum("btnh,bsnh->bnts", q32, k32, precision=HI) / math.sqrt(hd)
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(F32).min), axis=-1)
    p16 = p.astype(BF16).astype(F32)
    o = jnp.einsum("bnts,bsnh->btnh", p16, v32, precision=HI)
    dp = jnp.einsum("btnh,bsnh->bnts", g32, v32, precision=HI)
    dv = jnp.einsum("bnts,btnh->bsnh", p16, g32, precision=HI)
    ds = p * (dp - jnp.sum(dp * p, -1, keepdims=True)) / math.sqrt(hd)
    ds16 = ds.astype(BF16).astype(F32)
    dq = jnp.einsum("bnts,bsnh->btnh", ds16, k32, precision=HI)
    dk = jnp.einsum("bnts,btnh->bsnh", ds16, q32, precision=HI)
    return tuple(a.astype(BF16) for a in (o, dq, dk, dv))


# (B, T, N, Hd): YNNPACK dots; odd T (fp32 dots for dV/dK); T = 1 (dots YNNPACK refuses: m or n == 1);
# T = 128: the core by 2 causal query blocks (mixed_attention._fwd_blocked, tests/models/test_causal_blocks.py)
SHAPES = [(2, 16, 2, 16), (1, 7, 3, 8), (2, 1, 2, 8), (1, 128, 2, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_at_the_policy_rounding_points(shape, dot_form):
    rng = np.random.default_rng(sum(shape))
    q, k, v, g = (_bf(rng.standard_normal(shape)) for _ in range(4))

    @jax.jit
    def f(q, k, v, g):  # also runs it: a dot YNNPACK rejects after XLA kept it bf16 fails here
        o, vjp = jax.vjp(causal_attention, q, k, v)
        return (o, *vjp(g))

    got, ref = f(q, k, v, g), _reference(q, k, v, g)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.dtype == b.dtype and a.shape == b.shape == shape
        if shape[1] == 1 and name in ("dq", "dk"):  # softmax over one key: scores get no gradient
            assert np.all(a == 0) and np.all(b == 0), name
            continue
        assert np.abs(b).max() > 0.05, name  # a real contraction, not zeros
        # bf16 of fp32 values that differ by summation order only: equal, or one bf16 ulp apart
        # (2 U_BF16 relative) where the fp32 value sat on a rounding boundary
        assert np.all(np.abs(a - b) <= 2 * U_BF16 * np.abs(b)), (name, float(np.abs(a - b).max()))
        assert np.mean(a == b) >= 0.95, (name, float(np.mean(a == b)))


def _dots(hlo: str):
    """(computation kind, output dtype, operand dtypes) of every dot of compiled HLO text:
    kind 'ynn' inside a __ynn_fusion computation, 'xla' anywhere else."""
    ynn = set(re.findall(r"calls=%([\w.\-]+), [^\n]*\"kind\":\"__ynn_fusion\"", hlo))
    shapes, comp, out = {}, None, []
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            comp = line.split(" ")[0].lstrip("%") if not line.startswith("ENTRY") else "ENTRY"
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", line)
        if m:
            shapes[m.group(1)] = m.group(2)
        d = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[[^=]* dot\(%([\w.\-]+), %([\w.\-]+)\)", line)
        if d:
            out.append(("ynn" if comp in ynn else "xla", d.group(1), shapes[d.group(2)], shapes[d.group(3)]))
    return out



# Compiled XLA:CPU HLO as jax 0.12 prints it: a YNNPACK dot is a dot inside a computation that a
# `__ynn_fusion` custom fusion calls; any other dot runs in Eigen (or XLA's own emitter).
CENSUS_HLO = """\
%fused_computation (param_0: f32[4,8], param_1: bf16[8,2]) -> f32[4,2] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = bf16[8,2]{1,0} parameter(1)
  ROOT %dot_general.0 = f32[4,2]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.1 (a.1: f32[4,8], b.1: bf16[8,2], c.1: f32[2,3]) -> (f32[4,2], f32[4,3]) {
  %a.1 = f32[4,8]{1,0} parameter(0)
  %b.1 = bf16[8,2]{1,0} parameter(1)
  %c.1 = f32[2,3]{1,0} parameter(2)
  %ynn_fusion = f32[4,2]{1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%fused_computation, backend_config={"fusion_config":{"kind":"__ynn_fusion"},"outer_dimension_partitions":[]}
  %dot.1 = f32[4,3]{1,0} dot(%ynn_fusion, %c.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tuple = (f32[4,2]{1,0}, f32[4,3]{1,0}) tuple(%ynn_fusion, %dot.1)
}
"""


def test_the_dot_census_tells_ynnpack_from_eigen():
    assert _dots(CENSUS_HLO) == [("ynn", "f32", "f32", "bf16"), ("xla", "f32", "f32", "f32")]
    no_ynn = CENSUS_HLO.replace('"kind":"__ynn_fusion"', '"kind":"__other"')
    assert _dots(no_ynn) == [("xla", "f32", "f32", "bf16"), ("xla", "f32", "f32", "f32")]

# Runs on every host: XLA:CPU's choice of YNNPACK bf16 dots (ynn_support.cc) reads no CPU feature, and an
# emulated AVX2-only host (tests/avx2_host) compiles and runs the same dots (benchmarks/README.md, "Emulated AVX2-only host").
# Both forms run on every host (`dot_form`): AVX2-only hosts take the fp32-kernel one by default.
def test_every_dot_of_the_bf16_step_is_a_bf16_ynnpack_dot(dot_form):
    """Reference: gpt2-tiny at one layer, fwd+bwd at B=2, T=32: per layer 4 weight matmuls x 3 dots
    and 6 attention dots, plus the tied head's 3 (logits, dx, dW); every one bf16 x bf16 -> fp32,
    or in the fp32-kernel form (AVX2-only hosts) every one an fp32 YNNPACK dot: none left in bf16."""
    mc = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=1)
    params = jax.tree.map(jnp.asarray, gpt2.init_params(mc, 0))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, mc.vocab_size, (2, 33)), jnp.int32)

    def loss(p):
        return gpt2.GPT2(mc, p, policy=get_policy("bf16")).loss(tok[:, :-1], tok[:, 1:])

    step = jax.jit(jax.value_and_grad(loss))
    dots = _dots(step.lower(params).compile().as_text())
    assert dots == [("ynn", "f32", dot_form, dot_form)] * (mc.n_layer * (4 * 3 + 6) + 3), sorted(set(dots))
    loss_value, _ = step(params)  # and it runs (a bf16 dot outside YNNPACK fails at run time)
    assert abs(float(loss_value) - math.log(mc.vocab_size)) < 0.5


def _split_attention(qkv, dtype=BF16):  # q, k, v sliced outside the custom_vjp: autodiff pads + adds
    return causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_qkv_entry_is_bit_identical_to_sliced_q_k_v(shape, dot_form):
    b, t, n, hd = shape
    rng = np.random.default_rng(sum(shape))
    qkv, g = _bf(rng.standard_normal((b, t, 3, n, hd))), _bf(rng.standard_normal(shape))

    def fwd_bwd(f):
        o, vjp = jax.vjp(f, qkv)
        return o, vjp(g)[0]

    (o, dqkv), (o_ref, dqkv_ref) = jax.jit(lambda: fwd_bwd(causal_attention_qkv))(), jax.jit(lambda: fwd_bwd(_split_attention))()
    assert o.dtype == dqkv.dtype == BF16 and dqkv.shape == qkv.shape
    assert np.abs(np.asarray(dqkv[:, :, 2], F32)).max() > 0.05  # dv is never trivially zero
    assert np.array_equal(np.asarray(o, F32), np.asarray(o_ref, F32))
    assert np.array_equal(np.asarray(dqkv, F32), np.asarray(dqkv_ref, F32))


def _census(f, qkv, g):
    """(pads, fusions writing a (B, T, 3, N, Hd) array, fusion kinds) of the compiled vjp."""
    hlo = jax.jit(lambda x: jax.vjp(f, x)[1](g)[0]).lower(qkv).compile().as_text()
    dims = ",".join(map(str, qkv.shape))
    entry = hlo[hlo.index("ENTRY"):]
    writers = re.findall(rf"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[{dims}\]\S* fusion\(", entry, re.M)
    return len(re.findall(r" pad\(", hlo)), len(writers), _dots(hlo)


def test_qkv_backward_writes_dqkv_once_without_pads(dot_form):
    """Sliced q, k, v: d(qkv) is three zero-padded copies summed in one loop fusion that reads
    every dot output per element. The qkv entry stacks: no pad, one fusion writes d(qkv), and
    the vjp's five dots (scores; dP, dV, dQ, dK) stay bf16 x bf16 -> fp32 in YNNPACK."""
    qkv, g = jnp.ones((2, 16, 3, 2, 16), BF16), jnp.ones((2, 16, 2, 16), BF16)
    ynn5 = [("ynn", "f32", dot_form, dot_form)] * 5
    assert _census(_split_attention, qkv, g) == (3, 1, ynn5)  # the census sees the pads it guards
    assert _census(causal_attention_qkv, qkv, g) == (0, 1, ynn5)


def _attention_and_grads(mc, pol, p, x, g, sliced: bool):
    """The compiled (output, d(x, params)) of gpt2.Attention with params p under the vjp of g.
    sliced=True: the same projections around causal_attention on q, k, v sliced outside it (the
    path before the fused core; autodiff pads + adds d(qkv))."""

    def f(x, p):
        if not sliced:
            return gpt2.Attention(mc, pol, p)(x)
        qkv = pol.linear("btd,dcnh->btcnh", x, p["c_attn"]["weight"], p["c_attn"]["bias"])
        o = _split_attention(qkv, pol.compute_dtype)
        return pol.linear("btnh,nhd->btd", o, p["c_proj"]["weight"], p["c_proj"]["bias"])

    def run(x, p):
        y, vjp = jax.vjp(f, x, p)
        return y, vjp(g)

    return jax.jit(run).lower(x, p).compile()


def test_gpt2_bf16_attention_runs_the_fused_qkv_core():
    """Reference: the sliced composition (projection, causal_attention on qkv[:, :, i], output
    projection): gpt2.Attention under bf16 gives the same output and gradients bit for bit, and
    its compiled vjp has no (B, T, 3, N, Hd) pad (the sliced one has 3: dq, dk, dv padded and
    summed). fp32 keeps the sliced core (measured slower fused: benchmarks/README.md): 3 pads."""
    mc = ModelConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    b, t, n, hd = 2, 16, mc.n_head, mc.head_dim
    p = jax.tree.map(lambda a: jnp.asarray(a[0]), gpt2.init_params(mc, 0)["h"]["attn"])  # layer 0
    rng = np.random.default_rng(1)
    x, g = (_bf(rng.standard_normal((b, t, mc.n_embd))) for _ in range(2))
    new, old = (_attention_and_grads(mc, get_policy("bf16"), p, x, g, s) for s in (False, True))
    fp32 = _attention_and_grads(mc, get_policy("fp32"), p, x.astype(F32), g.astype(F32), False)
    pads = [len(re.findall(rf"= \w+\[{b},{t},3,{n},{hd}\]\S* pad\(", c.as_text())) for c in (new, old, fp32)]
    assert pads == [0, 3, 3], pads
    got, want = jax.tree.leaves(new(x, p)), jax.tree.leaves(old(x, p))
    assert len(got) == len(want) == 6
    assert all(np.abs(np.asarray(a, F32)).max() > 1e-3 for a in got)  # no all-zero gradient
    for a, r in zip(got, want, strict=True):
        assert a.dtype == r.dtype and np.array_equal(np.asarray(a, F32), np.asarray(r, F32))
