"""The layer partition of L equal layers (the planner's, for every pipelined candidate) is the
closed form `_even`, not the O(S·L²) dynamic programme (a plan of 3,000 layers
ran for minutes, 1,000 layers 6 s). Reference: the DP itself, run here on every small case."""

from __future__ import annotations

import pytest

from jaxpar.parallel import partition as P


def _dp(L: int, S: int) -> tuple[int, ...]:
    c = P._prefix([1.0] * L)
    first = P._solve(c, None, S, 0.0, 0.0, 0.0, 0.0, float("inf"), None)
    second = P._solve(c, None, S, 0.0, 0.0, 0.0, 0.0, float("inf"), first[0])
    return P._backtrack(second[1], S, L)


def test_the_closed_form_is_the_dps_answer_for_every_small_case():
    for L in range(1, 25):
        for S in range(1, L + 1):
            assert P.partition_layers([1.0] * L, S) == _dp(L, S), (L, S)
    assert P.partition_layers([1.0] * 10, 4) == (2, 2, 3, 3)


def test_a_plan_of_3000_layers_runs_no_dp(monkeypatch):
    """Counted, not timed: every pipelined candidate of a 3,000-layer plan takes the closed form."""
    from jaxpar.planner import cli, cost

    def dp(c, *rest):  # fails at once on the old code, instead of running for minutes
        raise AssertionError(f"the DP ran on {len(c) - 1} layers")

    monkeypatch.setattr(P, "_solve", dp)
    cost._pipeline_split.cache_clear()
    opts = cli.parse_args(["model=gpt2", "model.n_layer=3000"])
    w = cli.Workload(opts["cfg"].model, 8, opts["cfg"].train.seq_len, opts["cfg"].precision, opts["attention"])
    plan, res = cli.plan_for(w, 8, space=opts["space"], fixed=opts["fixed"])
    assert plan.mesh["pipe"] > 1  # pipelined candidates were estimated, none ran the DP
    assert cost._pipeline_split(3000, 8) == (375,) * 8 and cost._pipeline_split(3000, 7) == (428,) * 3 + (429,) * 4


@pytest.mark.parametrize("costs,extras", [([1.0, 2.0, 1.0, 1.0], (0.0, 0.0)), ([1.0] * 4, (1.0, 0.0))])
def test_unequal_layers_or_extras_still_take_the_dp(costs, extras):
    assert P.partition_layers(costs, 2, *extras) == _dp_general(costs, 2, *extras)


def _dp_general(costs, S, first, last):
    c = P._prefix(costs)
    r = P._solve(c, None, S, first, last, 0.0, 0.0, float("inf"), None)
    r2 = P._solve(c, None, S, first, last, 0.0, 0.0, float("inf"), r[0])
    return P._backtrack(r2[1], S, len(costs))
