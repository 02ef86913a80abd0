"""The planner's interleaved and zb pipeline terms (jaxpar/planner/schedules.py) and its
sequence-parallel terms (cost.Strategy.seq_parallel), closed forms against cost.estimate.

interleaved and zb are costed before `jaxpar train` runs them: these tests assert on the cost
model's numbers and choices (SearchSpace(new_schedules=NEW)), not on build_layout accepting a plan;
`test_default_search_offers_what_train_runs` is the one that changes once config.SCHEDULES lists them."""

import pytest

from jaxpar.config import SCHEDULES, ModelConfig
from jaxpar.parallel.layout import bubble_fraction
from jaxpar.planner import schedules as sched
from jaxpar.planner.activations import layer_activation_bytes
from jaxpar.planner.cost import Strategy, Workload, all_gather, all_reduce, estimate
from jaxpar.planner.devices import get_device
from jaxpar.planner.search import Fixed, SearchSpace, search

H100 = get_device("h100")
STEP_IL = 1.1490  # interleaved R = 4's predicted step on the test below (lock-step plan ticks)
M8 = ModelConfig(n_layer=8, n_embd=1024, n_head=16, vocab_size=32768, n_positions=1024)


def _est(sch, M, R=1, S=4, b=2, **kw):
    """data=2 × tensor=2 × pipe=S on H100 (bf16, T = 1024), M microbatches of b rows (batch 2·M·b)."""
    return estimate(Workload(M8, 2 * M * b, 1024), Strategy(data=2, tensor=2, pipe=S, microbatches=M, repeats=R,
                                                             schedule=sch, **kw), H100)


