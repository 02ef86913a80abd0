"""benchmarks/comm_volume.py's arithmetic on a stand-in compiled step (no compile): the measured
totals, the ratio to theory and the largest ops. Reference: the planted op list."""

from types import SimpleNamespace

import pytest
from support.bench_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("comm_volume")


def test_measure_ranks_ops_by_bytes_times_repeats_and_divides_by_theory(bench, monkeypatch):
    # a once-per-step all-reduce of 1000 bytes vs a per-layer all-gather of 300 bytes run 12 times
    ops = [{"kind": "all-reduce", "group": 8, "times": 1, "wire_bytes": 1000, "op_name": "grads"},
           {"kind": "all-gather", "group": 8, "times": 12, "wire_bytes": 300, "op_name": "layer weights"},
           {"kind": "collective-permute", "group": 2, "times": 1, "wire_bytes": 10, "op_name": "x"}]
    coll = {k: {"wire_bytes": 0} for k in bench.COLLECTIVES}
    coll["all-reduce"]["wire_bytes"], coll["all-gather"]["wire_bytes"] = 1000, 3600
    coll["collective-permute"]["wire_bytes"] = 10
    coll.update(ops=ops, total_wire_bytes=4610)
    compiled = SimpleNamespace(as_text=lambda: "")
    monkeypatch.setattr(bench, "compile_step", lambda cfg: (compiled, SimpleNamespace(cfg=cfg)))
    monkeypatch.setattr(bench, "collective_bytes", lambda text: coll)
    monkeypatch.setattr(bench, "theory_bytes", lambda cfg: {"total": 4000, "dp": 4000, "fsdp": 0, "tp": 0, "pipe": 0})
    monkeypatch.setattr(bench, "memory_per_device", lambda c: {"total": 1})
    r = bench.measure("gpt2", "fsdp", 16, 512, "fp32")
    assert [o["op_name"] for o in r["top_ops"]] == ["layer weights", "grads", "x"]
    assert r["measured"]["total"] == 4610 and r["ratio"] == 4610 / 4000
    assert r["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1, "pipe": 1}
