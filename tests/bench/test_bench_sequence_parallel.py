"""benchmarks/sequence_parallel.py: SP on / off on 4 emulated CPU devices. The ratios on a planted
row (no compile, no timing), the planner's predictions it records, and the committed results'
structure and the bounds they met (memory is compile-only and exact; step times are noisy and
only checked for sanity)."""

import json
import os

import pytest
from support.bench_module import ROOT, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sequence_parallel")


@pytest.fixture(scope="module")
def saved():
    with open(os.path.join(ROOT, "benchmarks", "results", "sequence_parallel.json")) as fh:
        return json.load(fh)


def _side(temp, total, step, ag, mem, cpu_s, gpu_s):
    return {"temp": temp, "total": total, "step_s_median": step, "ops": {"all-reduce": 10, "all-gather": ag},
            "predicted": {"memory": mem, "step_s": cpu_s, "h100_step_s": gpu_s}}


def test_summary_ratios_on_a_planted_row(bench):
    row = {"no_sp": _side(100, 200, 2.0, 0, 210e6, 1.0, 0.5), "sp": _side(80, 170, 1.5, 12, 185e6, 1.1, 0.5)}
    s = bench.summarise(row)
    assert (s["temp_ratio"], s["total_ratio"], s["step_ratio"]) == (0.8, 0.85, 0.75)
    assert s["predicted_step_ratio_cpu"] == pytest.approx(1.1) and s["predicted_step_ratio_h100"] == 1.0
    assert s["saving_compiled_mb"] == 30 / 1e6 and s["saving_predicted_mb"] == pytest.approx(25.0)
    assert s["added_all_gathers"] == 12 and s["all_reduces_kept"]


def test_committed_rows_cover_both_shapes_and_tensor_sizes(bench, saved):
    assert saved["devices"] == 4
    assert [(r["shape"], r["tensor"], r["data"]) for r in saved["rows"]] == [
        (s, t, 4 // t) for s in bench.SHAPES for t in bench.TENSOR]


def test_committed_memory_and_collectives(bench, saved):
    """Every row: SP lowers the compiled temp bytes; XLA:CPU keeps each all-reduce and adds
    all-gathers (no reduce-scatter on CPU); the planner's saving is within 10% of the compiled one
    and its predictions are today's (the model has not moved under the file); on an H100 the model
    predicts SP at the same step time (reduce-scatter + all-gather = all-reduce on a ring)."""
    for r in saved["rows"]:
        s = bench.summarise(r)
        assert s == r["summary"]
        assert s["temp_ratio"] < 1 and s["all_reduces_kept"] and s["added_all_gathers"] > 0
        assert r["sp"]["ops"]["reduce-scatter"] == r["no_sp"]["ops"]["reduce-scatter"] == 0
        assert abs(s["saving_predicted_mb"] / s["saving_compiled_mb"] - 1) <= 0.10, (r["shape"], r["tensor"], s)
        for sp in (False, True):
            got, now = r["sp" if sp else "no_sp"]["predicted"], bench.predicted(r["shape"], r["tensor"], sp)
            assert got["comm_bytes"] == pytest.approx(now.pop("comm_bytes"), rel=1e-12)
            assert {k: v for k, v in got.items() if k != "comm_bytes"} == pytest.approx(now, rel=1e-12)
        assert s["predicted_step_ratio_h100"] == pytest.approx(1.0, rel=1e-9)
        for side in ("no_sp", "sp"):
            assert len(r[side]["step_s_rounds"]) == saved["rounds"] and r[side]["step_s_median"] > 0