@pytest.mark.parametrize("sch,R", [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved", 2), ("zb", 1)])
@pytest.mark.parametrize("M", [2, 4, 16])
def test_bubble_is_layouts_closed_form(sch, R, M):
    """gpipe, circular, 1f1b and interleaved reach layout.bubble_fraction in the lock-step plan
    jaxpar runs; zb does not (its B and W each re-run the stage): more idle than 1f1b's, not the
    (S-1)/(3M+S-1) an asynchronous runtime would see."""
    if sch == "interleaved" and M % 4:
        with pytest.raises(ValueError, match=f"^schedule interleaved needs microbatches={M} divisible by pipe=4$"):
            _est(sch, M, R)
        return
    e = _est(sch, M, R)
    if sch == "zb":
        assert e.bubble == pytest.approx(1 - M / sched.lockstep_runs(4, M, 1, "zb"), rel=1e-12)
        assert e.bubble > bubble_fraction(4, M, 1, "1f1b") > bubble_fraction(4, M, 1, "zb")
        return
    assert e.bubble == pytest.approx(bubble_fraction(4, M, R, sch), rel=1e-12)
    if sch == "interleaved":
        assert e.bubble == pytest.approx(3 / (2 * M + 3))  # (S-1)/(R·M+S-1)


def test_critical_path_per_schedule():
    """Chunk runs on the critical path of the lock-step plan (M = 8, S = 4; a tick costs its busiest
    rank's F = 1, B = W = 2, BW = 3 stage forwards, a run F + BW = 4): 1f1b M + S - 1 = 11;
    zb 12.25, longer (B and W each re-run the stage); interleaved (R = 2, chunks of half a stage)
    R·M + S - 1 = 19, Megatron's. Layer compute scales with runs × layers per chunk; head,
    embedding as 1f1b's program; one ppermute each way per plan tick."""
    assert sched.critical_runs(4, 8, 1, "1f1b") == 11
    assert sched.critical_runs(4, 8, 1, "zb") == 12.25
    assert sched.critical_runs(4, 8, 2, "interleaved") == 19
    assert sched.critical_runs(4, 8, 2, "circular") == 19  # ·max(M,S) + M + S - 1
    one, zb, il = _est("1f1b", 8), _est("zb", 8), _est("interleaved", 8, 2)
    head = one.compute_s - (one.compute_s - zb.compute_s) / (1 - 12.25 / 11)  # the M heads on the last stage
    assert zb.compute_s - head == pytest.approx((one.compute_s - head) * 12.25 / 11, rel=1e-9)
    assert il.compute_s - head == pytest.approx((one.compute_s - head) * 19 / 2 / 11, rel=1e-9)
    # at this size interleaved's 26 ppermute rounds (against 14) outweigh its shorter compute
    assert il.compute_s < one.compute_s < zb.compute_s and zb.step_time_s > one.step_time_s < il.step_time_s
    # plan ticks: M + 2S - 2 = 14 for 1f1b and zb, R·M + (R+1)·S - 2 = 26 for interleaved
    unit = 1024 * 2 * 1024 * 2
    assert zb.collectives["pipe ppermute"][1] == one.collectives["pipe ppermute"][1] == 2 * 14 * unit
    assert il.collectives["pipe ppermute"][1] == 2 * 26 * unit


def test_closed_forms_are_the_packed_plans():
    """critical_runs and ticks (closed forms, what the search calls) equal the lock-step plan the
    executor runs, packed from the schedule's table, for S <= 8, M <= 32 (M >= S for zb's form;
    M a multiple of S for interleaved), R <= 4."""
    for S in range(2, 9):
        for M in range(1, 33):
            for sch, R in [("1f1b", 1), ("zb", 1)] + [("interleaved", r) for r in range(2, 5) if M % S == 0]:
                assert sched.critical_runs(S, M, R, sch) == sched.lockstep_runs(S, M, R, sch), (sch, S, M, R)
                assert sched.ticks(S, M, R, sch) == sched.plan_ticks(S, M, R, sch), (sch, S, M, R)


def test_stash_bounded_independently_of_m():
    """zb keeps 1f1b's min(M, 2S-1) ring (the same memory, exactly); interleaved keeps
    min(R·M, R·S + S - 1) chunk inputs: 2·4 + 3 = 11 at S = 4, R = 2, which in stage units is
    S·(1 + (S-1)/(S·R)) = 5.5 microbatches (Korthikanti et al. 2022). Each slot one (b, T, D)
    bf16 input; the re-run holds one chunk's residuals (lmax = 1 layer: 8 layers / (4·2))."""
    assert sched.stash_slots(4, 8, 2, "interleaved") == 11 == 2 * 4 * (1 + 3 / 8)
    assert sched.stash_slots(4, 3, 2, "interleaved") == 6  # capped by the R·M chunk forwards
    assert sched.stash_slots(4, 8, 1, "zb") == sched.stash_slots(4, 8, 1, "1f1b") == 7
    with pytest.raises(ValueError, match="keeps every iteration"):
        sched.stash_slots(4, 8, 1, "gpipe")
    b, T, D = 2, 1024, 1024
    unit = T * b * D * 2
    sv = layer_activation_bytes(Workload(M8, 32, 1024), b, 2, "none", 1)[0]
    for M in (4, 8, 16):
        assert _est("zb", M).memory == _est("1f1b", M).memory
        # against 1f1b's ring of min(M, 7) and its 2-layer stage re-run (the weight casts are the same)
        il, one = _est("interleaved", M, 2), _est("1f1b", M)
        assert il.memory["activations"] - one.memory["activations"] == pytest.approx(
            (min(2 * M, 11) - min(M, 7)) * unit - sv, rel=1e-12)
    assert _est("interleaved", 8, 2).memory["total"] == _est("interleaved", 16, 2).memory["total"]
    with pytest.raises(ValueError, match="interleaved runs R >= 2 chunks"):
        Strategy(pipe=2, schedule="interleaved")
    with pytest.raises(ValueError, match="zb runs one repeat"):
        Strategy(pipe=2, repeats=2, schedule="zb")


@pytest.mark.parametrize("L,want,R,step_new,step_old", [
    (32, "interleaved", 4, STEP_IL, 1.2076),  # old pick: 1x4x1x4 gpipe M=16 (bubble 0.158; interleaved 0.045)
    (40, "gpipe", 1, 1.5670, 1.5670),  # 40 layers on 8 stages: no R > 1 divides; zb is not searched
])
def test_cost_model_picks_the_new_schedules_when_offered(L, want, R, step_new, step_old):
    """Asked with every costed schedule (SearchSpace(new_schedules=NEW)), on 16 H100s with 40 GiB
    and a pipeline of 4 (L = 32) or 8 stages (L = 40, where no circular repeat divides the layers),
    hidden 4096, batch 64 × 2048: the search takes interleaved R = 4 over gpipe (its bubble is
    smaller at 1f1b-like memory); zb is searched only when asked for (pipeline.schedule=zb: in the
    lock-step scan it is dominated by 1f1b). Predicted step times below (s)."""
    m = ModelConfig(n_layer=L, n_embd=4096, n_head=32, vocab_size=50304, n_positions=2048)
    w = Workload(m, 64, 2048)
    fixed = Fixed(pipe=4 if L == 32 else 8)
    new = search(w, 16, H100, 40 * 2**30, SearchSpace(new_schedules=sched.NEW), fixed=fixed).best
    old = search(w, 16, H100, 40 * 2**30, SearchSpace(new_schedules=()), fixed=fixed).best
    assert (new.strategy.schedule, new.strategy.repeats) == (want, R), new.strategy
    assert old.strategy.schedule == "gpipe"
    assert new.step_time_s == pytest.approx(step_new, abs=1e-4) and old.step_time_s == pytest.approx(step_old, abs=1e-4)
    assert new.memory["total"] <= 40 * 2**30
    if L == 40:  # asked for, zb is costed and slower than 1f1b on the same mesh
        zb = search(w, 16, H100, 40 * 2**30, SearchSpace(new_schedules=sched.NEW), fixed=Fixed(pipe=8, schedule="zb"))
        one = search(w, 16, H100, 40 * 2**30, SearchSpace(), fixed=Fixed(pipe=8, schedule="1f1b"))
        assert zb.best.strategy.schedule == "zb" and zb.best.step_time_s > one.best.step_time_s


def test_default_search_offers_what_train_runs():
    """The one planner-side gate: interleaved / zb are searched once config.SCHEDULES lists them
    (after that, a plan picking them must pass build_layout like every other plan)."""
    assert SearchSpace().new_schedules == tuple(s for s in sched.NEW if s in SCHEDULES)
    assert sched.searched(("gpipe", "zb")) == ("zb",) and sched.searched(()) == ()
    assert set(sched.COSTED) >= set(SCHEDULES)


def test_sequence_parallel_swaps_the_collectives_and_splits_layernorm_activations():
    """tensor=4, no pipeline, remat none (H100 bf16, b = 16 rows): each tensor all-reduce becomes a
    reduce-scatter + all-gather of the same (b, T, D) (equal bytes and time on a ring), and every
    layer saves its four LayerNorm inputs / outputs and their fp32 stats on T/t: 3/4 of
    T·b·(4·D·2 + 16) less per layer. On XLA:CPU (no reduce-scatter) the all-reduce stays and an
    all-gather of the same tensor is added."""
    w = Workload(M8, 16, 1024)
    no, sp = (estimate(w, Strategy(tensor=4, seq_parallel=x), H100) for x in (False, True))
    ar, rs, ag = (no.collectives["tensor all-reduce"], sp.collectives["tensor reduce-scatter"],
                  sp.collectives["tensor all-gather"])
    assert rs == ag and rs[1] * 2 == pytest.approx(ar[1], rel=1e-12) and rs[0] * 2 == pytest.approx(ar[0], rel=1e-12)
    assert sp.step_time_s == pytest.approx(no.step_time_s, rel=1e-12)
    T, b, D = 1024, 16, 1024
    assert no.memory["activations"] - sp.memory["activations"] == pytest.approx(
        8 * T * b * (4 * D * 2 + 16) * 3 / 4, rel=1e-12)
    cpu = get_device("cpu")
    w32 = Workload(M8, 16, 128, "fp32")
    no, sp = (estimate(w32, Strategy(tensor=4, seq_parallel=x), cpu) for x in (False, True))
    unit = 128 * 16 * 1024 * 4
    assert sp.collectives["tensor all-reduce"] == no.collectives["tensor all-reduce"]
    n_ag = sp.collectives["tensor all-gather"][1] / all_gather(4, unit, 0, 1)[1]
    assert n_ag == pytest.approx(no.collectives["tensor all-reduce"][1] / all_reduce(4, unit, 0, 1)[1])
    assert Strategy(tensor=1, seq_parallel=True) == Strategy(tensor=1, seq_parallel=True)  # t = 1: no-op
    assert estimate(w, Strategy(seq_parallel=True), H100).memory == estimate(w, Strategy(), H100).memory
