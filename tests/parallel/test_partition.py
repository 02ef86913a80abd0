"""Stage partitioner: exact DP vs brute force on small chains, plus manual-split validation."""

import itertools
import random

import pytest

from jaxpar.config import ConfigError
from jaxpar.parallel.partition import (
    partition_layers,
    stage_bounds,
    stage_memory,
    stage_times,
    validate_layers_per_stage,
)


def compositions(L, S):
    """Every way to write L as an ordered sum of S positive ints."""
    for cuts in itertools.combinations(range(1, L), S - 1):
        b = (0, *cuts, L)
        yield tuple(b[k + 1] - b[k] for k in range(S))


def brute(costs, S, fe, le, mem, limit, fm, lm):
    """(best bottleneck, min sum of squares among the optimal ones) or None."""
    best = None
    for lps in compositions(len(costs), S):
        if limit is not None and max(stage_memory(lps, mem, fm, lm)) > limit:
            continue
        t = stage_times(lps, costs, fe, le)
        key = (max(t), sum(x * x for x in t))
        best = key if best is None or key < best else best
    return best


def test_matches_brute_force_on_random_chains():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        L = rng.randint(1, 9)
        S = rng.randint(1, L)
        costs = [rng.choice([1, 2, 3, 5, 8]) for _ in range(L)]  # integers: ties are exact
        fe, le = rng.choice([0, 1, 4]), rng.choice([0, 2, 7])
        mem = [rng.randint(1, 6) for _ in range(L)]
        fm, lm = rng.randint(0, 3), rng.randint(0, 5)
        limit = rng.choice([None, 6, 9, 14, 30])
        want = brute(costs, S, fe, le, mem, limit, fm, lm)
        if want is None:
            with pytest.raises(ConfigError):
                partition_layers(costs, S, fe, le, mem, limit, fm, lm)
            continue
        lps = partition_layers(costs, S, fe, le, mem, limit, fm, lm)
        assert len(lps) == S and sum(lps) == L and min(lps) >= 1
        if limit is not None:
            assert max(stage_memory(lps, mem, fm, lm)) <= limit
        t = stage_times(lps, costs, fe, le)
        assert (max(t), sum(x * x for x in t)) == want, (costs, S, fe, le, mem, limit, lps)
        checked += 1
    assert checked > 150


def test_head_cost_moves_layers_off_last_stage():
    # 48 equal layers, embedding worth 0.1 layer, logits+loss worth 2.4 layers, 4 stages.
    # Bottleneck 12.4 would cap stages at 12+12+12+10 = 46 < 48 layers, so 13 is optimal and
    # the only split reaching it is 12 (+0.1) | 13 | 13 | 10 (+2.4).
    lps = partition_layers([1.0] * 48, 4, first_extra=0.1, last_extra=2.4)
    assert lps == (12, 13, 13, 10)
    assert max(stage_times(lps, [1.0] * 48, 0.1, 2.4)) == pytest.approx(13.0)


def test_uniform_even_split_and_bounds():
    assert partition_layers([1.0] * 12, 4) == (3, 3, 3, 3)
    assert partition_layers([3.0], 1, 1.0, 1.0) == (1,)
    assert stage_bounds((2, 3, 1)) == [(0, 2), (2, 5), (5, 6)]


def test_memory_limit_forces_uneven_split():
    # Time wants (2, 2); memory of layer 0 is large, so stage 0 can hold only layer 0.
    lps = partition_layers([1, 1, 1, 1], 2, layer_mem=[10, 1, 1, 1], mem_limit=10)
    assert lps == (1, 3)


def test_infeasible_names_smallest_peak():
    with pytest.raises(ConfigError, match=r"^no split of 4 layers into 2 stages fits mem_limit=3 "
                                          r"\(smallest possible stage peak is 4\)$"):
        partition_layers([1, 1, 1, 1], 2, layer_mem=[2, 2, 2, 2], mem_limit=3)
    # the first stage's extra memory (embedding) lands on stage 0, the last's on stage S-1: with
    # layer 0 heavy, first_mem=3 makes (1, 3) the best split, peak 3 + 4 = 7 (last_mem=3 would give 5)
    with pytest.raises(ConfigError, match=r"\(smallest possible stage peak is 7\)$"):
        partition_layers([1, 1, 1, 1], 2, layer_mem=[4, 1, 1, 1], mem_limit=4.5, first_mem=3)
    with pytest.raises(ConfigError, match=r"\(smallest possible stage peak is 5\)$"):
        partition_layers([1, 1, 1, 1], 2, layer_mem=[4, 1, 1, 1], mem_limit=4.5, last_mem=3)


def test_too_many_stages_is_a_caller_bug():
    # the user-facing "more stages than layers" error is jaxpar.parallel.layout's (tests/parallel/test_pipeline.py)
    with pytest.raises(ValueError, match=r"^cannot cut 4 layers into 5 stages$"):
        partition_layers([1] * 4, 5)


def test_validate_manual_split_messages():
    assert validate_layers_per_stage([1, 3], 4, 2) == (1, 3)
    with pytest.raises(ConfigError) as e:
        validate_layers_per_stage([1, 2], 4, 2)
    assert str(e.value) == "pipeline.layers_per_stage=[1, 2] sums to 3, not model.n_layer=4"
    with pytest.raises(ConfigError) as e:
        validate_layers_per_stage([2, 2], 4, 4)
    assert str(e.value) == "pipeline.layers_per_stage=[2, 2] has 2 entries, not mesh.pipe=4"
    with pytest.raises(ConfigError) as e:
        validate_layers_per_stage([4, 0], 4, 2)
    assert str(e.value) == "pipeline.layers_per_stage=[4, 0] has a stage with 0 layers; every stage needs >= 1"
