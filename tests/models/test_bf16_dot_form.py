"""The bf16 policy's dots in the fp32-kernel form (jaxpar.models.precision.fp32_kernel_bf16_dots): on XLA:CPU
without native bf16 (AVX2-only hosts) every bf16 x bf16 -> fp32 dot runs as an fp32 dot of the same
bf16 values, because YNNPACK's AVX2 bf16 kernel is 1.6-2x slower than its fp32 one (benchmarks/
README.md, bf16_dot_form.py). Same numerics: the operands hold exactly the bf16-rounded values. The dot forms of
both are pinned in tests/models/test_mixed_attention.py, test_causal_blocks.py and test_precision.py
(`dot_form`); here the rounding itself and which hosts take the form."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxpar.tolerances
from jaxpar.models import precision
from jaxpar.models.precision import dot_operand

F32, BF16 = jnp.float32, jnp.bfloat16


def _edge_values() -> np.ndarray:
    """fp32 values where rounding to bf16 can go wrong: ties (to even, both ways), just off ties,
    the overflow edge, subnormals, zeros, infinities, NaN, and random values over 80 binades."""
    one = np.float32(1)
    ulp = np.float32(2.0**-7)  # bf16's spacing at 1
    ties = [one + ulp / 2, one + 3 * ulp / 2, -(one + ulp / 2), np.float32(3) + np.float32(2.0**-6) / 2]
    near = [np.nextafter(t, np.float32(np.inf)) for t in ties] + [np.nextafter(t, np.float32(0)) for t in ties]
    big = [np.finfo(np.float32).max, np.float32(3.3895e38), np.float32(3.3961776e38), -np.finfo(np.float32).max]
    tiny = [np.float32(1e-40), np.float32(-3e-39), np.finfo(np.float32).smallest_subnormal, np.float32(1.1754942e-38)]
    special = [np.float32(0), np.float32(-0.0), np.float32(np.inf), np.float32(-np.inf)]
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(4000) * np.exp2(rng.integers(-40, 40, 4000))).astype(np.float32)
    return np.concatenate([np.array(ties + near + big + tiny + special, np.float32), rand])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fp32_operand_is_rounded_exactly_as_the_bf16_cast(monkeypatch, jit):
    """dot_operand(x fp32, bf16) in the fp32-kernel form: fp32 holding bf16(x) bit for bit (round to
    nearest even, overflow to inf, subnormals), as numpy's ml_dtypes cast; NaN stays NaN."""
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", True)
    x = _edge_values()
    f = jax.jit(lambda a: dot_operand(a, BF16)) if jit else (lambda a: dot_operand(a, BF16))
    got = np.asarray(f(jnp.asarray(x)))
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isnan(np.asarray(f(jnp.float32(np.nan))))
    assert not np.array_equal(got, x)  # the inputs do need rounding (most random values are not bf16)


def test_bf16_operand_is_upcast_exactly_and_other_forms_cast(monkeypatch):
    x = _edge_values().astype(ml_dtypes.bfloat16)
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", True)
    up = dot_operand(jnp.asarray(x), BF16)
    assert up.dtype == F32 and np.array_equal(np.asarray(up), x.astype(np.float32))
    assert dot_operand(jnp.ones(3, F32), F32).dtype == F32  # the fp32 policy: untouched
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", False)
    assert dot_operand(jnp.ones(3, F32), BF16).dtype == BF16  # the bf16-kernel form: the plain cast


@pytest.mark.parametrize("native", [True, False])
def test_fp32_kernel_form_is_taken_on_cpu_hosts_without_native_bf16(monkeypatch, native):
    """Auto (FP32_KERNEL_BF16_DOTS None): the fp32-kernel form exactly where XLA:CPU has no avx512_bf16 /
    AMX (jaxpar.tolerances.NATIVE_BF16, which $JAXPAR_CPU_FLAGS and tests/avx2_host set); never off CPU."""
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", None)
    monkeypatch.setattr(jaxpar.tolerances, "NATIVE_BF16", native)
    assert precision.fp32_kernel_bf16_dots() is (not native)
    monkeypatch.setattr(precision, "_fp32_out_dots", lambda: False)  # GPU/TPU: bf16 dots as they are
    assert precision.fp32_kernel_bf16_dots() is False
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", True)  # forced (benchmarks, tests)
    assert precision.fp32_kernel_bf16_dots() is True
