"""GPU lane: the bf16 training step on the GPU against the fp32 step on the CPU, and
`model.attention=auto` training every preset's attention shape and odd head dims on the GPU.

Bounds: parity.bf16.* (jaxpar/tolerances.py), derived for gpt2-tiny at B=8, T=32: a loss is the
mean of B*T = 256 per-token losses with independent bf16 roundings (U_BF16/sqrt(256)); a gradient
tensor in l2 carries four bf16-rounded operands per backward matmul (sqrt(4)*U_BF16).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from support.gpu import require_gpu

from jaxpar.tolerances import TRAJECTORY

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _gpu():
    require_gpu()


def _loss_and_grads(mc, precision: str, platform: str, tokens: np.ndarray):
    """(loss, {path: grad}) of one batch on the first device of `platform`, seed-0 weights."""
    import jax

    from jaxpar.config import Config, TrainConfig
    from jaxpar.models import gpt2
    from jaxpar.parallel.layout import build_layout
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.train import make_loss_fn

    B, T1 = tokens.shape
    cfg = Config(model=mc, precision=precision, train=TrainConfig(batch_size=B, seq_len=T1 - 1))
    dev = jax.devices(platform)[0]
    lay = build_layout(cfg, 1)
    loss_fn = make_loss_fn(lay, build_mesh(lay, [dev]))
    params = jax.device_put(gpt2.init_params(mc, 0), dev)
    x, y = (jax.device_put(a, dev) for a in (tokens[:, :-1], tokens[:, 1:]))
    loss, g = jax.jit(jax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, None)))(params, x, y)
    flat = {jax.tree_util.keystr(k): np.asarray(v, np.float64) for k, v in jax.tree_util.tree_leaves_with_path(g)}
    return float(loss), flat


def test_bf16_gpu_step_within_the_bf16_bounds_of_the_fp32_cpu_step():
    from jaxpar.config import PRESETS

    mc = PRESETS["gpt2-tiny"]  # head dim 32: cuDNN flash attention under attention=auto
    tokens = np.random.default_rng(0).integers(0, mc.vocab_size, (8, 33)).astype(np.int32)
    loss_gpu, g_gpu = _loss_and_grads(mc, "bf16", "gpu", tokens)
    loss_cpu, g_cpu = _loss_and_grads(mc, "fp32", "cpu", tokens)
    tol = TRAJECTORY["bf16"]
    assert abs(loss_cpu - math.log(mc.vocab_size)) < 0.1  # GPT-2's init: ln(V)
    assert abs(loss_gpu - loss_cpu) / loss_cpu <= tol["loss_rel"], (loss_gpu, loss_cpu)
    assert g_gpu.keys() == g_cpu.keys()
    worst = max((float(np.linalg.norm(g_gpu[k] - g_cpu[k]) / np.linalg.norm(g_cpu[k])), k) for k in g_cpu)
    assert worst[0] <= tol["grad_l2_rel"], worst
    assert worst[0] > 0  # the GPU step really ran in bf16


@pytest.mark.parametrize("name, n_embd, n_head", [
    ("gpt2-tiny", None, None), ("gpt2", None, None), ("gpt2-medium", None, None), ("gpt2-large", None, None),
    ("gpt2-xl", None, None),  # head dims 32 and 64: cuDNN
    ("odd-12", 96, 8), ("odd-264", 528, 2), ("odd-20", 100, 5),  # not a multiple of 8, or > 256: einsum
])
def test_auto_attention_trains_every_preset_shape_and_odd_head_dims(name, n_embd, n_head):
    """One bf16 loss and gradient of a 1-layer model with the preset's width and heads (or an odd
    head dim), T=128, with the attention auto chose for it. The loss at init: the logits h·wte[v]
    of a unit-variance h (after ln_f) and N(0, 0.02^2) embeddings are ~N(0, s^2), s^2 = 4e-4*D,
    so the loss is ln(V) + s^2/2 (0.32 above ln(V) at gpt2-xl's D=1600)."""
    from jaxpar.config import PRESETS
    from jaxpar.models import gpt2
    from jaxpar.models.attention_choice import cudnn_accepts, current_accelerator
    from jaxpar.models.precision import get_policy

    base = PRESETS.get(name, PRESETS["gpt2-tiny"])
    mc = dataclasses.replace(base, n_layer=1, n_positions=128,
                             **({} if n_embd is None else {"n_embd": n_embd, "n_head": n_head}))
    acc = current_accelerator()
    want = "cudnn" if cudnn_accepts(acc, mc.head_dim, "bfloat16", 0.0) else "einsum"
    if name.startswith("odd") or acc.compute_capability < (8, 0):
        assert want == "einsum"
    else:
        assert want == "cudnn"
    assert gpt2.attention_impl("auto", get_policy("bf16"), 0.0, mc.head_dim) == want
    tokens = np.random.default_rng(1).integers(0, mc.vocab_size, (2, 129)).astype(np.int32)
    loss, g = _loss_and_grads(mc, "bf16", "gpu", tokens)
    assert abs(loss - (math.log(mc.vocab_size) + 2e-4 * mc.n_embd)) < 0.15, loss
    assert all(np.isfinite(v).all() for v in g.values())
