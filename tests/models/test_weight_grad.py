"""The weight gradient's operand order (jaxpar/models/precision.py `_weight_grad`).

XLA:CPU copies the LHS of a weight-gradient dot transposed, (B*T, F) -> (F, B*T), before its
YNNPACK dot; `_weight_grad` picks the operand order whose transposed copies cost less: elements,
a copy of an elementwise function's output (`a_elementwise`, the gelu) weighted
`RECOMPUTED_COPY_COST` in fp32 (XLA recomputes the function inside the copy). Pinned here per
case: which (F, B, T) operand the compiled backward transposes (shapes of its `transpose` ops; how XLA
lowers the swapped form's small result transpose changed in jax 0.12 and is checked apart), every dot in
YNNPACK, and both cotangents equal to the plain einsums' (dx bit-identical; dW the same products
summed in another order, within FP32_DOTS_VS_PLAIN), in fp32 and bf16; and, in the gpt2 step,
which of c_proj's operands is transposed. bf16 runs on every host: XLA:CPU's choice of YNNPACK
dots (`IsDotSupportedByYnn`) reads no CPU feature, and on an emulated AVX2-only host (tests/
avx2_host) these pins hold unchanged (benchmarks/README.md, "Emulated
AVX2-only host").
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import PRESETS
from jaxpar.models import gpt2, precision
from jaxpar.models.precision import mixed_einsum
from jaxpar.tolerances import FP32_DOTS_VS_PLAIN as TOL
from tests.models.test_mixed_attention import _dots

B, T = 2, 96  # B*T = 192 contracted positions


@pytest.fixture(autouse=True)
def bf16_kernel_dots(monkeypatch):
    """The bf16 cases pin the bf16 x bf16 -> fp32 YNNPACK form on every host (an AVX2-only host runs bf16
    dots as fp32 dots instead: jaxpar.models.precision.fp32_kernel_bf16_dots, whose weight gradients take the
    fp32 forms with a plain copy; tests/models/test_bf16_dot_form.py)."""
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", False)

# (spec, a's feature shape, w's shape, the (F, B, T) operands the backward transposes; the swapped forms'
# small (F, D) result transpose is checked apart: `_check`)
CASES = {
    # c_proj-like, 4D < 3*B*T: g (B,T,48) and the (48,160) result are transposed, not a (B,T,160)
    "swap_a_first": ("btf,fd->btd", (160,), (160, 48), [(48, 2, 96)]),
    # head-like, w = (V, D) with V's dims from g: a (B,T,32) and the (32,256) result, not g (B,T,256)
    "swap_g_first": ("btd,vd->btv", (32,), (256, 32), [(32, 2, 96)]),
    # c_fc-like, F = 4D from g: the plain order already transposes the smaller a (B,T,40)
    "plain": ("btd,df->btf", (40,), (40, 160), [(40, 2, 96)]),
    # F = 60 > D = 48, but g (B,T,48) plus the (48,60) result is more than a (B,T,60): plain
    "plain_close": ("btf,fd->btd", (60,), (60, 48), [(60, 2, 96)]),
}
# c_proj-like at gpt2's ratio 4D > 3*B*T, a = the gelu output (a_elementwise): by elements a (B,T,640)
# = 122880 < g (B,T,160) + the (160,640) result = 133120, so bf16 keeps the plain order; fp32 weighs a's
# copy x RECOMPUTED_COPY_COST (614400) and swaps. (spec, a's feature shape, w's shape, {dtype: transposes})
ELEMENTWISE_CASES = {
    "gelu_out": ("btf,fd->btd", (640,), (640, 160), {"float32": [(160, 2, 96)], "bfloat16": [(640, 2, 96)]}),
    # 4D < 3*B*T: swapped by elements already, in both dtypes
    "gelu_out_small_f": ("btf,fd->btd", (160,), (160, 48), {"float32": [(48, 2, 96)], "bfloat16": [(48, 2, 96)]}),
}
DTYPES = [jnp.float32, jnp.bfloat16]


def _transposes(hlo: str):
    """Shapes of every `transpose` op in compiled HLO text, sorted."""
    return sorted(tuple(int(d) for d in s.split(",")) for s in re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} transpose\(", hlo))


def _check(spec, feat, w_shape, transposed, dtype, a_elementwise, swapped, seed):
    """Compile the backward of mixed_einsum(spec, a, w) and check its transposes, dots and values."""
    ins, out = spec.split("->")
    sa, sw = ins.split(",")
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal((B, T, *feat)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    g_shape = jax.eval_shape(lambda: jnp.einsum(spec, a, w)).shape
    g = jnp.asarray(rng.standard_normal(g_shape), jnp.float32)

    def grads(a, w, g):
        return jax.vjp(lambda a, w: mixed_einsum(spec, a, w, dtype, a_elementwise), a, w)[1](g)

    step = jax.jit(grads)
    hlo = step.lower(a, w, g).compile().as_text()
    shapes = _transposes(hlo)
    # the choice `_weight_grad` makes: which (F, B, T) operand gets a transposed copy (B*T elements per feature)
    assert [s for s in shapes if len(s) == 3] == sorted(transposed)
    # the swapped form's small (D, F) -> (F, D) result transpose, never in the plain form: at the top level jax
    # 0.10's XLA lowers it as a bitcast + copy (no `transpose` op), jax 0.12's as a `transpose` op + copy, one
    # more pass over w's F*D elements there; inside a training step both lower it alike (test_gpt2_step_...)
    assert [s for s in shapes if len(s) != 3] in ([[], [w_shape]] if swapped else [[]])
    dn = {jnp.float32: "f32", jnp.bfloat16: "bf16"}[dtype]
    assert _dots(hlo) == [("ynn", "f32", dn, dn)] * 2  # dx and dW, both YNNPACK
    da, dw = step(a, w, g)
    ref_da = jax.jit(lambda g, w: jnp.einsum(f"{out},{sw}->{sa}", g.astype(dtype), w.astype(dtype),
                                             preferred_element_type=jnp.float32))(g, w)
    ref_dw = jax.jit(lambda a, g: jnp.einsum(f"{sa},{out}->{sw}", a.astype(dtype), g.astype(dtype),
                                             preferred_element_type=jnp.float32))(a, g)
    assert dw.dtype == jnp.float32 and dw.shape == w_shape
    assert float(jnp.abs(ref_dw).max()) > 1  # real sums of 192 products, not zeros
    np.testing.assert_array_equal(np.asarray(da), np.asarray(ref_da))  # dx: the same dot
    err = float(jnp.abs(dw - ref_dw).max() / jnp.abs(ref_dw).max())
    if not swapped:  # the plain order: the same dot as the reference
        assert err == 0.0
    else:  # YNNPACK blocks the swapped dot differently: the same products summed in another order
        assert err <= TOL["grad"], err


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES)
def test_weight_grad_order_transposes_the_smaller_operand_with_plain_values(case, dtype):
    spec, feat, w_shape, transposed = CASES[case]
    _check(spec, feat, w_shape, transposed, dtype, False, not case.startswith("plain"), len(case))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", ELEMENTWISE_CASES)
def test_weight_grad_weighs_an_elementwise_operands_copy_in_fp32(case, dtype):
    spec, feat, w_shape, transposed = ELEMENTWISE_CASES[case]
    transposed = transposed[jnp.dtype(dtype).name]
    swapped = transposed != [(feat[0], B, T)]  # a, the (B, T, F) gelu output, not transposed
    _check(spec, feat, w_shape, transposed, dtype, True, swapped, len(case))


MC = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=1)  # D = 128, 4D = 512


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_gpt2_step_transposes_c_projs_gelu_output_only_in_bf16(policy):
    """B*T = 128 < 4D/3: by elements c_proj's dW keeps the order that transposes the (B, T, 4D) gelu
    output (bf16, whose copies are plain); fp32, whose copy would recompute the gelu, transposes the
    (B, T, D) cotangent instead: the model passes `x_elementwise=True` for c_proj's input."""
    t = 64
    params = jax.tree.map(jnp.asarray, gpt2.init_params(MC, 0))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, MC.vocab_size, (2, t + 1)), jnp.int32)
    step = jax.jit(jax.grad(lambda p: gpt2.GPT2(MC, p, policy=policy).loss(tok[:, :-1], tok[:, 1:])))
    shapes = _transposes(step.lower(params).compile().as_text())
    gelu_out = (4 * MC.n_embd, 2, t)
    assert (gelu_out in shapes) == (policy == "bf16"), shapes
    # the swapped order's (D, 4D) -> (4D, D) result transpose (a `transpose` op here, inside the step)
    assert ((4 * MC.n_embd, MC.n_embd) in shapes) == (policy == "fp32"), shapes
