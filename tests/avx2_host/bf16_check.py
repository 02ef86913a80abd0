"""One small bf16 check and the state of every cap, as JSON on stdout (tests/bench/test_avx2_host.py runs it
under the emulation; `python -m tests.avx2_host python -m tests.avx2_host.bf16_check` by hand).

gpt2-tiny (L=2, D=128), B=8, T=32, seed 0, one batch: precision=bf16 vs fp32 at the same weights:
  loss_rel     |loss_bf16 - loss_fp32| / |loss_fp32|            (bound: parity.bf16.loss)
  grad_l2_rel  worst tensor of ||g_bf16 - g_fp32||_2 / ||g_fp32||_2 (bound: parity.bf16.grad_l2)
  logits_rel   the ODD shape of tests/models/test_model.py (L=3), max|diff| / max|logit| (model.bf16.logits)
The bounds are the ones this process's jaxpar.tolerances gives (x BF16_HOST_FACTOR)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import tolerances as T
from jaxpar.config import PRESETS, ModelConfig
from jaxpar.models import gpt2, precision

ODD = ModelConfig(n_layer=3, n_embd=60, n_head=5, vocab_size=101, n_positions=40)  # tests/models/test_model.py


def loss_and_grads(cfg, params, tokens, policy):
    def f(p):
        return gpt2.cross_entropy(gpt2.GPT2(cfg, p, policy=policy)(tokens[:, :-1]), tokens[:, 1:])

    return jax.jit(jax.value_and_grad(f))(params)


def main() -> dict:
    cfg = PRESETS["gpt2-tiny"]
    params = gpt2.init_params(cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 33)), jnp.int32)
    l32, g32 = loss_and_grads(cfg, params, tokens, "fp32")
    l16, g16 = loss_and_grads(cfg, params, tokens, "bf16")
    rel = jax.tree.map(lambda a, b: float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel())), g16, g32)
    odd = gpt2.init_params(ODD, seed=1)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, 101, (2, 16)), jnp.int32)
    o32, o16 = (jax.jit(lambda p, t, pol=pol: gpt2.GPT2(ODD, p, policy=pol)(t))(odd, toks) for pol in ("fp32", "bf16"))
    import torch

    return {"loss_rel": abs(float(l16) - float(l32)) / abs(float(l32)),
            "grad_l2_rel": max(jax.tree.leaves(rel)),
            "logits_rel": float(jnp.abs(o16 - o32).max() / jnp.abs(o32).max()),
            "bounds": {"loss_rel": T.TRAJECTORY["bf16"]["loss_rel"], "grad_l2_rel": T.TRAJECTORY["bf16"]["grad_l2_rel"],
                       "logits_rel": T.BF16_LOGITS_REL},
            "native_bf16": T.NATIVE_BF16, "bf16_host_factor": T.BF16_HOST_FACTOR,
            "fp32_kernel_bf16_dots": precision.fp32_kernel_bf16_dots(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "ynn_arch_flags": os.environ.get("JAXPAR_YNN_ARCH_FLAGS", ""),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}


if __name__ == "__main__":
    print(json.dumps(main()))
