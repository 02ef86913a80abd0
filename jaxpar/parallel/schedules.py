"""Pipeline schedules as tables: one numpy generator per schedule, read by one executor.

A table is an int32 array (N, S, 3): at tick t pipe rank s runs `kind` on (microbatch m, virtual
stage v), v = r·S + s for the r-th of the R chunks rank s holds (Megatron's virtual stages).
Kinds: F (forward), B (input gradient), W (weight gradient), BW (B and W fused), HOLD (the second
tick of a BW: busy, nothing new starts), IDLE (m = v = -1). One tick is one time unit:
F = B = W = 1 and BW = 2 ticks, the unit of `jaxpar.parallel.layout.bubble_fraction`; with R
chunks a tick is the time of 1/R of a stage's layers. `jaxpar.parallel.pipeline_exec` runs any
table in one `lax.scan` of N ticks.

The tables are produced by one list-scheduling simulation (`simulate`): each rank, when free,
starts the action its schedule's policy picks among those whose inputs have arrived (a result
made at tick t is usable from tick t+1 on the neighbour). Dependencies: F(m, v) after F(m, v-1);
B(m, v) after F(m, v) and B(m, v+1) (the last virtual stage computes the head and loss in its
B); W(m, v) after B(m, v).

Schedules (S ranks, M microbatches, R chunks per rank):
  1f1b         PipeDream-flush with the warm-up lock step needs: rank s runs min(2(S-1-s), M)
               forwards, then alternates F and BW, then the remaining BWs. N = 3(M+S-1); bubble
               (S-1)/(M+S-1); stash min(M, 2S-1) (rank 0).
  interleaved  Megatron-LM's virtual-stage order (Narayanan et al. 2021): forwards in groups of S
               microbatches per chunk, chunks ascending (descending for the backward), warm-up
               2(S-1-s) + (R-1)S forwards, then F/BW alternating. Needs M % S == 0. Bubble
               (S-1)/(R·M+S-1); stash (R+1)S - 1 chunk inputs on rank 0 for M >= 2S.
  zb           ZB-H1 (Qi et al. 2023): B and W split; 1F1B's warm-up, then B_i, W_{i-s}, F:
               rank s defers s weight gradients, which fill the drain. Bubble (S-1)/(3M+S-1)
               for M >= S (more idle below); stash min(M, 2S-1) inputs as 1f1b, and up to S
               output gradients waiting for their W.
"""

from __future__ import annotations

import numpy as np

IDLE, F, B, W, BW, HOLD = 0, 1, 2, 3, 4, 5
KIND_NAMES = {IDLE: ".", F: "F", B: "B", W: "W", BW: "BW", HOLD: "bw"}
COST = {F: 1, B: 1, W: 1, BW: 2}
TABLE_SCHEDULES = ("1f1b", "zb", "interleaved")  # pipeline.schedule values run from a table


def _orders_1f1b(S: int, M: int, R: int):
    """Each rank's program: 2(S-1-s) warm-up forwards (what lock step needs to keep every rank
    busy, `lockstep`), then one F and one BW, then the remaining BWs."""
    out = []
    for s in range(S):
        warm = min(2 * (S - 1 - s), M)
        prog = [(F, m, s) for m in range(warm)]
        for i in range(M - warm):
            prog += [(F, warm + i, s), (BW, i, s)]
        prog += [(BW, m, s) for m in range(M - warm, M)]
        out.append(prog)
    return out


