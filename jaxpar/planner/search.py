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

Constraints (`Fixed`, from the same keys `jaxpar train` takes): fixed mesh axes, microbatches,
repeats / schedule, remat, op splitting and OSDP groups narrow the enumeration; the rest is
searched. With everything fixed the search estimates exactly one strategy (a what-if).
Pipeline settings (`pipeline.microbatches|repeats`, `pipeline.schedule=circular`) only exist with
a pipeline, so fixing one keeps pipe > 1 meshes only; `train.grad_accum` > 1 keeps pipe = 1 ones
(the model has no gradient accumulation around a pipeline). The pruning rules above hold on any
sub-space, so the result is still the exact optimum of what is left.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field

from jaxpar.parallel.layout import mesh_problem
from jaxpar.planner.cost import (
    GATHER_LIVE,
    GROUPS,
    JAXPAR_ORDER,
    REMAT,
    STATE_BYTES,
    Estimate,
    Strategy,
    Workload,
    estimate,
    group_elems,
)
from jaxpar.planner.devices import DeviceSpec
from jaxpar.planner.schedules import BOUNDED, REPEATED, searched

# circular repeats the search tries (R = 1 is gpipe). R = 3 matters where L/p is odd, e.g.
# Megatron's 530B row: 105 layers on 35 stages runs 3 one-layer chunks per device.
REPEATS = (2, 3, 4)


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
    one_f_one_b: bool = True  # pipeline.schedule=1f1b (R = 1, parallel/pipeline_1f1b.py); False: no zb either
    # costed schedules beyond gpipe / circular / 1f1b (planner/schedules.py NEW): only those jaxpar
    # train runs (config.SCHEDULES) by default; a test passes NEW to ask the cost model regardless
    new_schedules: tuple[str, ...] = searched()
    # tensor.sequence_parallel on meshes with tensor > 1 (jaxpar's engine; T divisible by t): tried
    # both ways. Megatron's engine (a what-if) takes `seq_parallel` below as given.
    sequence_parallel: bool = True
    # 1f1b's memory does not grow with M beyond its 2S-1 ring, and more microbatches shrink the
    # bubble, so pipelines want M in the hundreds (Megatron's 1T run: 512); was 64 before 1f1b
    max_microbatches: int = 1024
    # device placement the strategies are costed with (cost.Strategy.order); jaxpar.parallel.mesh builds
    # JAXPAR_ORDER only, so anything else is a what-if (benchmarks/published_configs.py)
    order: tuple[str, ...] = JAXPAR_ORDER
    # pipeline engine (cost.Strategy.engine); "megatron" is a what-if jaxpar cannot run
    engine: str = "jaxpar"
    seq_parallel: bool = False  # Megatron's sequence parallelism (cost.Strategy.seq_parallel, engine="megatron" only)
    gathers: tuple[str, ...] = ("step", "layer")  # pipeline.gather values tried (pipe > 1, fsdp > 1)


