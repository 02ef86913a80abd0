"""Pipeline stage partition: split a chain of L layers into S contiguous stages.

Objective: minimise the slowest stage, where stage k covering layers
[i, j) costs

    time_k = sum(layer_costs[i:j]) + (first_extra if k == 0) + (last_extra if k == S-1)

(the first stage also runs the embedding, the last the final LayerNorm + logits + loss),
subject to each stage's memory

    mem_k = sum(layer_mem[i:j]) + (first_mem if k == 0) + (last_mem if k == S-1) <= mem_limit.

Among partitions with the optimal bottleneck we return the one with the smallest sum of
squared stage times (the most even), so results are deterministic and balanced.

Exact dynamic programme over prefix sums, O(S·L²) time: f[k][j] = best bottleneck of
putting layers [0, j) on stages 0..k. L=48, S=8 runs in ~10 ms.

Public API (the pipeline and the planner import these):
  partition_layers(...) -> tuple[int, ...]   layers per stage
  stage_times(...), stage_memory(...)        per-stage cost of a given split
  validate_layers_per_stage(...)             checks a manual `pipeline.layers_per_stage`
  stage_bounds(layers_per_stage)             [(start, stop), ...] layer ranges
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpar.config import ConfigError

# Relative slack when comparing floating sums against the optimum / memory limit.
_EPS = 1e-9


def _prefix(xs: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + float(x))
    return out


def stage_bounds(layers_per_stage: Sequence[int]) -> list[tuple[int, int]]:
    """(2, 3, 1) -> [(0, 2), (2, 5), (5, 6)]: half-open layer ranges of each stage."""
    out, start = [], 0
    for n in layers_per_stage:
        out.append((start, start + int(n)))
        start += int(n)
    return out


def stage_times(layers_per_stage: Sequence[int], layer_costs: Sequence[float],
                first_extra: float = 0.0, last_extra: float = 0.0) -> list[float]:
    """Cost of each stage of a given split (same formula the optimiser minimises)."""
    c = _prefix(layer_costs)
    S = len(layers_per_stage)
    out = []
    for k, (i, j) in enumerate(stage_bounds(layers_per_stage)):
        out.append(c[j] - c[i] + (first_extra if k == 0 else 0.0) + (last_extra if k == S - 1 else 0.0))
    return out


def stage_memory(layers_per_stage: Sequence[int], layer_mem: Sequence[float],
                 first_mem: float = 0.0, last_mem: float = 0.0) -> list[float]:
    """Memory of each stage of a given split."""
    return stage_times(layers_per_stage, layer_mem, first_mem, last_mem)


def validate_layers_per_stage(layers_per_stage: Sequence[int], n_layer: int, n_stages: int,
                              stages_name: str = "mesh.pipe") -> tuple[int, ...]:
    """Check a manual `pipeline.layers_per_stage`; returns it as a tuple of ints.

    Raises ConfigError (one line, naming the values) when the list has the wrong length,
    a stage with fewer than one layer, or a sum other than model.n_layer. (More stages than
    layers is `jaxpar.parallel.layout`'s check, made before this one.)
    `stages_name` names the setting the stage count came from (e.g. "mesh.pipe×pipeline.repeats").
    """
    lps = [int(v) for v in layers_per_stage]
    if len(lps) != n_stages:
        raise ConfigError(f"pipeline.layers_per_stage={lps} has {len(lps)} entries, not {stages_name}={n_stages}")
    bad = [v for v in lps if v < 1]
    if bad:
        raise ConfigError(f"pipeline.layers_per_stage={lps} has a stage with {bad[0]} layers; every stage needs >= 1")
    if sum(lps) != n_layer:
        raise ConfigError(f"pipeline.layers_per_stage={lps} sums to {sum(lps)}, not model.n_layer={n_layer}")
    return tuple(lps)


def _solve(c: list[float], m: list[float] | None, S: int, first: float, last: float,
           first_m: float, last_m: float, limit: float, cap: float | None) -> tuple[float, list[list[int]]] | None:
    """DP core. Without `cap`: minimise the max stage time. With `cap`: minimise the sum of
    squared stage times over splits whose every stage time is <= cap. Returns (value, argmin
    table) or None if nothing is feasible. f[k][j]: stages 0..k hold layers [0, j)."""
    L = len(c) - 1
    INF = float("inf")
    f = [[INF] * (L + 1) for _ in range(S)]
    arg = [[-1] * (L + 1) for _ in range(S)]

    def cost(k: int, i: int, j: int) -> float:
        t = c[j] - c[i] + (first if k == 0 else 0.0) + (last if k == S - 1 else 0.0)
        if m is not None:
            mem = m[j] - m[i] + (first_m if k == 0 else 0.0) + (last_m if k == S - 1 else 0.0)
            if mem > limit * (1 + _EPS):
                return INF
        if cap is not None and t > cap * (1 + _EPS) + _EPS:
            return INF
        return t

    def combine(prev: float, t: float) -> float:
        return max(prev, t) if cap is None else prev + t * t

    for j in range(1, L - S + 2):  # stage 0 leaves >= 1 layer to each later stage
        t = cost(0, 0, j)
        if t < INF:
            f[0][j], arg[0][j] = (t if cap is None else t * t), 0
    for k in range(1, S):
        for j in range(k + 1, L - (S - 1 - k) + 1):
            best, best_i = INF, -1
            for i in range(k, j):
                if f[k - 1][i] == INF:
                    continue
                t = cost(k, i, j)
                if t == INF:
                    continue
                v = combine(f[k - 1][i], t)
                if v < best:
                    best, best_i = v, i
            f[k][j], arg[k][j] = best, best_i
    if f[S - 1][L] == INF:
        return None
    return f[S - 1][L], arg


def _backtrack(arg: list[list[int]], S: int, L: int) -> tuple[int, ...]:
    sizes, j = [], L
    for k in range(S - 1, -1, -1):
        i = arg[k][j]
        sizes.append(j - i)
        j = i
    return tuple(reversed(sizes))


def _even(L: int, S: int) -> tuple[int, ...]:
    """The DP's answer for L equal layers and no extras or memory limit, in O(S): the bottleneck is
    ceil(L/S), the most even split has L % S stages of one layer more, and the DP's tie-break
    (the smallest i: the longest last stage) puts them last. The DP is O(S·L²): a plan of 3,000
    layers ran it for minutes (tests/planner/test_partition_even.py checks both agree)."""
    q, r = divmod(L, S)
    return (q,) * (S - r) + (q + 1,) * r


def partition_layers(layer_costs: Sequence[float], n_stages: int, first_extra: float = 0.0,
                     last_extra: float = 0.0, layer_mem: Sequence[float] | None = None,
                     mem_limit: float | None = None, first_mem: float = 0.0,
                     last_mem: float = 0.0) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage, each stage within `mem_limit`.

    layer_costs: per-layer time (any unit: FLOPs, seconds) for the L layers in order.
    first_extra / last_extra: cost of the embedding (stage 0) and of ln_f + logits + loss
        (stage S-1), same unit. With S == 1 both land on the one stage.
    layer_mem, mem_limit, first_mem, last_mem: per-layer memory (bytes), the per-stage
        budget and the extra memory of the first / last stage. No memory check when
        `mem_limit` is None.
    Returns a tuple of S positive ints summing to L. Raises ConfigError when no split fits
    `mem_limit` (the message names the smallest achievable stage peak), ValueError unless 1 <= S <= L.
    """
    L, S = len(layer_costs), int(n_stages)
    if not 1 <= S <= L:  # a caller's bug: the layout and the planner only ask for 1 <= S <= L
        raise ValueError(f"cannot cut {L} layers into {S} stages")
    if mem_limit is None and first_extra == last_extra == 0.0 and len(set(layer_costs)) == 1:
        return _even(L, S)
    c = _prefix(layer_costs)
    m = None
    limit = float("inf")
    if mem_limit is not None:
        m = _prefix(layer_mem if layer_mem is not None else [0.0] * L)
        limit = float(mem_limit)
    res = _solve(c, m, S, first_extra, last_extra, first_mem, last_mem, limit, None)
    if res is None:
        # Smallest achievable per-stage memory peak: the same DP on memory alone.
        best = _solve(m, None, S, first_mem, last_mem, 0.0, 0.0, limit, None)
        need = best[0] if best else float("nan")
        raise ConfigError(f"no split of {L} layers into {S} stages fits mem_limit={mem_limit:.4g} "
                          f"(smallest possible stage peak is {need:.4g})")
    bottleneck = res[0]
    # Second pass: the most even split (min sum of squares) among those reaching the bottleneck.
    res2 = _solve(c, m, S, first_extra, last_extra, first_mem, last_mem, limit, bottleneck)
    arg = res2[1] if res2 is not None else res[1]
    return _backtrack(arg, S, L)