def _orders_interleaved(S: int, M: int, R: int):
    """Megatron-LM's interleaved order: the k-th forward of rank s is microbatch
    (k // (S·R))·S + k % S of chunk (k // S) % R; backwards walk the chunks in reverse."""
    out = []
    total = R * M

    def fwd(k, s):
        return (F, (k // (S * R)) * S + k % S, ((k // S) % R) * S + s)

    def bwd(k, s):
        return (BW, (k // (S * R)) * S + k % S, (R - 1 - (k // S) % R) * S + s)

    for s in range(S):
        warm = min((S - 1 - s) * 2 + (R - 1) * S, total)
        prog = [fwd(k, s) for k in range(warm)]
        for i in range(total - warm):
            prog += [fwd(warm + i, s), bwd(i, s)]
        prog += [bwd(k, s) for k in range(total - warm, total)]
        out.append(prog)
    return out


def _orders_zb(S: int, M: int, R: int):
    """ZB-H1: 1F1B's warm-up and first forward (2(S-1-s) + 1), then per microbatch i: B_i, the
    W of microbatch i-s (rank s defers s weight gradients), the next forward; the deferred Ws
    close the program and fill the drain."""
    out = []
    for s in range(S):
        warm = min(2 * (S - 1 - s) + 1, M)
        prog = [(F, m, s) for m in range(warm)]
        for i in range(M):
            prog.append((B, i, s))
            if i >= s:
                prog.append((W, i - s, s))
            if i + warm < M:
                prog.append((F, i + warm, s))
        prog += [(W, m, s) for m in range(max(M - s, 0), M)]
        out.append(prog)
    return out


def simulate(S: int, R: int, orders) -> np.ndarray:
    """The table of a list schedule: at each tick every free rank starts the next action of its
    program `orders[s]` once that action's inputs were made before this tick, else idles."""
    V = R * S
    done: dict[tuple, int] = {}  # (kind, m, v) -> first tick its result can be used (B also for BW)
    free_at, ptr = [0] * S, [0] * S
    cells: list[list] = []
    limit = 8 * sum(len(p) for p in orders) + 16

    def ready(a, t):
        k, m, v = a
        if k == F:
            return v == 0 or done.get((F, m, v - 1), limit) <= t
        if k in (B, BW):
            return done.get((F, m, v), limit) <= t and (v == V - 1 or done.get((B, m, v + 1), limit) <= t)
        return done.get((B, m, v), limit) <= t  # W

    t = 0
    while any(ptr[s] < len(orders[s]) for s in range(S)):
        if t >= limit:
            raise RuntimeError(f"schedule deadlocked at S={S}, R={R}")
        while len(cells) <= t:
            cells.append([(IDLE, -1, -1)] * S)
        for s in range(S):
            if free_at[s] > t or ptr[s] == len(orders[s]) or not ready(orders[s][ptr[s]], t):
                continue
            k, m, v = a = orders[s][ptr[s]]
            ptr[s] += 1
            c = COST[k]
            while len(cells) < t + c:
                cells.append([(IDLE, -1, -1)] * S)
            cells[t][s] = a
            for j in range(1, c):
                cells[t + j][s] = (HOLD, m, v)
            free_at[s] = t + c
            if k == F:
                done[(F, m, v)] = t + c
            elif k in (B, BW):
                done[(B, m, v)] = t + c
        t += 1
    return np.asarray(cells, np.int32).reshape(len(cells), S, 3)


def schedule_problem(schedule: str, S: int, M: int, R: int) -> str | None:
    """Why `schedule` has no table for (S, M, R), or None: the one statement, which
    `jaxpar.parallel.layout.build_layout` raises as a ConfigError."""
    if schedule not in TABLE_SCHEDULES:
        return f"pipeline.schedule={schedule!r} has no schedule table"
    if schedule != "interleaved" and R != 1:
        return f"pipeline.repeats={R} needs pipeline.schedule=interleaved or circular (got {schedule!r})"
    if schedule == "interleaved" and M % S:
        return (f"pipeline.schedule=interleaved needs pipeline.microbatches={M} divisible by mesh.pipe={S} "
                "(Megatron's order runs microbatches in groups of mesh.pipe)")
    return None


def make_table(schedule: str, S: int, M: int, R: int = 1) -> np.ndarray:
    """The (N, S, 3) [kind, microbatch, virtual stage] table of `schedule`; see the module docstring."""
    if why := schedule_problem(schedule, S, M, R):
        raise ValueError(why)
    orders = {"1f1b": _orders_1f1b, "interleaved": _orders_interleaved, "zb": _orders_zb}[schedule]
    return simulate(S, R, orders(S, M, R))


# ----------------------------------------------------------------------------- reading a table


def busy_ticks(table: np.ndarray) -> np.ndarray:
    """(S,) ticks each rank works (HOLD included: the second tick of a fused backward)."""
    return (table[..., 0] != IDLE).sum(0)


def idle_ticks(table: np.ndarray) -> np.ndarray:
    """(S,) ticks each rank waits: N - busy."""
    return len(table) - busy_ticks(table)


def bubble(table: np.ndarray) -> float:
    """Idle fraction of the ranks' time, all ranks together."""
    return float(idle_ticks(table).sum() / (len(table) * table.shape[1]))


def last_use(table: np.ndarray) -> dict[tuple, int]:
    """(s, m, v) -> the tick of the last action that reads stage input x(m, v): its W or BW."""
    out = {}
    for t, s in zip(*np.nonzero(np.isin(table[..., 0], (W, BW)))):
        _, m, v = table[t, s]
        out[(int(s), int(m), int(v))] = int(t)
    return out


def stash_intervals(table: np.ndarray) -> list[list[tuple[int, int, int, int]]]:
    """Per rank: (first tick, last tick, m, v) of each saved stage input: from the tick it arrives
    (the tick after the previous virtual stage's forward; stage 0's own forward, which embeds)
    to its last use."""
    S = table.shape[1]
    fwd = {(int(table[t, s, 1]), int(table[t, s, 2])): int(t) for t, s in zip(*np.nonzero(table[..., 0] == F))}
    out: list[list] = [[] for _ in range(S)]
    for (s, m, v), end in last_use(table).items():
        start = fwd[(m, v)] if v == 0 else fwd[(m, v - 1)] + 1
        out[s].append((start, end, m, v))
    return out


def grad_intervals(table: np.ndarray) -> list[list[tuple[int, int, int, int]]]:
    """Per rank: (first tick, last tick, m, v) of each saved output gradient dy(m, v): from its
    arrival (the tick after B of v+1; the last virtual stage makes it in its own B) to its last
    use (the B/BW, or the W of a split backward)."""
    S = table.shape[1]
    bwd = {(int(table[t, s, 1]), int(table[t, s, 2])): int(t) for t, s in
           zip(*np.nonzero(np.isin(table[..., 0], (B, BW))))}
    V = max(v for _, v in bwd) + 1
    out: list[list] = [[] for _ in range(S)]
    for (s, m, v), end in last_use(table).items():
        start = bwd[(m, v)] if v == V - 1 else bwd[(m, v + 1)] + 1
        out[s].append((start, end, m, v))
    return out


def peak_live(intervals) -> int:
    """Most intervals live at one tick, over all ranks (inclusive ends)."""
    best = 0
    for iv in intervals:
        events = sorted([(a, 0) for a, *_ in iv] + [(b, 1) for _, b, *_ in iv])
        live = 0
        for _, end in events:
            live += -1 if end else 1
            best = max(best, live)
    return best


def peak_stash(table: np.ndarray) -> int:
    """Most stage inputs one rank holds at once (the executor's stash slots)."""
    return peak_live(stash_intervals(table))


def assign_slots(intervals) -> tuple[dict[tuple, int], int]:
    """Greedy interval colouring per rank: (s, m, v) -> slot, and the slot count (= peak_live)."""
    slots, n = {}, 0
    for s, iv in enumerate(intervals):
        free_at: list[int] = []  # per slot: first tick it is free again
        for a, b, m, v in sorted(iv):
            j = next((j for j, f in enumerate(free_at) if f <= a), None)
            if j is None:
                free_at.append(0)
                j = len(free_at) - 1
            free_at[j] = b + 1
            slots[(s, m, v)] = j
        n = max(n, len(free_at))
    return slots, n


# ----------------------------------------------------------------------------- the lock-step plan

LANE = {F: 0, B: 1, BW: 1, W: 2}  # a plan tick runs, per rank, at most one action per lane, in this order


def lockstep(table: np.ndarray) -> np.ndarray:
    """The table packed for one SPMD scan: (N', S, 3 lanes, 3) [kind, m, v], lane 0 forward,
    lane 1 B or BW, lane 2 W. Ranks run in lock step (one ppermute each way ends every tick), so
    a tick lasts as long as its slowest rank and unit ticks would leave every rank waiting on
    the slowest action; packed, a rank runs up to one action per lane in a tick. Each action
    lands on the earliest tick that keeps (1) its inputs: made on another rank, at an earlier
    tick; on its own rank, at an earlier tick or an earlier lane of the same one; (2) its
    rank's program order, except that a forward may share the tick of the action just before
    it (running first). 1f1b packs into M + 2S - 2 ticks, one F and one BW per rank per tick."""
    N, S, _ = table.shape
    V = int(table[..., 2].max()) + 1
    at: dict[tuple, int] = {}  # (kind, m, v) -> plan tick
    last = [[-1, -1, -1] for _ in range(S)]  # per rank and lane: the last tick used
    prev = [(-1, None) for _ in range(S)]  # per rank: (tick, lane) of the previous action
    rows: list = []
    for t in range(N):
        for s in range(S):
            k, m, v = (int(x) for x in table[t, s])
            if k in (IDLE, HOLD):
                continue
            lane = LANE[k]
            lo = last[s][lane] + 1
            pt, pl = prev[s]
            if pl is not None:
                lo = max(lo, pt if (lane > pl or k == F) else pt + 1)
            if k == F and v > 0:
                lo = max(lo, at[(F, m, v - 1)] + 1)
            if k in (B, BW):
                lo = max(lo, at[(F, m, v)])
                if v < V - 1:
                    lo = max(lo, at[(B, m, v + 1)] + 1)
            if k == W:
                lo = max(lo, at[(B, m, v)])
            while len(rows) <= lo:
                rows.append(np.full((S, 3, 3), -1, np.int32))
                rows[-1][..., 0] = IDLE
            rows[lo][s, lane] = (k, m, v)
            at[(B if k == BW else k, m, v)] = lo
            last[s][lane] = lo
            if k == F and pl is not None and lo == pt:
                continue  # ran ahead of the previous action: that one stays the rank's latest
            prev[s] = (lo, lane)
    return np.stack(rows)


def plan_intervals(plan: np.ndarray):
    """Per rank, in plan ticks: (first, last, m, v) of each saved stage input x (arrival -> last
    W / BW) and of each saved output gradient dy (arrival, or the last stage's own B -> its B /
    BW / W). Within a tick: arrivals are stored first, then lanes F, B, W run."""
    S = plan.shape[1]
    at: dict[tuple, int] = {}
    for t, s, lane in zip(*np.nonzero(plan[..., 0] != IDLE)):
        k, m, v = (int(x) for x in plan[t, s, lane])
        at[(k, m, v)] = int(t)
    V = max(v for _, _, v in at) + 1
    xs: list[list] = [[] for _ in range(S)]
    gs: list[list] = [[] for _ in range(S)]
    for (k, m, v), t in at.items():
        if k not in (W, BW):
            continue
        s = v % S
        xs[s].append((at[(F, m, v)] if v == 0 else at[(F, m, v - 1)] + 1, t, m, v))
        b = at.get((B, m, v), t)
        gs[s].append((b if v == V - 1 else at.get((B, m, v + 1), at.get((BW, m, v + 1), -1)) + 1, t, m, v))
    return xs, gs


def render(table: np.ndarray) -> str:
    """Rows per rank, one column per tick: F3 = forward of microbatch 3 ('.' idle)."""
    S = table.shape[1]
    return "\n".join(" ".join(f"{KIND_NAMES[k]}{m if k != IDLE else ''}".ljust(4) for k, m, _ in table[:, s])
                     for s in range(S))
