"""Search: every mesh factorisation × OSDP groups × microbatches/repeats × remat × op splitting.

For each mesh (data, fsdp, tensor, pipe) whose sizes respect the divisibility sharding needs,
enumerate the per-mesh options, estimate each with `cost.estimate`, and keep the fastest
strategy that fits memory. The result holds the best strategy of each mesh, fastest first
(runners-up are then different meshes, which is what a user wants to compare).

Pruning (exact, never drops a plan that could rank in the top k):
  * meshes are visited in order of a compute-only lower bound on step time
    LB = 3·(L·F_layer + F_head) / (S · peak · eff(M=1)) ; once LB exceeds the k-th best
    step time found so far, every later mesh is skipped;
  * without a pipeline, more grad-accumulation steps only add time (smaller matmuls, one
    more FSDP gather/scatter round per microbatch) while saving memory, so for each other
    option we stop at the first (smallest) M that fits.
  * within a mesh, an option at least as costly in every time coordinate (remat, vocab_chunks,
    mlp_chunks) as one that fits is skipped. This and the M rule hold only while remat and
    splitting never save time, i.e. for devices without an elementwise-traffic term
    (`mem_bandwidth == 0`); with one (cpu), every option is estimated.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from jaxpar.planner.cost import GROUPS, REMAT, Estimate, Strategy, Workload, estimate
from jaxpar.planner.devices import DeviceSpec


@dataclass(frozen=True)
class SearchSpace:
    """Which options the search may use. `TRAIN_SUPPORTED` (space=train) is the older, smaller space
    (remat none/full, uniform fsdp, no op splitting); `jaxpar train` now applies the full space."""

    remat: tuple[str, ...] = REMAT
    osdp: bool = True  # per-group sharded/replicated choice; False: all groups follow fsdp
    vocab_chunks: tuple[int, ...] = (1, 8)
    mlp_chunks: tuple[int, ...] = (1, 4)
    pipeline: bool = True
    repeats: bool = True  # circular schedule (R > 1)
    max_microbatches: int = 64


TRAIN_SUPPORTED = SearchSpace(remat=("none", "full"), osdp=False, vocab_chunks=(1,), mlp_chunks=(1,))


@dataclass
class SearchResult:
    ranked: list[Estimate]  # best strategy per mesh, fastest first (fitting ones only)
    evaluated: int  # number of strategies estimated
    meshes: int  # meshes that passed divisibility
    min_memory: float  # smallest predicted per-device memory over every evaluated strategy
    seconds: float
    rejected: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def meshes(w: Workload, n_devices: int, pipeline: bool = True) -> list[tuple[int, int, int, int]]:
    """(data, fsdp, tensor, pipe) with product n_devices that sharding can realise:
    tensor divides n_head, n_embd, 4·n_embd and vocab; fsdp divides n_embd (the dim it
    shards); pipe <= n_layer; data·fsdp divides the global batch."""
    m = w.model
    out = []
    for t in divisors(n_devices):
        if t > 1 and any(x % t for x in (m.n_head, m.n_embd, 4 * m.n_embd, m.vocab_size)):
            continue
        for p in divisors(n_devices // t):
            if p > m.n_layer or (p > 1 and not pipeline):
                continue
            for f in divisors(n_devices // (t * p)):
                d = n_devices // (t * p * f)
                if f > 1 and m.n_embd % f:
                    continue
                if w.batch_size % (d * f):
                    continue
                out.append((d, f, t, p))
    return out


def _lower_bound(w: Workload, mesh: tuple[int, int, int, int], dev: DeviceSpec) -> float:
    """Compute-only step time with M=1, no remat and a perfect pipeline: never above the real estimate."""
    d, f, t, p = mesh
    e = estimate(w, Strategy(d, f, t, 1), dev)
    # Same replica batch without the pipeline, M=1 (largest, most efficient matmuls), no remat:
    # its compute and tensor all-reduces spread perfectly over p stages bound any real plan.
    return (e.compute_s + e.comm_s["tensor"]) / p


def _options(w: Workload, mesh, space: SearchSpace):
    """Yield (osdp replicated groups, remat, vocab_chunks, mlp_chunks, R, microbatch list)."""
    d, f, _, p = mesh
    b_rep = w.batch_size // (d * f)
    ms = [k for k in divisors(b_rep) if k <= space.max_microbatches]
    reps = [1]
    if p > 1 and space.repeats:
        # circular: equal chunks, so p·R must divide n_layer; beyond R=4 the bubble gain is small
        # and every extra repeat adds a ppermute round per microbatch.
        reps += [r for r in (2, 4) if w.model.n_layer % (p * r) == 0]
    if f > 1 and space.osdp:
        # All-replicated over fsdp is plain data parallelism on d·f, already its own mesh: skip it.
        groups = [tuple(g for g, rep in zip(GROUPS, bits) if rep) for bits in itertools.product((0, 1), repeat=3)
                  if not all(bits)]
    else:
        groups = [()]
    vcs = [v for v in space.vocab_chunks if v == 1 or (w.seq_len * 1) % v == 0]
    # jaxpar.ops.chunked_mlp: strided chunks of the 4D hidden dim, each split evenly over tensor
    mcs = [c for c in space.mlp_chunks if c == 1 or (4 * w.model.n_embd) % (c * mesh[2]) == 0]
    # pipeline.py rematerialises whole stages itself: inner remat policies change nothing there
    remats = range(len(space.remat)) if p == 1 else [0]
    for rep, r in itertools.product(groups, reps):
        yield rep, r, ms, list(itertools.product(remats, vcs, mcs))


def _dominated(opt: tuple[int, int, int], fitted: list[tuple[int, int, int]]) -> bool:
    """(remat index, vocab_chunks, mlp_chunks) costs at least as much time as a fitting option
    that is <= in every coordinate (each step up only adds recompute), so it cannot win."""
    return any(all(a >= b for a, b in zip(opt, f)) for f in fitted)


def search(w: Workload, n_devices: int, dev: DeviceSpec, memory_limit: float,
           space: SearchSpace = SearchSpace(), top_k: int = 8) -> SearchResult:
    """Fastest fitting strategy per mesh, fastest first (at most top_k meshes kept)."""
    t0 = time.perf_counter()
    all_meshes = meshes(w, n_devices, space.pipeline)
    order = sorted(all_meshes, key=lambda mh: _lower_bound(w, mh, dev))
    best: dict[tuple, Estimate] = {}
    evaluated, min_mem = 0, float("inf")

    kth = float("inf")  # k-th best step time among per-mesh bests so far
    # Remat and splitting only add time while elementwise traffic is not modelled; with it
    # (mem_bandwidth > 0, e.g. cpu) they can save more traffic than they cost, so every option
    # is estimated.
    monotone = dev.mem_bandwidth == 0

    for mesh in order:
        if _lower_bound(w, mesh, dev) > kth:
            break  # every later mesh has an even larger lower bound
        d, f, t, p = mesh
        for rep, r, ms, opts in _options(w, mesh, space):
            fitted_at: dict[int, list] = {}  # M -> options that fit at that M
            for M in ms:
                fitted = fitted_at.setdefault(M, [])
                for n_opt, opt in enumerate(opts):
                    # p == 1: a smaller M that fits with an option <= this one is faster.
                    if monotone and (_dominated(opt, fitted) or
                                     (p == 1 and any(_dominated(opt, v) for v in fitted_at.values()))):
                        continue
                    ri, vc, mc = opt
                    s = Strategy(d, f, t, p, M, r, space.remat[ri], rep, vc, mc)
                    e = estimate(w, s, dev, memory_limit)
                    evaluated += 1
                    min_mem = min(min_mem, e.memory["total"])
                    if monotone and n_opt == 0 and e.step_time_s > kth:
                        break  # opts[0] (no remat, no splitting) is the fastest option at this M
                    if e.fits:
                        fitted.append(opt)
                        cur = best.get(mesh)
                        if cur is None or (e.step_time_s, e.memory["total"]) < (cur.step_time_s, cur.memory["total"]):
                            best[mesh] = e
                            if len(best) >= top_k:
                                kth = sorted(x.step_time_s for x in best.values())[top_k - 1]
                else:
                    continue
                if p == 1:
                    break  # larger M is slower still (see module docstring)
    ranked = sorted(best.values(), key=lambda e: (e.step_time_s, e.memory["total"]))[:top_k]
    return SearchResult(ranked, evaluated, len(all_meshes), min_mem, time.perf_counter() - t0)
