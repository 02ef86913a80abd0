"""precision=fp32 means fp32 dots on every backend (jaxpar.models.precision.Policy.matmul_precision).

JAX's default computes fp32 dots in reduced precision off CPU (TF32 on NVIDIA GPUs), so off CPU the
model traces its blocks and head at `float32` precision; JAX bakes it into each dot at trace time,
the backward's transposes included. Read off the jaxpr of the loss gradient: on CPU, with the
backend reported as "gpu" (the GPU path traced here; nothing is compiled), for every parallel path
that calls the model (single device here; the pipeline and FSDP stages run `Block` and `head_loss`).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.jaxpr_walk import dot_eqns

from jaxpar.config import PRESETS
from jaxpar.models import gpt2

MC = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=2)
F32 = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def _dot_precisions(jaxpr) -> list:
    return [e.params["precision"] for e in dot_eqns(jaxpr)]


def _grad_dots(precision: str, vocab_chunks: int = 1, remat: str = "none", attention: str = "auto") -> list:
    mc = dataclasses.replace(MC, attention=attention)
    params = jax.tree.map(jnp.asarray, gpt2.init_params(mc, 0))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, MC.vocab_size, (2, 17)), jnp.int32)

    def loss(p):
        return gpt2.GPT2(mc, p, policy=precision, vocab_chunks=vocab_chunks, remat=remat).loss(tok[:, :-1], tok[:, 1:])

    return _dot_precisions(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)


@pytest.mark.parametrize("vocab_chunks, remat, attention", [
    (1, "none", "auto"), (2, "full", "auto"), (1, "selective", "auto"), (1, "none", "xla")])
def test_fp32_off_cpu_every_dot_forward_and_backward_is_float32(monkeypatch, vocab_chunks, remat, attention):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    dots = _grad_dots("fp32", vocab_chunks, remat, attention)
    # the scan body's one layer: 4 weight matmuls x 3 + the core's 2 x 3; the head's 3 (remat adds recomputes)
    assert len(dots) >= 18 + 3, len(dots)
    assert all(p == F32 for p in dots), sorted({str(p) for p in dots})


@pytest.mark.parametrize("backend, precision", [("cpu", "fp32"), ("cpu", "bf16"), ("gpu", "bf16")])
def test_elsewhere_the_dots_keep_jaxs_default(monkeypatch, backend, precision):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    dots = _grad_dots(precision, attention="xla" if backend == "gpu" else "auto")  # cuDNN cannot trace on CPU
    # jaxpar's own dots keep JAX's default; jax.nn.dot_product_attention picks BF16_BF16_F32 for 3 of its own
    own = {"None": 21} if backend == "cpu" else {"None": 18, "BF16_BF16_F32": 3}
    assert collections.Counter(str(p) for p in dots) == own