@dataclass(frozen=True)
class Fixed:
    """Values fixed by the user (None: searched). Names follow `jaxpar train`'s keys."""

    data: int | None = None  # mesh.data (-1 on the command line: searched)
    fsdp: int | None = None
    tensor: int | None = None
    pipe: int | None = None
    microbatches: int | None = None  # pipeline.microbatches (needs pipe > 1)
    grad_accum: int | None = None  # train.grad_accum (microbatches without a pipeline)
    repeats: int | None = None  # pipeline.repeats (needs pipe > 1)
    schedule: str | None = None  # pipeline.schedule: gpipe / 1f1b / zb (R = 1) | circular / interleaved (R > 1)
    remat: str | None = None  # train.remat
    vocab_chunks: int | None = None  # train.vocab_chunks
    mlp_chunks: int | None = None  # train.mlp_chunks
    replicate: tuple[str, ...] | None = None  # sharding.replicate (OSDP groups kept replicated)
    gather: str | None = None  # pipeline.gather (needs pipe > 1)
    sequence_parallel: bool | None = None  # tensor.sequence_parallel (true needs tensor > 1)

    @property
    def mesh(self) -> dict[str, int | None]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "pipe": self.pipe}

    @property
    def needs_pipeline(self) -> bool:
        return (self.microbatches is not None or self.repeats is not None
                or self.schedule not in (None, "gpipe") or self.gather == "layer")

    def restrict(self, space: SearchSpace) -> SearchSpace:
        """The search space with the fixed remat / splitting values as its only choices."""
        return dataclasses.replace(
            space,
            remat=(self.remat,) if self.remat else space.remat,
            vocab_chunks=(self.vocab_chunks,) if self.vocab_chunks else space.vocab_chunks,
            mlp_chunks=(self.mlp_chunks,) if self.mlp_chunks else space.mlp_chunks,
            osdp=space.osdp or self.replicate is not None)

    def items(self) -> dict[str, str]:
        """{key: value} of the fixed values, as `jaxpar train` spells them."""
        keys = {"data": "mesh.data", "fsdp": "mesh.fsdp", "tensor": "mesh.tensor", "pipe": "mesh.pipe",
                "microbatches": "pipeline.microbatches", "grad_accum": "train.grad_accum",
                "repeats": "pipeline.repeats", "schedule": "pipeline.schedule", "remat": "train.remat",
                "vocab_chunks": "train.vocab_chunks", "mlp_chunks": "train.mlp_chunks",
                "replicate": "sharding.replicate", "gather": "pipeline.gather",
                "sequence_parallel": "tensor.sequence_parallel"}
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[keys[f.name]] = ",".join(v) if isinstance(v, tuple) else str(v).lower() if isinstance(v, bool) \
                    else str(v)
        return out


TRAIN_SUPPORTED = SearchSpace(remat=("none", "full"), osdp=False, vocab_chunks=(1,), mlp_chunks=(1,))


