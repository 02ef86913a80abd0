"""GPU lane: cuDNN flash attention, jax's XLA attention and jaxpar's einsum core agree, and cuDNN
accepts exactly the head dims jaxpar.models.attention_choice says it does on this GPU.

Bounds (jaxpar/tolerances.py, derived there, not loosened here): fp32, XLA vs einsum, the attention
core's fp32 dot forms (`fp32_dots.grad`: the same products summed in another order); bf16, each of
the three against the fp32 core on the same bf16-valued inputs, l2 per tensor within
`parity.bf16.grad_l2` (2*U_BF16: four bf16-rounded operands per backward matmul, sqrt(4)*U_BF16).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.gpu import require_gpu

from jaxpar.tolerances import FP32_DOTS_VS_PLAIN, TRAJECTORY

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _gpu():
    require_gpu()


B, T, N, HD = 2, 256, 4, 64  # (B, T, N, Hd) q/k/v: GPT-2's head dim


def _layer(attention: str, precision: str):
    import jax
    import jax.numpy as jnp

    from jaxpar.config import PRESETS
    from jaxpar.models import gpt2
    from jaxpar.models.precision import get_policy

    mc = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=1, n_embd=N * HD, n_head=N, attention=attention)
    p = jax.tree.map(jnp.asarray, gpt2.init_params(mc, 0))["h"]["attn"]
    return gpt2.Attention(mc, get_policy(precision), jax.tree.map(lambda a: a[0], p))


def _out_and_grads(core, dtype, precision, compute=None):
    """The core's (B, T, N, Hd) output and its vjp against a fixed cotangent, for (q, k, v) drawn
    N(0, 1), rounded to `dtype` and passed in `compute` (default: `dtype`); float64 numpy arrays."""
    import jax
    import jax.numpy as jnp

    from jaxpar.models.precision import get_policy

    q, k, v, g = (jnp.asarray(np.random.default_rng(i).standard_normal((B, T, N, HD)), jnp.float32)
                  .astype(dtype).astype(compute or dtype) for i in range(4))

    def f(q, k, v):
        o, vjp = jax.vjp(lambda *a: core(*a, None), q, k, v)
        return o, vjp(g)

    with get_policy(precision).matmul_precision():  # fp32: float32 dots, not TF32
        o, grads = jax.jit(f)(q, k, v)
    return [np.asarray(x, np.float64) for x in (o, *grads)]


def _rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp32_xla_equals_the_einsum_core():
    import jax.numpy as jnp

    ein, xla = _layer("auto", "fp32"), _layer("xla", "fp32")
    assert (ein.impl, xla.impl) == ("einsum", "xla")  # cuDNN takes no fp32
    ref = _out_and_grads(ein._core, jnp.float32, "fp32")
    got = _out_and_grads(xla._sdpa, jnp.float32, "fp32")
    assert np.abs(ref[0]).max() > 0.1
    worst = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, ref, strict=True))
    assert worst <= FP32_DOTS_VS_PLAIN["grad"], worst


def test_bf16_cudnn_xla_and_einsum_within_the_bf16_bound_of_fp32():
    import jax.numpy as jnp

    ref = _out_and_grads(_layer("auto", "fp32")._core, jnp.bfloat16, "fp32", jnp.float32)  # bf16 values, fp32 math
    cudnn = _layer("auto", "bf16")
    assert cudnn.impl == "cudnn"  # head dim 64 in bf16 on a GPU of compute capability 8.0+
    ein = _layer("auto", "bf16")
    ein.impl = "einsum"  # no config name forces the einsum core on a GPU
    worst = {}
    for name, core in (("cudnn", cudnn._sdpa), ("xla", _layer("xla", "bf16")._sdpa), ("einsum", ein._core)):
        got = _out_and_grads(core, jnp.bfloat16, "bf16")
        worst[name] = max(_rel_l2(a, b) for a, b in zip(got, ref, strict=True))
    assert max(worst.values()) <= TRAJECTORY["bf16"]["grad_l2_rel"], worst
    assert min(worst.values()) > 0  # bf16 arithmetic, not the fp32 reference again


@pytest.mark.parametrize("head_dim", [8, 12, 64, 128, 136, 256, 264])
def test_cudnn_runs_exactly_where_the_rule_says(head_dim):
    """jax.nn.dot_product_attention(implementation="cudnn"), forward and backward, on (1, 128, 2,
    head_dim) bf16: it compiles and runs where cudnn_accepts is True for this GPU, and raises where
    it is False (jax's check at trace time, or cuDNN's at compile time)."""
    import jax
    import jax.numpy as jnp

    from jaxpar.models.attention_choice import cudnn_accepts, current_accelerator

    acc = current_accelerator()
    assert acc.platform == "gpu" and acc.cuda and acc.compute_capability is not None
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 2, head_dim)), jnp.bfloat16)

    def loss(q):
        return jax.nn.dot_product_attention(q, x, x, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()

    try:
        g = jax.jit(jax.grad(loss))(x)
        ran = bool(jnp.isfinite(g.astype(jnp.float32)).all())
    except Exception:  # noqa: BLE001 - NotImplementedError from jax, XlaRuntimeError from cuDNN
        ran = False
    assert ran is cudnn_accepts(acc, head_dim, "bfloat16", 0.0), (acc, head_dim)
