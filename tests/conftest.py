"""Fixtures shared by tests/ files (the hypothesis profiles are the repository root's conftest.py)."""

import pytest

from jaxpar.models import precision


@pytest.fixture(params=[False, True], ids=["bf16_kernel", "fp32_kernel"])
def dot_form(request, monkeypatch):
    """Both forms of the bf16 policy's dots on every host: bf16 x bf16 -> fp32 (hosts with native bf16) and
    fp32 x fp32 -> fp32 of bf16-valued operands (jaxpar.models.precision.fp32_kernel_bf16_dots: AVX2-only hosts).
    Returns the dots' operand dtype in HLO ('bf16' / 'f32')."""
    monkeypatch.setattr(precision, "FP32_KERNEL_BF16_DOTS", request.param)
    return "f32" if request.param else "bf16"