@dataclass
class SearchResult:
    ranked: list[Estimate]  # best strategy per mesh, fastest first (fitting ones only)
    evaluated: int  # number of strategies estimated
    meshes: int  # meshes that passed divisibility
    min_memory: float  # smallest predicted per-device memory over every evaluated strategy
    seconds: float
    rejected: list[str] = field(default_factory=list)
    lightest: Estimate | None = None  # the evaluated strategy with the least memory (for "does not fit" errors)

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def divisors(n: int) -> list[int]:
    """Ascending divisors of n >= 1, in O(sqrt n): `jaxpar plan devices=` takes any count, and the
    O(n) scan took minutes at 10**8 and never ended at 10**14."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def meshes(w: Workload, n_devices: int, pipeline: bool = True,
           fixed: Fixed = Fixed()) -> list[tuple[int, int, int, int]]:
    """(data, fsdp, tensor, pipe) with product n_devices that sharding can realise
    (`jaxpar.parallel.layout.mesh_problem`, the predicate `jaxpar train` validates with: tensor divides
    n_head, n_embd, 4·n_embd and vocab; fsdp divides n_embd; pipe <= n_layer; data·fsdp divides
    the global batch). Axes fixed in `fixed` keep their value; fixed pipeline settings keep pipe > 1 only."""
    m = w.model
    out = []
    want = fixed.mesh
    ds = divisors(n_devices)  # every axis size divides n_devices: filter these, never scan again
    for t in ds:
        for p in (k for k in ds if (n_devices // t) % k == 0):
            if p > 1 and not pipeline:
                continue
            for f in (k for k in ds if (n_devices // (t * p)) % k == 0):
                d = n_devices // (t * p * f)
                if mesh_problem(m, w.batch_size, d, f, t, p):  # the rules jaxpar train applies
                    continue
                if any(want[a] is not None and want[a] != v for a, v in zip(("data", "fsdp", "tensor", "pipe"),
                                                                           (d, f, t, p))):
                    continue
                if (fixed.needs_pipeline and p == 1) or ((fixed.grad_accum or 1) > 1 and p > 1):
                    continue
                if fixed.sequence_parallel and (t == 1 or w.seq_len % t):
                    continue  # tensor.sequence_parallel=true splits T over tensor
                out.append((d, f, t, p))
    return out


def _lower_bound(w: Workload, mesh: tuple[int, int, int, int], dev: DeviceSpec, engine: str = "jaxpar",
                 seq_parallel: bool = False) -> float:
    """Compute-only step time with M=1, no remat and a perfect pipeline: never above the real estimate
    (of the same engine: Megatron's layer, a what-if, has its own activation count and traffic)."""
    d, f, t, p = mesh

    def bound(sp: bool) -> float:
        e = estimate(w, Strategy(d, f, t, 1, engine=engine, seq_parallel=sp), dev, detail=False)
        # Same replica batch without the pipeline, M=1 (largest, most efficient matmuls), no remat:
        # its compute and tensor all-reduces spread perfectly over p stages bound any real plan. So
        # does a GPU's HBM traffic (linear in rows, fewest passes without remat), but not the cpu
        # row's residual-stacking traffic, which remat=full shrinks.
        traffic = e.traffic_s if dev.mem_bandwidth == 0 else 0.0
        return (e.compute_s + e.comm_s["tensor"] + traffic) / p

    # jaxpar's engine searches tensor.sequence_parallel both ways: the lesser bound holds for both
    return min(bound(sp) for sp in ((False, True) if engine == "jaxpar" and t > 1 else (seq_parallel,)))


def _memory_floor(w: Workload, mesh: tuple[int, int, int, int], dev: DeviceSpec,
                  replicated: tuple[str, ...] = (), repeats: int = 0, engine: str = "jaxpar",
                  gather: str = "layer", schedule: str = "1f1b") -> float:
    """Bytes every strategy of this mesh (with these replicated groups, circular repeats and
    schedule; by default the most frugal: all groups sharded, no fsdp stage copies, 1f1b) needs at
    least: fp32 params, grads and Adam state with the layers split evenly over pipe; with a GPipe or
    circular pipeline also the embedded inputs and outputs of the replica's whole batch
    (2·T·b_rep·D·cb, whatever M is) and, with fsdp and pipeline.gather=step, the three fp32 copies
    of the gathered stage (cost.estimate's temporaries; gather=layer keeps one layer). 1f1b and
    Megatron's engine (a what-if) keep only microbatches in flight: no batch term."""
    d, f, t, p = mesh
    sharded = {g: f > 1 and g not in replicated for g in GROUPS}
    el = group_elems(w.model, t, f, sharded)
    floor = STATE_BYTES * (el["embed"] + w.model.n_layer / p * (el["attn"] + el["mlp"]))
    if p > 1:
        cb = w.cb if dev.native_bf16 else 4
        floor += 0.0 if engine == "megatron" or schedule in BOUNDED else 2 * w.seq_len * (w.batch_size / (d * f)) * w.model.n_embd * cb
        if repeats and f > 1:
            full = group_elems(w.model, t, 1, {g: False for g in GROUPS})
            per_layer = sum(full[g] for g in ("attn", "mlp") if sharded[g])
            # gather=step: 3 fp32 copies of the R·lmax >= L/p stage layers; layer: GATHER_LIVE of one
            floor += 12 * w.model.n_layer / p * per_layer if gather == "step" else 4 * GATHER_LIVE * per_layer
    return floor


def _schedules(w: Workload, p: int, space: SearchSpace, fixed: Fixed = Fixed()) -> list[tuple[int, str]]:
    """(repeats, pipeline.schedule) pairs to try on a mesh with `p` stages."""
    if p == 1:
        return [(1, "gpipe")]
    out = [(1, "gpipe")]
    bounded = space.one_f_one_b and space.engine != "megatron"  # Megatron's engine (a what-if) is 1F1B already
    if bounded:
        # zb only when asked for: in jaxpar's lock-step scan it is dominated by 1f1b (the same
        # ticks and ring, and B and W each re-run the stage: schedules.lockstep_runs)
        out += [(1, "1f1b")] + [(1, "zb")] * ("zb" in space.new_schedules and fixed.schedule == "zb")
    if space.repeats:
        # circular / interleaved: equal chunks, so p·R must divide n_layer; beyond R=4 the bubble
        # gain is small and every extra repeat adds a ppermute round per microbatch.
        reps = [r for r in REPEATS if w.model.n_layer % (p * r) == 0]
        out += [(r, "circular") for r in reps]
        if bounded and "interleaved" in space.new_schedules:
            out += [(r, "interleaved") for r in reps]
    if fixed.repeats is not None:
        ok = fixed.repeats == 1 or w.model.n_layer % (p * fixed.repeats) == 0
        out = [(r, sc) for r, sc in out if r == fixed.repeats] if ok else []
        if ok and fixed.repeats > 1 and not out:
            out = [(fixed.repeats, fixed.schedule if fixed.schedule in REPEATED else "circular")]
    if fixed.schedule is not None:
        out = [(r, sc) for r, sc in out if sc == fixed.schedule]
    return out


def _options(w: Workload, mesh, space: SearchSpace, fixed: Fixed = Fixed(), dev: DeviceSpec | None = None):
    """Yield (osdp replicated groups, R, pipeline.schedule, pipeline.gather, sequence_parallel, microbatch list,
    [(remat, vocab_chunks, mlp_chunks)]). gather=layer is tried only where it changes something
    (pipe > 1, fsdp > 1, not 1f1b, which gathers a stage once per step) and is not a dominance
    coordinate: its data-axis psum of 1/f shards can beat step's on few iterations."""
    d, f, _, p = mesh
    b_rep = w.batch_size // (d * f)
    ms = [k for k in divisors(b_rep) if k <= space.max_microbatches]
    m_fixed = fixed.microbatches if p > 1 else fixed.grad_accum
    if m_fixed is not None:
        ms = [m_fixed] if b_rep % m_fixed == 0 else []
    if fixed.replicate is not None:
        groups = [tuple(g for g in GROUPS if g in fixed.replicate)] if f > 1 else [()]
    elif f > 1 and space.osdp:
        # All-replicated over fsdp is plain data parallelism on d·f, already its own mesh: skip it.
        groups = [tuple(g for g, rep in zip(GROUPS, bits) if rep) for bits in itertools.product((0, 1), repeat=3)
                  if not all(bits)]
    else:
        groups = [()]
    vcs = [v for v in space.vocab_chunks if v == 1 or (w.seq_len * 1) % v == 0]
    # jaxpar.models.chunked.chunked_mlp: strided chunks of the 4D hidden dim, each split evenly over tensor
    mcs = [c for c in space.mlp_chunks if c == 1 or (4 * w.model.n_embd) % (c * mesh[2]) == 0]
    # pipeline.py rematerialises whole stages itself: inner remat policies change nothing there
    # (Megatron's engine, a what-if, applies them per layer)
    remats = range(len(space.remat)) if p == 1 or space.engine == "megatron" else [0]
    gathers = ["step"]
    if p > 1 and fixed.gather is not None:
        gathers = [fixed.gather]  # kept as the user spelt it (without fsdp both cost the same)
    elif p > 1 and f > 1 and space.engine != "megatron":
        gathers = list(space.gathers)
    if space.engine != "jaxpar":
        sps = [space.seq_parallel]
    elif fixed.sequence_parallel is not None:
        sps = [fixed.sequence_parallel]
    elif space.sequence_parallel and mesh[2] > 1 and w.seq_len % mesh[2] == 0:  # SP splits T over tensor
        # with a real reduce-scatter (GPUs) SP costs the all-reduce's time and saves memory: it
        # dominates; XLA:CPU adds all-gathers but stacks fewer residual bytes: both are estimated
        sps = [True] if dev is not None and dev.reduce_scatter and dev.mem_bandwidth == 0 else [False, True]
    else:
        sps = [False]
    for rep, (r, sched), g, sp in itertools.product(groups, _schedules(w, p, space, fixed), gathers, sps):
        if g == "layer" and (sched in BOUNDED or
                             (fixed.gather is None and all(x in rep for x in ("attn", "mlp")))):
            continue  # 1f1b gathers once per step; no block group sharded over fsdp: same as step
        # Megatron's interleaving runs whole rounds of S microbatches (M a multiple of S)
        mss = [m for m in ms if m % p == 0] if sched == "interleaved" else ms
        yield rep, r, sched, g, sp, mss, list(itertools.product(remats, vcs, mcs))


def _dominated(opt: tuple[int, int, int], fitted: list[tuple[int, int, int]]) -> bool:
    """(remat index, vocab_chunks, mlp_chunks) costs at least as much time as a fitting option
    that is <= in every coordinate (each step up only adds recompute), so it cannot win."""
    return any(all(a >= b for a, b in zip(opt, f)) for f in fitted)


def search(w: Workload, n_devices: int, dev: DeviceSpec, memory_limit: float,
           space: SearchSpace = SearchSpace(), top_k: int = 8, fixed: Fixed = Fixed(),
           floor_pruning: bool = True) -> SearchResult:
    """Fastest fitting strategy per mesh, fastest first (at most top_k meshes kept), among the
    strategies that keep every value in `fixed`. Meshes whose memory floor exceeds the limit are
    skipped; when nothing fits the search reruns without that pruning, so the smallest memory it
    reports is the exact minimum over every strategy."""
    t0 = time.perf_counter()
    space = fixed.restrict(space)
    all_meshes = meshes(w, n_devices, space.pipeline or fixed.needs_pipeline or (fixed.pipe or 1) > 1, fixed)
    def bound(mh):
        return _lower_bound(w, mh, dev, space.engine, space.seq_parallel)

    order = sorted(all_meshes, key=bound)
    best: dict[tuple, Estimate] = {}
    evaluated, lightest = 0, None

    kth = float("inf")  # k-th best step time among per-mesh bests so far
    # Remat and splitting only add time while elementwise traffic is not modelled; with it
    # (mem_bandwidth > 0, e.g. cpu) they can save more traffic than they cost, so every option
    # is estimated.
    monotone = dev.mem_bandwidth == 0

    floored = 0
    for mesh in order:
        if bound(mesh) > kth:
            break  # every later mesh has an even larger lower bound
        one_f = any(sc in BOUNDED for _, sc in _schedules(w, mesh[3], space, fixed))
        if floor_pruning and _memory_floor(w, mesh, dev, engine=space.engine,
                                           schedule="1f1b" if one_f else "gpipe") > memory_limit:
            floored += 1
            continue  # nothing on this mesh can fit
        d, f, t, p = mesh
        for rep, r, sched, gather, sp, ms, opts in _options(w, mesh, space, fixed, dev):
            if floor_pruning and p > 1 and _memory_floor(w, mesh, dev, rep, r, space.engine, gather,
                                                         sched) > memory_limit:
                floored += 1
                continue
            fitted_at: dict[int, list] = {}  # M -> options that fit at that M
            for M in ms:
                fitted = fitted_at.setdefault(M, [])
                for n_opt, opt in enumerate(opts):
                    # p == 1: a smaller M that fits with an option <= this one is faster.
                    if monotone and (_dominated(opt, fitted) or
                                     (p == 1 and any(_dominated(opt, v) for v in fitted_at.values()))):
                        continue
                    ri, vc, mc = opt
                    s = Strategy(d, f, t, p, M, r, space.remat[ri], rep, vc, mc, space.order, space.engine,
                                 gather, sched, sp)
                    e = estimate(w, s, dev, memory_limit, detail=False)
                    evaluated += 1
                    if lightest is None or e.memory["total"] < lightest.memory["total"]:
                        lightest = e
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
    if not best and floored:
        return search(w, n_devices, dev, memory_limit, space, top_k, fixed, floor_pruning=False)
    ranked = sorted(best.values(), key=lambda e: (e.step_time_s, e.memory["total"]))[:top_k]
    ranked = [estimate(w, e.strategy, dev, memory_limit) for e in ranked]  # with the per-collective table
    return SearchResult(ranked, evaluated, len(all_meshes), lightest.memory["total"] if lightest else float("inf"),
                        time.perf_counter() - t0, lightest=lightest)


def check_fixed(w: Workload, n_devices: int, fixed: Fixed) -> str | None:
    """Why no mesh keeps the fixed values: one line naming them, or None when some mesh may."""
    m = w.model
    given = {a: v for a, v in fixed.mesh.items() if v is not None}
    shown = " ".join(f"mesh.{a}={v}" for a, v in given.items())
    prod = 1
    for v in given.values():
        prod *= v
    if len(given) == 4 and prod != n_devices:
        return f"{shown} needs {prod} devices, but devices={n_devices}"
    if n_devices % prod:
        return f"{shown} ({prod} devices) does not divide devices={n_devices}"
    t, f, p, d = fixed.tensor, fixed.fsdp, fixed.pipe, fixed.data
    if t is not None and t > 1:
        for name, dim in (("model.n_head", m.n_head), ("model.n_embd", m.n_embd), ("model.vocab_size", m.vocab_size)):
            if dim % t:
                return f"mesh.tensor={t} does not divide {name}={dim} (tensor parallelism splits it)"
    if f is not None and f > 1 and m.n_embd % f:
        return f"mesh.fsdp={f} does not divide model.n_embd={m.n_embd} (ZeRO-3 shards the embed dim)"
    if p is not None and p > m.n_layer:
        return f"mesh.pipe={p} exceeds model.n_layer={m.n_layer} (every stage needs a layer)"
    if p == 1 and fixed.needs_pipeline:
        keys = {k: v for k, v in fixed.items().items() if k.startswith("pipeline.") and v not in ("gpipe", "step")}
        return f"{' '.join(f'{k}={v}' for k, v in keys.items())} needs a pipeline, but mesh.pipe=1"
    if (fixed.grad_accum or 1) > 1 and ((p or 1) > 1 or fixed.needs_pipeline):
        return (f"train.grad_accum={fixed.grad_accum} with a pipeline is not modelled: a pipeline accumulates "
                f"over pipeline.microbatches (fix that instead)")
    if fixed.schedule is not None and fixed.repeats is not None and (fixed.repeats > 1) != (fixed.schedule in REPEATED):
        return (f"pipeline.schedule={fixed.schedule} with pipeline.repeats={fixed.repeats}: gpipe and 1f1b run one "
                f"repeat, circular more than one")
    if fixed.schedule in BOUNDED and fixed.gather == "layer":
        return (f"pipeline.schedule={fixed.schedule} with pipeline.gather=layer: {fixed.schedule} gathers a stage's "
                "fsdp-sharded weights once per step (pipeline.gather=step)")
    if fixed.sequence_parallel and (t == 1 or (t and w.seq_len % t)):
        return (f"tensor.sequence_parallel=true needs mesh.tensor > 1 dividing train.seq_len={w.seq_len} "
                f"(got mesh.tensor={t})")
    if p is not None and fixed.repeats is not None and m.n_layer % (p * fixed.repeats):
        return (f"mesh.pipe={p} × pipeline.repeats={fixed.repeats} = {p * fixed.repeats} virtual stages do not "
                f"divide model.n_layer={m.n_layer}")
    if t is not None and fixed.mlp_chunks and (4 * m.n_embd) % (fixed.mlp_chunks * t):
        return (f"train.mlp_chunks={fixed.mlp_chunks} × mesh.tensor={t} does not divide 4*model.n_embd="
                f"{4 * m.n_embd} (each chunk is split over tensor)")
    if d is not None and f is not None:
        if w.batch_size % (d * f):
            return f"train.batch_size={w.batch_size} is not divisible by mesh.data×mesh.fsdp={d}×{f}"
        piped = (p or 1) > 1 or fixed.needs_pipeline
        mb = fixed.microbatches if piped else fixed.grad_accum
        key = "pipeline.microbatches" if piped else "train.grad_accum"
        if mb is not None and (w.batch_size // (d * f)) % mb:
            return (f"{key}={mb} does not divide the {w.batch_size // (d * f)} sequences per data replica "
                    f"(train.batch_size={w.batch_size} / mesh.data×mesh.fsdp={d * f})")
    return None
