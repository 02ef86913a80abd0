"""benchmarks/fp16_wire_rounding.py: the element masks of its rounding modes, and (slow) the figures
the `torchref.fp16wire.loss` why text quotes from it (no timing asserted)."""

import json

import numpy as np
import pytest
from support.bench_module import load_benchmark

from jaxpar.tolerances import LOSS_RTOL_FP16_WIRE, LOSS_RTOL_FP32


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("fp16_wire_rounding")


def test_each_mode_rounds_exactly_its_elements(bench):
    # under fp16's smallest normal 6.1e-5: 1e-7 (-> 1.19e-7, steps of 2^-24), 3e-5; normal: 0.1, -1/3, 7e-5
    x = np.array([1e-7, 3e-5, 0.1, -1 / 3, 7e-5, 0.0], np.float32)
    h = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(bench.wire_round("fp32", x), x)
    assert np.array_equal(bench.wire_round("fp16", x), h)
    sub, norm = bench.wire_round("sub", x), bench.wire_round("norm", x)
    assert np.array_equal(sub, [h[0], h[1], x[2], x[3], x[4], 0.0])
    assert np.array_equal(norm, [x[0], x[1], h[2], h[3], h[4], 0.0])
    assert all(h[i] != x[i] for i in range(5))  # every value above really changes under fp16


@pytest.mark.slow
def test_replay_figures(bench, tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    monkeypatch.setattr("sys.argv", ["fp16_wire_rounding.py", "--out", str(out)])
    bench.main()
    r = json.loads(out.read_text())
    assert r["elements"] == 462_336  # gpt2-tiny's parameters
    assert 0.0 < r["exactly_zero"] < r["below_fp16_normal"] < 0.5
    rel = r["loss_rel_vs_single"]
    assert rel["fp32"] <= LOSS_RTOL_FP32 < rel["fp16"] <= LOSS_RTOL_FP16_WIRE  # the fp16 wire moves the loss
    assert rel["sub"] < rel["norm"]  # the normal elements' rounding carries the effect, not the subnormals'
