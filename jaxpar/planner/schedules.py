"""Per-schedule pipeline terms of the cost model: critical path, stash, scan ticks.

The planner costs five pipeline schedules. Time comes from the closed-form idle fraction
`jaxpar.parallel.layout.bubble_fraction(S, M, R, schedule)` (imported, not restated here): a device
does R·M chunk runs (a chunk = one virtual stage, L/(S·R) layers; R = 1 but for circular and
interleaved), so the critical path is R·M / (1 - bubble) chunk runs:

  gpipe, circular   (R-1)·max(M,S) + M + S - 1          (layout.n_iterations)
  1f1b              M + S - 1                           ((M+S-1)·(F+B), the idle halves skipped)
  interleaved       R·M + S - 1                         (Megatron's virtual stages, bubble (S-1)/(R·M+S-1))
  zb                M + (S-1)/3                         (ZB-H1, Qi et al. 2023: bubble (S-1)/(3M+S-1) in units
                                                         F = B = W, a microbatch-stage being F+B+W = 3 units)

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

from jaxpar.config import SCHEDULES as RUNNABLE
from jaxpar.parallel.layout import bubble_fraction, n_iterations, n_ticks, ring_slots

COSTED = ("gpipe", "circular", "1f1b", "interleaved", "zb")
NEW = ("interleaved", "zb")  # costed here; searched once jaxpar.config.SCHEDULES lists them
BOUNDED = ("1f1b", "interleaved", "zb")  # stash bounded independently of M (jaxpar's 1F1B program shape)
REPEATED = ("circular", "interleaved")  # R > 1 chunks per device


def searched(new: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The NEW schedules the search offers: those `jaxpar train` accepts (config.SCHEDULES), or `new`."""
    return tuple(s for s in NEW if s in (RUNNABLE if new is None else new))


def bubble(S: int, M: int, R: int, schedule: str) -> float:
    """Idle fraction of a device's step (layout.bubble_fraction)."""
    return bubble_fraction(S, M, R, schedule)


def critical_runs(S: int, M: int, R: int, schedule: str) -> float:
    """Chunk runs (F+B of one virtual stage on one microbatch) on the critical path: R·M / (1 - bubble)."""
    if schedule in ("gpipe", "circular"):
        return n_iterations(S, M, R)  # integral, the scan's own iteration count
    if schedule == "1f1b":
        return M + S - 1
    return R * M / (1.0 - bubble(S, M, R, schedule))


def stash_slots(S: int, M: int, R: int, schedule: str) -> int:
    """(b, T, D) stage (chunk) inputs a bounded schedule keeps for its backward (see module docstring)."""
    if schedule == "interleaved":
        return min(R * M, R * S + S - 1)
    if schedule in ("1f1b", "zb"):
        return ring_slots(S, M)
    raise ValueError(f"schedule {schedule!r} keeps every iteration's input (cost.estimate)")


def ticks(S: int, M: int, R: int, schedule: str) -> int:
    """Scan ticks of a bounded schedule (one ppermute each way per tick): 1f1b's M + 2S - 2
    (layout.n_ticks) with R·M chunk forwards in place of M."""
    return n_ticks(S, R * M)
