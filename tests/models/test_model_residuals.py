"""Census of what the GPT-2 layer scan saves for backward (jax.ad_checkpoint.print_saved_residuals).

Every array a layer saves is stacked by `lax.scan` into an (L, ...) buffer that the step writes
and reads once per layer, so the list below is the per-layer residual set, pinned exactly: a new
residual (say autodiff of a LayerNorm or softmax coming back) fails it. Reference, per layer:
  (B, T, D)      ln_1's input x, ln_1's output, ln_2's input, ln_2's output   (jaxpar.models.layernorm
  (B, T, 1) fp32 mean and rstd of ln_1 and ln_2                                saves x + 2 stats)
  (B, T, N, Hd)  q, k, v and the attention output
  (B, N, T, T)   the fp32 softmax probs only (jaxpar.models.softmax / mixed_attention: no mask, no scores)
  (B, T, 4D)     c_fc's output and GELU's output (jaxpar.models.gelu)
in the compute dtype except where fp32 is written. Before the hand-written LayerNorm and softmax
backwards fp32 saved 24 arrays per layer (84 MiB at the mid benchmark config, now 60 MiB).
"""

import collections
import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

from jaxpar.config import ModelConfig
from jaxpar.models import gpt2

L, B, T, D, N = 3, 2, 16, 32, 2
MC = ModelConfig(n_layer=L, n_embd=D, n_head=N, vocab_size=64, n_positions=64)


def _stacked(capsys, policy: str, remat: str = "none") -> list[str]:
    """The (L, ...) residuals the layer scan saves, as 'dtype[dims]' strings, sorted."""
    params = jax.tree.map(jnp.asarray, gpt2.init_params(MC, 0))
    tok = jnp.zeros((B, T + 1), jnp.int32)
    print_saved_residuals(lambda p: gpt2.GPT2(MC, p, policy=policy, remat=remat).loss(tok[:, :-1], tok[:, 1:]), params)
    lines = capsys.readouterr().out.splitlines()
    return sorted(ln.split(" ")[0] for ln in lines if "output of scan" in ln and re.match(rf"\w+\[{L},", ln))


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_layer_scan_saves_exactly_these(capsys, policy):
    c = "f32" if policy == "fp32" else "bf16"
    hd = D // N
    want = sorted([f"{c}[{L},{B},{T},{D}]"] * 4 + [f"f32[{L},{B},{T},1]"] * 4 + [f"{c}[{L},{B},{T},{N},{hd}]"] * 4
                  + [f"f32[{L},{B},{N},{T},{T}]"] + [f"{c}[{L},{B},{T},{4 * D}]"] * 2)
    got = _stacked(capsys, policy)
    assert got == want, got
    size = {"f32": 4, "bf16": 2}
    nbytes = sum(size[s.split("[")[0]] * math.prod(map(int, s[s.index("[") + 1:-1].split(","))) for s in got)
    # bytes per token of one layer: LN in/out 4D, stats 4 fp32, q/k/v/o 4D, probs N*T fp32, MLP 2 x 4D
    per_layer = B * T * (4 * D * size[c] + 4 * 4 + 4 * D * size[c] + N * T * 4 + 2 * 4 * D * size[c])
    assert nbytes == L * per_layer, (nbytes, L * per_layer)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_selective_remat_saves_all_but_the_probs(capsys, policy):
    """train.remat=selective: the attention core (scores, softmax, probs.v) is recomputed in backward, so
    the one (L, B, N, T, T) fp32 residual goes. Its inputs stay saved: q, k, v in fp32; in bf16 the
    fused core's (B, T, 3, N, Hd) qkv in their place (jaxpar.models.mixed_attention.causal_attention_qkv).
    Reference: remat=none's census above."""
    got, none = collections.Counter(_stacked(capsys, policy, "selective")), collections.Counter(_stacked(capsys, policy))
    want = none - collections.Counter({f"f32[{L},{B},{N},{T},{T}]": 1})
    if policy == "bf16":
        want = want - collections.Counter({f"bf16[{L},{B},{T},{N},{D // N}]": 3}) + collections.Counter(
            {f"bf16[{L},{B},{T},3,{N},{D // N}]": 1})
    assert got == want, (got, none)
