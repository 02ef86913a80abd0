"""benchmarks/planner_accuracy.py's arithmetic on a stand-in compiled step (no compile): a row's
errors are predicted / measured - 1, and the planner is asked about the row's own strategy
(grad accumulation as its microbatches). Reference: the planted measurements and the planner's
own estimate of the same strategy."""

from types import SimpleNamespace

import pytest
from support.bench_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("planner_accuracy")


def test_row_errors_are_predicted_over_measured(bench, monkeypatch):
    from jaxpar.config import ModelConfig
    from jaxpar.planner.cost import Strategy, Workload, estimate
    from jaxpar.planner.devices import get_device
    from jaxpar.run import inspection

    coll = {k: {"wire_bytes": 0} for k in bench.KINDS.values()}
    coll["all-reduce"]["wire_bytes"] = 1000
    coll["total_wire_bytes"] = 1000
    monkeypatch.setattr(inspection, "compile_step", lambda cfg, devices=None: (SimpleNamespace(as_text=lambda: ""), None))
    monkeypatch.setattr(inspection, "collective_bytes", lambda text: coll)
    monkeypatch.setattr(inspection, "memory_per_device", lambda c: {"total": 2**20, "temp": 2**19})
    conf = ((2, 4, 1, 1), "fp32", False, 2, 1, 1)  # data=2 fsdp=4, grad_accum=2
    r = bench.run_one(conf)
    assert bench.CONFIGS[4] == conf and r["grad_accum"] == 2
    m = bench.MODEL
    model = ModelConfig(n_layer=m["model.n_layer"], n_embd=m["model.n_embd"], n_head=m["model.n_head"],
                        vocab_size=m["model.vocab_size"], n_positions=m["model.n_positions"])
    e = estimate(Workload(model, m["train.batch_size"], m["train.seq_len"], "fp32"),
                 Strategy(2, 4, 1, 1, 2, 1, "none", (), 1, 1, gather="step", schedule="gpipe"), get_device("cpu"))
    assert (r["bytes_measured"], r["bytes_predicted"]) == (1000, sum(e.comm_bytes.values()))
    assert r["bytes_err"] == r["bytes_predicted"] / 1000 - 1 != 0
    assert (r["memory_measured"], r["memory_predicted"]) == (2**20, int(e.memory["total"]))
    assert r["memory_err"] == e.memory["total"] / 2**20 - 1
    assert r["bytes_by_kind_measured"]["all-reduce"] == 1000 and r["bytes_by_kind_predicted"] == dict(e.comm_bytes)
