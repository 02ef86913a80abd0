"""The planner's memory term for XLA:CPU's unrolled fp32 layer loop (jaxpar/planner/activations.py
`unrolled_layer_bytes`, `unrolled_peak_bytes`; jaxpar/planner/README.md, "Accuracy against the compiler")."""

import pytest
from support.cli_helpers import run_probe

from jaxpar.config import ModelConfig
from jaxpar.planner.activations import causal_blocks, layer_activation_bytes, unrolled_layer_bytes
from jaxpar.planner.cost import GROUPS, Strategy, Workload, estimate, group_elems
from jaxpar.planner.devices import get_device

# The compiler side: jaxpar's real train step compiled (nothing run) on 2 emulated CPU devices for
# L = 2 and 3 layers (unrolled on CPU: gpt2.scan_unroll); prints compiled.memory_analysis()'s
# per-device total for each.
_PROBE = """
import json, sys
from jaxpar.config import Config, MeshConfig, ModelConfig, TrainConfig
from jaxpar.run.inspection import compile_step, memory_per_device
out = {}
for t, remat, mc in json.loads(sys.argv[1]):
    for L in (2, 3):
        m = ModelConfig(n_layer=L, n_embd=64, n_head=2, vocab_size=256, n_positions=128)
        cfg = Config(model=m, mesh=MeshConfig(data=2 // t, tensor=t), precision="fp32",
                     train=TrainConfig(batch_size=4, seq_len=128, remat=remat, mlp_chunks=mc))
        out[f"{t} {remat} {mc} {L}"] = memory_per_device(compile_step(cfg)[0])["total"]
print(json.dumps(out))
"""


def _compiled_totals(variants: list) -> dict:
    return run_probe(_PROBE, variants, devices=2)


VARIANTS = [(1, "none", 1), (2, "none", 1), (1, "none", 2)]  # unrolled: remat none only (gpt2.scan_unroll)
REMATS = [(1, "selective", 1), (1, "full", 1)]  # rolled


