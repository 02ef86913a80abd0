"""benchmarks/planner_regret.py: the candidate set and the figures it reports (no timing asserted)."""


import pytest
from support.bench_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("planner_regret")


def test_regret_and_rank_correlation(bench):
    assert bench.regret([1.1, 1.0, 1.3]) == pytest.approx(0.1)
    assert bench.regret([1.0, 1.2]) == 0.0
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert bench.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


def test_candidates_are_the_planners_then_variants_of_the_pick(bench):
    from jaxpar.planner.devices import get_device

    cfg = bench.base_config(bench.MODEL)
    cands, n_planner = bench.candidates(cfg, 8)
    strategies = [e.strategy for e in cands]
    assert len(set(strategies)) == len(strategies)  # no candidate is timed twice
    assert 1 <= n_planner <= 8 and len(cands) > n_planner
    assert [e.step_time_s for e in cands[:n_planner]] == sorted(e.step_time_s for e in cands[:n_planner])
    pick = strategies[0]
    assert all(s.mesh == pick.mesh for s in strategies[n_planner:])  # variants share the pick's mesh
    assert {s.remat for s in strategies[n_planner:]} | {pick.remat} == {"none", "selective", "full"}
    limit = get_device("cpu").memory
    assert all(e.fits and e.memory["total"] <= limit and e.strategy.n_devices == 8 for e in cands)


def test_report_names_the_fastest_candidate_and_the_regret_of_the_pick(bench, tmp_path, monkeypatch):
    """main() on planted step times (no compile, no timing): the JSON's best, regrets, spreads and
    rank correlation are those of the planted times."""
    import json

    cfg = bench.base_config(bench.MODEL)
    n = len(bench.candidates(cfg, 3)[0])
    # candidate i: median 1 + |i - 1| / 10: candidate 1 is the fastest, the pick (0) 10% slower, the
    # last one the slowest; each row's times are 0.9, 1 and 1.3 times its median
    planted = [[m * 0.9, m, m * 1.3] for m in (1 + abs(i - 1) / 10 for i in range(n))]
    monkeypatch.setattr(bench, "measure", lambda cfg, estimates, rounds: (planted, ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0))))
    out = tmp_path / "regret.json"
    assert bench.main(["--top", "3", "--rounds", "3", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    labels = [r["label"] for r in rep["rows"]]
    assert rep["best_measured"] == labels[1] and rep["pick"] == labels[0]
    assert rep["regret"] == pytest.approx(0.1) and rep["regret_min"] == pytest.approx(0.1)
    assert [r["median_s"] for r in rep["rows"]] == [p[1] for p in planted]
    assert all(r["spread"] == pytest.approx(1.3 / 0.9 - 1) for r in rep["rows"])
    assert rep["load_average_before"] == [1.0, 1.0, 1.0] and rep["load_average_after"] == [2.0, 2.0, 2.0]
