"""benchmarks/planner_regret.py: the candidate set and the figures it reports (no timing asserted)."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    # the module sets XLA_FLAGS / JAX_PLATFORMS defaults for its own runs: keep them out of this process
    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location("planner_regret", os.path.join(ROOT, "benchmarks", "planner_regret.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.environ.clear()
    os.environ.update(saved)
    return mod


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