@pytest.mark.slow  # ten compiles (60 s on 2 cores); the formula and where it applies stay default
def test_unrolled_layer_term_matches_the_compiler_per_layer():
    """Census against the compiler: one more layer grows the unrolled fp32 step's compiled memory by
    `unrolled_layer_bytes` + the layer's 16 bytes of fp32 state per parameter (weights, grads, Adam
    m and v; with mlp_chunks 2 also chunked_mlp's re-laid MLP weights), per variant: t = 1 and 2,
    mlp_chunks 1 and 2. Tiny config: D 64, 2 heads, T 128 (2 causal query blocks), 2 rows per device
    (per tensor group). Measured 0.9986-0.9988 of that (the remainder, <= 3.3 KB per layer, is not
    modelled); the rolled count (`layer_activation_bytes`, exact for the rolled scan) is 0.46-1.84 MB
    per layer short of it. With remat the scan is rolled and a layer costs less than unrolled without
    (unrolled, remat selective and full had cost exactly what none did: XLA merged the recompute)."""
    got = _compiled_totals([list(v) for v in VARIANTS + REMATS])
    w = Workload(ModelConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=128), 4, 128, "fp32")
    nb = causal_blocks(128)
    assert nb == 2
    slopes = {}
    for t, remat, mc in VARIANTS:
        key = f"{t} {remat} {mc}"
        slopes[key] = got[f"{key} 3"] - got[f"{key} 2"]
        full = group_elems(w.model, t, 1, {g: False for g in GROUPS})
        state = 16 * (full["attn"] + full["mlp"])  # per layer on one device: tensor-split weights
        relaid = 4 * full["mlp"] if mc > 1 else 0  # chunked_mlp's fp32 re-laid MLP weights (estimate's term)
        want = unrolled_layer_bytes(w, 4 / (2 // t), t, mc, nb) + state + relaid
        assert 0.99 * want <= slopes[key] <= want, (key, slopes[key], want)
    for t, remat, mc in REMATS:
        slopes[f"{t} {remat} {mc}"] = got[f"{t} {remat} {mc} 3"] - got[f"{t} {remat} {mc} 2"]
    assert slopes["1 full 1"] < slopes["1 selective 1"] < slopes["1 none 1"], slopes


M = ModelConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=2048, n_positions=256)
CPU = get_device("cpu")


def _acts(dev=CPU, precision="fp32", m=M, **kw):
    return estimate(Workload(m, 16, 128, precision), Strategy(**kw), dev).memory["activations"]


def test_where_the_unrolled_term_applies():
    """estimate uses the term on devices with `unrolled_fp32` (the cpu row), in fp32, without a
    pipeline or jaxpar.parallel.fsdp's map (both keep their scans rolled), up to gpt2.scan_unroll's
    12 CPU layers; GPUs (unrolled up to 24 layers, memory never measured) keep the rolled count."""
    w = Workload(M, 16, 128, "fp32")
    b, nb = 2, causal_blocks(128)
    rolled_cpu = get_device("cpu", {"unrolled_fp32": "false"})
    assert _acts(data=8) == 4 * unrolled_layer_bytes(w, b, 1, 1, nb)
    assert _acts(rolled_cpu, data=8) == 4 * layer_activation_bytes(w, b, 1, "none", 1, 4, False, blocks=nb)[0]
    assert not get_device("h100").unrolled_fp32 and not get_device("h200").unrolled_fp32
    # the cpu row's booleans override as booleans ("false" was "not a number" for causal_blocks)
    assert CPU.causal_blocks and not get_device("cpu", {"causal_blocks": "false"}).causal_blocks
    assert _acts(get_device("h100"), data=8) == 4 * layer_activation_bytes(w, b, 1, "none", 1, 4, False)[0]
    m13 = ModelConfig(n_layer=13, n_embd=256, n_head=8, vocab_size=2048, n_positions=256)
    for kw in ({"precision": "bf16", "data": 8},  # measured lower unrolled: the rolled count
               {"m": m13, "data": 8},  # 13 layers run rolled on CPU
               {"fsdp": 8},  # jaxpar.parallel.fsdp's own rolled scan
               {"data": 4, "pipe": 2, "microbatches": 2},  # a pipeline's stage scan
               {"data": 8, "remat": "selective"}, {"data": 8, "remat": "full"},  # remat: the model rolls
               {"fsdp": 8, "remat": "selective"}):  # outside fsdp's map, rolled by remat
        assert _acts(**kw) == _acts(rolled_cpu, **kw), kw
    # mlp_chunks=2 takes fsdp=8 out of jaxpar.parallel.fsdp: XLA's auto-sharded step unrolls and keeps
    # every layer's all-gathered fp32 attention weights, where the grads term counts their 1/f shards
    el, full = group_elems(M, 1, 8, {g: True for g in GROUPS}), group_elems(M, 1, 1, {g: False for g in GROUPS})
    gathered = 4 * 4 * (full["attn"] - el["attn"])
    kept = 4 * (unrolled_layer_bytes(w, b, 1, 2, nb) - layer_activation_bytes(w, b, 1, "none", 2, 4, False, blocks=nb)[0])
    assert _acts(fsdp=8, mlp_chunks=2) - _acts(rolled_cpu, fsdp=8, mlp_chunks=2) == kept + gathered


def test_unrolled_term_formula():
    """The counts of unrolled_layer_bytes's docstring, u = T·b·D·4, P = the kept fp32 probs."""
    w = Workload(M, 16, 128, "fp32")
    T, b, D, N = 128, 2, 256, 8
    u, nb = T * b * D * 4, causal_blocks(128)
    P = N * T * T * 3 / 4 * b * 4  # 2 causal query blocks keep 3/4 of (T, T)
    none = layer_activation_bytes(w, b, 1, "none", 1, 4, False, blocks=nb)[0]
    # t = 1: 2 transposed LN outputs + the attention output's, one more MLP hidden value (4 units),
    # a second copy of the probs
    assert unrolled_layer_bytes(w, b, 1, 1, nb) == none + u * (2 + 1 + 4) + P
    # mlp_chunks > 1: ln_1's transpose + the attention output's, 2 chunk-loop (b, T, D) values
    none_mc = layer_activation_bytes(w, b, 1, "none", 2, 4, False, blocks=nb)[0]
    assert unrolled_layer_bytes(w, b, 1, 2, nb) == none_mc + u * (1 + 1 + 2) + P
    # t = 2
    got = unrolled_layer_bytes(w, b, 2, 1, nb)
    assert got == layer_activation_bytes(w, b, 2, "none", 1, 4, False, blocks=nb)[0] + u * (2 + 1 / 2 + 2) + P / 2
