"""The planner's sequence-parallel memory term (tensor.sequence_parallel, cost.Strategy.seq_parallel)
against the compiler: jaxpar's train step compiled (nothing run) on 4 emulated CPU devices,
tensor=4, with and without SP, and compiled.memory_analysis()'s per-device total compared with
cost.estimate's. Model: 2 layers, D 256, 8 heads, V 2048, T 128, batch 16 (b = 16 rows per
tensor group), fp32 (XLA:CPU's precision; bf16 rows are a known under-prediction without SP too).

Measured (MB = 1e6 bytes; host: 2-core AMD EPYC, XLA:CPU):
    remat       SP    compiled  predicted   error
    selective   off     61.02     63.61    +4.2%
    selective   on      51.20     50.98    -0.4%
    none        off     71.23     75.11    +5.4%   (unrolled fp32 step: activations.unrolled_layer_bytes)
    none        on      58.58     62.48    +6.7%
SP saves 12.66 MB compiled, 12.63 MB predicted without remat (the LayerNorm inputs / outputs and
stats of 2 layers on T/4: 2 · 3/4 · T·b·(4·D·4 + 16)); with selective remat 9.82 MB compiled, 12.63 MB
predicted. On 4 layers (benchmarks/planner_accuracy.py's model): selective + SP 74.35 vs 74.13 MB
(-0.3%), remat=full + SP 42.60 vs 42.64 MB (+0.1%)."""

import pytest
from support.cli_helpers import run_probe

from jaxpar.config import ModelConfig
from jaxpar.planner.cost import Strategy, Workload, estimate
from jaxpar.planner.devices import get_device

_PROBE = """
import json, sys
from jaxpar.config import Config, MeshConfig, ModelConfig, TensorConfig, TrainConfig
from jaxpar.run.inspection import compile_step, memory_per_device
out = {}
for remat, sp in json.loads(sys.argv[1]):
    m = ModelConfig(n_layer=2, n_embd=256, n_head=8, vocab_size=2048, n_positions=256)
    cfg = Config(model=m, mesh=MeshConfig(tensor=4), precision="fp32", tensor=TensorConfig(sp),
                 train=TrainConfig(batch_size=16, seq_len=128, remat=remat))
    out[f"{remat} {sp}"] = memory_per_device(compile_step(cfg)[0])["total"]
print(json.dumps(out))
"""
MODEL = ModelConfig(n_layer=2, n_embd=256, n_head=8, vocab_size=2048, n_positions=256)


@pytest.fixture(scope="module")
def compiled():
    return run_probe(_PROBE, [[r, sp] for r in ("selective", "none") for sp in (False, True)], devices=4)


def test_sequence_parallel_total_matches_the_compiler():
    """One compile (selective remat, SP on, the rolled layer scan): the total within 1% (measured -0.4%)."""
    got = run_probe(_PROBE, [["selective", True]], devices=4)["selective True"]
    assert abs(_predicted("selective", True) / got - 1) <= 0.01, (got, _predicted("selective", True))


def _predicted(remat: str, sp: bool) -> float:
    w = Workload(MODEL, 16, 128, "fp32")
    return estimate(w, Strategy(tensor=4, remat=remat, seq_parallel=sp), get_device("cpu")).memory["total"]


@pytest.mark.slow
def test_sequence_parallel_saving_matches_the_compiler(compiled):
    """Four compiles (about a minute on 2 shared cores)."""
    # no remat (the unrolled fp32 step): SP's saving within 1% (measured 0.2%); the total is
    # over-predicted as without SP (+5.4% there), never under
    saved = compiled["none False"] - compiled["none True"]
    want = _predicted("none", False) - _predicted("none", True)
    assert want == pytest.approx(2 * 3 / 4 * 128 * 16 * (4 * 256 * 4 + 16), rel=1e-12)
    assert abs(want / saved - 1) <= 0.01, (want, saved)
    assert 0 <= _predicted("none", True) / compiled["none True"] - 1 <= 0.08
    # SP lowers the compiled peak in both
    assert compiled["selective True"] < compiled["selective False"] and compiled["none True"] < compiled["none False"]
