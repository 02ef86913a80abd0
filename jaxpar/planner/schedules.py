"""Per-schedule pipeline terms of the cost model: critical path, stash, scan ticks.

The planner costs five pipeline schedules, in chunk runs on the critical path (a chunk run: the
forward, re-run and backward of one virtual stage, L/(S·R) layers, on one microbatch; R = 1 but for
circular and interleaved):

  gpipe, circular   (R-1)·max(M,S) + M + S - 1          (layout.n_iterations)
  1f1b, zb,         the lock-step plan jaxpar runs (`lockstep_runs`): the schedule's table
  interleaved       (jaxpar.parallel.schedules) packed as pipeline_exec runs it, each tick as long
                    as its busiest rank. 1f1b: M + S - 1. zb: no shorter (its B and W each re-run
                    the stage). interleaved: M·R + (R+1)·S - 2 ticks of 1/R stage, about
                    M + (1 + 1/R)·S chunk-stage units.

The closed-form bubbles of `jaxpar.parallel.layout.bubble_fraction` (interleaved (S-1)/(R·M+S-1),
ZB-H1 (S-1)/(3M+S-1)) are each rank's own idle time, what an asynchronous runtime sees; the
Megatron-engine what-if (`Strategy.engine`) costs those, jaxpar's one SPMD scan cannot reach them.

Memory: the stage (chunk) inputs a device keeps for its backward re-run, each one (b, T, D) in the
compute dtype (`stash_slots`):

  gpipe, circular   every iteration's (cost.estimate, plus the park buffer and embedded batch)
  1f1b, zb          min(M, 2S-1)                        (layout.ring_slots; ZB-H1 keeps 1F1B's peak)
  interleaved       min(R·M, R·S + S - 1)

The interleaved count is Megatron-LM's warm-up (megatron/core/pipeline_parallel/schedules.py,
interleaved 1F1B): rank s runs (S-s-1)·2 + (R-1)·S chunk forwards before its first backward, then
one more in steady state, so rank 0 holds 2(S-1) + (R-1)·S + 1 = R·S + S - 1 chunk inputs, capped by
the R·M chunk forwards there are. In whole-stage units (R chunks = one stage's layers) that is
S·(1 + (S-1)/(S·R)) microbatches, Korthikanti et al. 2022's figure; R = 1 gives 1F1B's 2S-1. It is
bounded independently of M, like 1f1b's ring.

The schedules 1f1b, zb and interleaved share jaxpar's 1F1B program shape (`BOUNDED`): a lock-step scan
whose every tick sends one activation forward and one gradient back (`ticks`), the stage re-run before
each backward (6 tensor all-reduces per layer run), embedding on the first and head on the last
stage per microbatch, fsdp-sharded weights gathered once per step. `interleaved` and `zb` are costed
on that shape before `jaxpar train` can run them: `jaxpar.config.SCHEDULES` says what it runs, and
`searched()` offers the search only those (`NEW`: the costed schedules it may not run yet).
"""

from __future__ import annotations

import functools

import numpy as np

from jaxpar.config import SCHEDULES as RUNNABLE
from jaxpar.parallel import schedules as tables
from jaxpar.parallel.layout import bubble_fraction, n_iterations, n_ticks, ring_slots

COSTED = ("gpipe", "circular", "1f1b", "interleaved", "zb")
NEW = ("interleaved", "zb")  # costed here; searched once jaxpar.config.SCHEDULES lists them
BOUNDED = ("1f1b", "interleaved", "zb")  # stash bounded independently of M (jaxpar's 1F1B program shape)
REPEATED = ("circular", "interleaved")  # R > 1 chunks per device


def searched(new: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The NEW schedules the search offers: those `jaxpar train` accepts (config.SCHEDULES), or `new`."""
    return tuple(s for s in NEW if s in (RUNNABLE if new is None else new))


def bubble(S: int, M: int, R: int, schedule: str) -> float:
    """Idle fraction of the critical path: layout.bubble_fraction for gpipe / circular; for the
    table schedules 1 - R·M / lockstep_runs, the plan jaxpar runs (equal to the closed form for
    1f1b and interleaved, above 1f1b's for zb, whose B and W each re-run the stage)."""
    if schedule in BOUNDED:
        return 1.0 - R * M / critical_runs(S, M, R, schedule)
    return bubble_fraction(S, M, R, schedule)


# Cost of each action of a lock-step plan in stage forwards: B, W and BW first re-run the stage
# from its saved input (1), then take the input gradient (1), the weight gradient (1) or both (2).
ACTION_COST = {tables.F: 1, tables.B: 2, tables.W: 2, tables.BW: 3}
RUN_COST = ACTION_COST[tables.F] + ACTION_COST[tables.BW]  # one chunk run: forward + re-run + backward


@functools.lru_cache(maxsize=4096)
def lockstep_runs(S: int, M: int, R: int, schedule: str) -> float:
    """Chunk runs on the critical path of the plan jaxpar executes: the table packed for lock
    step (schedules.lockstep), each tick costing its busiest rank's actions, over RUN_COST."""
    plan = tables.lockstep(tables.make_table(schedule, S, M, R))  # (N, S, 3 lanes, [kind, m, v])
    kinds = plan[..., 0]
    cost = np.zeros(kinds.shape, np.int64)
    for k, c in ACTION_COST.items():
        cost[kinds == k] = c
    return float(cost.sum(axis=2).max(axis=1).sum()) / RUN_COST


def critical_runs(S: int, M: int, R: int, schedule: str) -> float:
    """Chunk runs on the critical path (see the module docstring). The table schedules' closed
    forms equal `lockstep_runs` (tests/planner/test_planner_schedules.py: S <= 8, M <= 32, R <= 4)
    and cost nothing at 3,072 devices, where packing a table of M·S actions would take seconds."""
    if schedule in ("gpipe", "circular"):
        return n_iterations(S, M, R)  # integral, the scan's own iteration count
    if schedule == "1f1b":
        return M + S - 1
    if schedule == "interleaved":
        return R * M + S - 1  # Megatron's bubble (S-1)/(R·M+S-1), reached in lock step
    if M >= S:  # zb: 1f1b's path plus a quarter run per microbatch past the first S-1
        return (5 * M + 3 * (S - 1)) / 4
    return lockstep_runs(S, M, R, schedule)


def stash_slots(S: int, M: int, R: int, schedule: str) -> int:
    """(b, T, D) stage (chunk) inputs a bounded schedule keeps for its backward (see module docstring)."""
    if schedule == "interleaved":
        return min(R * M, R * S + S - 1)
    if schedule in ("1f1b", "zb"):
        return ring_slots(S, M)
    raise ValueError(f"schedule {schedule!r} keeps every iteration's input (cost.estimate)")


def ticks(S: int, M: int, R: int, schedule: str) -> int:
    """Scan ticks of a bounded schedule's lock-step plan (one ppermute each way per tick): 1f1b's
    M + 2S - 2 (layout.n_ticks), zb the same, interleaved R·M + (R+1)·S - 2 (`plan_ticks`)."""
    return R * M + (R + 1) * S - 2 if schedule == "interleaved" else n_ticks(S, M)


def plan_ticks(S: int, M: int, R: int, schedule: str) -> int:
    """The length of the packed plan itself (the reference `ticks` is checked against)."""
    return len(tables.lockstep(tables.make_table(schedule, S, M, R)))
