"""Schedule tables (jaxpar/parallel/schedules.py): the idle ticks of every generated table equal
the closed-form bubble `jaxpar.parallel.layout.bubble_fraction` (F = B = W = 1 tick, BW = 2),
each (microbatch, virtual stage) runs each of its actions once after its inputs, and the stash of
saved stage inputs is independent of M. Exhaustive over S <= 8, M <= 32, R <= 4 (numpy only).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpar.parallel import schedules as sc
from jaxpar.parallel.layout import bubble_fraction

GRID = [(S, M) for S in range(1, 9) for M in range(1, 33)]


def _check_dependencies(tab, S, M, R, fused):
    """Every action once, each after the results it reads (made at an earlier tick)."""
    V = R * S
    at = {}
    for t, s in zip(*np.nonzero(np.isin(tab[..., 0], (sc.F, sc.B, sc.W, sc.BW)))):
        k, m, v = (int(x) for x in tab[t, s])
        assert v % S == s and 0 <= m < M, (t, s, k, m, v)
        assert (k, m, v) not in at
        at[(k, m, v)] = int(t)
    kinds = (sc.F, sc.BW) if fused else (sc.F, sc.B, sc.W)
    assert len(at) == len(kinds) * M * V
    bk = sc.BW if fused else sc.B
    for m in range(M):
        for v in range(V):
            if v:
                assert at[(sc.F, m, v)] > at[(sc.F, m, v - 1)]
            assert at[(bk, m, v)] > at[(sc.F, m, v)]
            if v < V - 1:
                assert at[(bk, m, v)] > at[(bk, m, v + 1)] + (1 if fused else 0)  # a BW's result after 2 ticks
            if not fused:
                assert at[(sc.W, m, v)] > at[(sc.B, m, v)]
            if fused:
                assert tuple(tab[at[(bk, m, v)] + 1, v % S]) == (sc.HOLD, m, v)


@pytest.mark.parametrize("S,M", GRID)
def test_1f1b_and_zb_tables(S, M):
    t1, tz = sc.make_table("1f1b", S, M), sc.make_table("zb", S, M)
    _check_dependencies(t1, S, M, 1, True)
    _check_dependencies(tz, S, M, 1, False)
    # every rank works 3M ticks; 1F1B idles 3(S-1) of N = 3(M+S-1) for every M
    assert len(t1) == 3 * (M + S - 1) and list(sc.idle_ticks(t1)) == [3 * (S - 1)] * S
    assert sc.bubble(t1) == pytest.approx(bubble_fraction(S, M, 1, "1f1b"), abs=1e-15)
    assert list(sc.busy_ticks(tz)) == [3 * M] * S
    if M >= S:  # ZB-H1: the deferred Ws fill the drain, S-1 idle ticks of N = 3M+S-1
        assert len(tz) == 3 * M + S - 1 and list(sc.idle_ticks(tz)) == [S - 1] * S
        assert sc.bubble(tz) == pytest.approx(bubble_fraction(S, M, 1, "zb"), abs=1e-15)
    else:  # fewer microbatches than stages: more idle than the form (the form holds for M >= S)
        assert sc.bubble(tz) > bubble_fraction(S, M, 1, "zb")
    # the same stash: min(M, 2S-1) stage inputs on rank 0, whatever M
    assert sc.peak_stash(t1) == sc.peak_stash(tz) == min(M, 2 * S - 1)
    # packed for lock step: 1f1b is F(t-s) and BW(t-(2S-2-s)) at tick t, M + 2S - 2 ticks, and
    # zb packs into as many; the stash the packed plan needs is the table's
    p1, pz = sc.lockstep(t1), sc.lockstep(tz)
    assert len(p1) == len(pz) == M + 2 * S - 2
    for t in range(len(p1)):
        for s in range(S):
            f, b = t - s, t - (2 * S - 2 - s)
            assert tuple(p1[t, s, 0]) == ((sc.F, f, s) if 0 <= f < M else (sc.IDLE, -1, -1))
            assert tuple(p1[t, s, 1]) == ((sc.BW, b, s) if 0 <= b < M else (sc.IDLE, -1, -1))
    for p in (p1, pz):
        xs, gs = sc.plan_intervals(p)
        assert sc.peak_live(xs) == min(M, 2 * S - 1)
    assert sc.peak_live(sc.plan_intervals(pz)[1]) == min(M, S)


@pytest.mark.parametrize("S,R", [(S, R) for S in range(2, 9) for R in range(1, 5)])
def test_interleaved_tables(S, R):
    stash = {}
    for M in range(S, 33, S):  # Megatron's order runs microbatches in groups of S
        tab = sc.make_table("interleaved", S, M, R)
        _check_dependencies(tab, S, M, R, True)
        # N = 3(RM + S - 1) ticks of 1/R stage each; every rank idles 3(S-1) of them
        assert len(tab) == 3 * (R * M + S - 1) and list(sc.idle_ticks(tab)) == [3 * (S - 1)] * S
        assert sc.bubble(tab) == pytest.approx(bubble_fraction(S, M, R, "interleaved"), abs=1e-15)
        stash[M] = sc.peak_stash(tab)
        plan = sc.lockstep(tab)
        assert sc.peak_live(sc.plan_intervals(plan)[0]) == stash[M]  # packed: the same stash
        # in lock step a tick costs the slowest rank's lanes: RM + (R+1)S - 2 chunk ticks, i.e.
        # M + (1 + 1/R)S - 2/R stage ticks against 1f1b's M + 2S - 2
        assert len(plan) == R * M + (R + 1) * S - 2
    # bounded independently of M: rank 0's warm-up 2(S-1) + (R-1)S forwards and one more, for
    # every M >= 2S (fewer microbatches hold fewer)
    assert {v for M, v in stash.items() if M >= 2 * S} == {(R + 1) * S - 1}, stash
    assert max(stash.values()) == (R + 1) * S - 1


def test_problems_are_one_line():
    assert sc.schedule_problem("interleaved", 4, 6, 2) == (
        "pipeline.schedule=interleaved needs pipeline.microbatches=6 divisible by mesh.pipe=4 "
        "(Megatron's order runs microbatches in groups of mesh.pipe)")
    assert sc.schedule_problem("zb", 4, 8, 2) == (
        "pipeline.repeats=2 needs pipeline.schedule=interleaved or circular (got 'zb')")
    with pytest.raises(ValueError):
        sc.make_table("interleaved", 4, 6, 2)


def test_slots_never_collide():
    """Slot colouring of the stash intervals: no two live inputs share a slot; slot count = peak."""
    for sched, S, M, R in (("1f1b", 4, 9, 1), ("zb", 4, 9, 1), ("interleaved", 3, 6, 2)):
        tab = sc.make_table(sched, S, M, R)
        for iv in (sc.stash_intervals(tab), sc.grad_intervals(tab)):
            slots, n = sc.assign_slots(iv)
            assert n == sc.peak_live(iv)
            for s, ivs in enumerate(iv):
                for i, (a, b, m, v) in enumerate(ivs):
                    for a2, b2, m2, v2 in ivs[i + 1:]:
                        if a <= b2 and a2 <= b:
                            assert slots[(s, m, v)] != slots[(s, m2, v2)]


def test_render_shows_the_zb_drain():
    assert sc.render(sc.make_table("zb", 2, 2)).splitlines() == [
        "F0   F1   .    B0   W0   B1   W1  ",
        ".    F0   B0   F1   B1   W0   W1  "]
