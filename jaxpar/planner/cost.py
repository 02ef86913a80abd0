"""Analytic cost model of one jaxpar training step: memory, compute, communication.

Symbols: B global batch (sequences), T seq_len, D n_embd, N n_head, L n_layer, V vocab,
P n_positions; mesh d·f·t·p (data, fsdp, tensor, pipe); M microbatches (grad-accum steps
when p == 1, pipeline microbatches when p > 1); R circular repeats; b = B/(d·f·M) rows
per device per microbatch; cb = bytes of the compute dtype (2 bf16, 4 fp32).
Every formula below is per device. See README.md in this folder for the derivations.

Parameters (sharding.py rules): `embed` dims over fsdp, `heads`/`mlp`/`vocab` over tensor,
layers over pipe. Three OSDP groups can each be sharded (ZeRO-3 over fsdp) or replicated:
  embed: wte (V·D, /t /f), wpe (P·D, /f), ln_f (2D, /f)
  attn : per layer ln_1 (2D, /f), c_attn W (3D², /t /f) b (3D, /t), c_proj W (D², /t /f) b (D, /f)
  mlp  : per layer ln_2 (2D, /f), c_fc W (4D², /t /f) b (4D, /t), c_proj W (4D², /t /f) b (D, /f)
State bytes per element: fp32 master 4 + fp32 grad 4 + Adam m, v 8 = 16 (+4 for the grad
accumulator when M > 1).

Activations saved per layer per microbatch (the layer scan's residuals, tests/models/test_model_residuals.py;
no dropout masks; tensor.sequence_parallel splits the replicated part over t, activations.py):  T·b·D·cb·(4 + 12/t) + T·b·16  [ln_1 in/out, ln_2 in/out
replicated, their fp32 mean/rstd (T, b, 1) ×4; q, k, v, attn out, fc out, gelu out split over t]
+  N·T²·b/t·4  [fp32 softmax probs; + cb for their compute-dtype copy in bf16 on GPUs; × (nb+1)/(2nb) for
the nb causal query blocks of the CPU core, devices.py `causal_blocks`]. Flash attention replaces the T² term by the
fp32 log-sum-exp N·T·b/t·4. remat=selective drops the T² term (recomputed); remat=full keeps only
the block input T·b·D·cb; mlp_chunks > 1 drops the 8/t MLP part (recomputed chunk by chunk).
XLA:CPU's unrolled fp32 layer loop (devices.py `unrolled_fp32`, no pipeline, L <= 12, remat none: with
remat the model keeps the scan rolled) keeps more: activations.py `unrolled_layer_bytes` (the counts).
Pipelines (p > 1) rematerialise each pipeline iteration: saved = (R·M+S-1) stage inputs
T·b·D·cb, plus one iteration's activations while it is recomputed. schedule=1f1b (R = 1) keeps
min(M, 2S-1) stage inputs (+2 carried transfers), no embedded batch, one microbatch's logits on
the last stage, and one more fp32 stage copy (each tick's stacked weight grads); zb and interleaved
run that program shape with their own critical path and stash (planner/schedules.py).

Compute: FLOPs / (peak × eff), eff = efficiency × r/(r+knee_rows) × c/(c+knee_cols) with r = T·b
rows and c = D/t the narrowest matmul dim (small matmuls run below peak; knees 256, 128 on
GPUs). Forward FLOPs per layer per microbatch: 24·T·b·D²/t + 4·T²·b·D/t; head 2·T·b·D·V/t;
training = 3× forward, plus one forward per recompute.

Elementwise traffic (devices with mem_bandwidth > 0, i.e. cpu): layers_run · STACK_PASSES ·
saved bytes of residual stacking (+ chunked-MLP weight re-layouts) / mem_bandwidth, on the
critical path. Emulated devices sharing one host (shared_host) split its peak and bandwidth n ways.
GPUs (hbm_bandwidth > 0): memory-bound kernels stream each layer's live activation bytes through
HBM, layers_run · (5 + 2 per forward recompute) · live / hbm_bandwidth (+ the head's fp32 logits),
on the critical path; with the measured-MAMF efficiency this reproduces Megatron-LM's published
A100 table within 12% (benchmarks/published_configs.py).

Communication, alpha-beta per collective over n devices with payload X bytes:
  all-reduce (ring)        2(n-1)·α + 2(n-1)/n · X / bw
  all-gather / red-scatter  (n-1)·α +  (n-1)/n · X / bw
  ppermute                      α +           X / bw
bw is intra-node when the axis spans <= node_size devices (devices fill the mesh in the
strategy's `order`: jaxpar's is pipe, data, fsdp, tensor, tensor innermost), else inter-node.
Tensor and pipeline transfers sit on the critical path; DP/FSDP collectives are hidden behind compute by the device's `overlap` fraction.
Pipeline bubble: (S-1)/(R·M+S-1). 1f1b: M + 2S - 2 ticks, idle halves skipped, so (M+S-1)·(F+B)
on the critical path (GPipe's bubble) plus M heads on the last stage (head_rows_share = 1), and
2·(M+2S-2) ppermutes of one microbatch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from jaxpar.config import ModelConfig
from jaxpar.parallel.groups import GROUP_NAMES
from jaxpar.parallel.partition import partition_layers
from jaxpar.planner import schedules as sched
from jaxpar.planner.activations import (  # noqa: F401  (re-exported: per-layer activation bytes)
    DROPOUT_MASK_BYTES,
    LN_STATS_BYTES,
    MLP_UNITS,
    QKVO_UNITS,
    REP_UNITS,
    causal_blocks,
    layer_activation_bytes,
    layers_unrolled,
    unrolled_gathered_bytes,
    unrolled_layer_bytes,
    unrolled_peak_bytes,
)
from jaxpar.planner.devices import DeviceSpec

GROUPS = GROUP_NAMES  # the OSDP groups (jaxpar.parallel.groups)
REMAT = ("none", "selective", "full")
STATE_BYTES = 16  # fp32 master 4 + grad 4 + Adam m 4 + v 4
# Device placements, mesh axes outermost first. jaxpar.parallel.mesh builds Megatron-LM's rank layout
# (mesh.PLACEMENT: tensor innermost, pipeline stages strided by n/p); until 2026-11-23 it built
# PIPE_INNERMOST_ORDER, which the "before" columns of benchmarks/published_configs.py still cost.
MEGATRON_ORDER = ("pipe", "data", "fsdp", "tensor")
JAXPAR_ORDER = MEGATRON_ORDER  # == jaxpar.parallel.mesh.PLACEMENT (tests/planner/test_planner_cost.py)
PIPE_INNERMOST_ORDER = ("data", "fsdp", "tensor", "pipe")
ONE_F_CARRIED = 2  # (b, T, D) transfers the 1f1b scan carries besides its ring (see estimate)
GATHER_LIVE = 3  # pipeline.gather=layer: fp32 copies of one layer's gathered weights live at once
STACK_PASSES = 4  # zero-fill, copy, slice write, slice read of each stacked residual (see estimate)


@dataclass(frozen=True)
class Workload:
    """What to train: model shape, global batch, sequence length, precision."""

    model: ModelConfig
    batch_size: int
    seq_len: int
    precision: str = "bf16"
    attention: str = "naive"  # naive (jaxpar's GPT-2: full T×T scores) | flash

    @property
    def cb(self) -> int:
        return 2 if self.precision == "bf16" else 4


@dataclass(frozen=True)
class Strategy:
    """One point of the search space."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1
    microbatches: int = 1  # grad accumulation (pipe == 1) or pipeline microbatches
    repeats: int = 1  # circular schedule: chunks per device
    remat: str = "none"  # none | selective | full
    replicated: tuple[str, ...] = ()  # OSDP groups kept replicated over fsdp (others ZeRO-3)
    vocab_chunks: int = 1  # chunked logits + cross-entropy (token chunks, recomputed in backward)
    mlp_chunks: int = 1  # chunked MLP (sequence chunks, fc/gelu recomputed in backward)
    # Device placement: mesh axes from outermost (slowest-varying device index) to innermost.
    # JAXPAR_ORDER is what jaxpar.parallel.mesh builds: Megatron-LM's rank layout (tensor groups are
    # consecutive ranks, pipeline groups strided by n/p: megatron/core/parallel_state.py).
    order: tuple[str, ...] = JAXPAR_ORDER
    # Pipeline engine. "jaxpar" is what parallel/pipeline.py runs (GPipe-order scan, every stage
    # re-run in backward whatever `remat` says, embedding / head outside the stages with the
    # embedded inputs gathered and the outputs broadcast over pipe). "megatron" costs Megatron-LM's
    # engine for comparisons only (benchmarks/published_configs.py; jaxpar cannot run it): 1F1B
    # with `remat` applied per layer (Korthikanti et al. 2022 §4.2.3: the first stage holds p
    # microbatches in flight, ×(1 + (p-1)/(p·R)) interleaved), embedding on stage 0 and head on
    # stage p-1 (no pipe gather/broadcast), and the scatter/gather p2p of Narayanan et al. 2021
    # §4.1 (each tensor rank sends 1/t of the stage output, then an all-gather over tensor).
    # Also Megatron's layer, with or without a pipeline: recompute re-runs both tensor all-reduces,
    # Korthikanti et al.'s activation count (layer_activation_bytes(megatron=True)) and the scores /
    # RowParallelLinear outputs it writes without keeping in the GPU traffic term.
    engine: str = "jaxpar"
    # pipeline.gather: when a pipeline all-gathers its fsdp-sharded block weights. "step": the
    # whole stage once per step, kept for the loop and backward (3 fp32 stage copies at the
    # peak); "layer": each layer every iteration, forward, stage re-run and a reduce-scatter of
    # its grads in backward (3·N·lmax layer gathers/scatters instead of 2·R·lmax, one layer live)
    gather: str = "step"
    # pipeline.schedule (pipe > 1): "gpipe" / "circular" are parallel/pipeline.py's scan (R = 1 /
    # R > 1; normalised from `repeats`, so Strategy(repeats=2) is circular); "1f1b" is
    # parallel/pipeline_1f1b.py (R = 1 only): each stage interleaves one microbatch's backward
    # with later forwards, keeping at most 2S-1 stage inputs instead of every microbatch's.
    # "interleaved" (R >= 2 virtual stages per device) and "zb" (ZB-H1, R = 1): planner/schedules.py.
    schedule: str = "gpipe"
    # tensor.sequence_parallel (Korthikanti et al. 2022 §4.2.2; t > 1): the LayerNorm / residual
    # regions run on T/t sequence shards, so their activations (and traffic) are split over tensor
    # too, and each tensor all-reduce becomes a reduce-scatter + all-gather of equal total bytes
    # (XLA:CPU keeps the all-reduce, slices, and adds the all-gather: devices without reduce_scatter).
    seq_parallel: bool = False

    def __post_init__(self):
        if self.schedule in sched.BOUNDED:
            one = self.schedule != "interleaved"
            if (self.repeats != 1 if one else self.repeats < 2) or self.gather != "step":
                raise ValueError(f"schedule {self.schedule} runs {'one repeat' if one else 'R >= 2 chunks'} and "
                                 f"gathers a stage's weights once per step, got repeats={self.repeats}, "
                                 f"gather={self.gather!r}")
            if self.schedule == "interleaved" and self.microbatches % self.pipe:  # Megatron's groups of S
                raise ValueError(f"schedule interleaved needs microbatches={self.microbatches} divisible by "
                                 f"pipe={self.pipe}")
        elif self.schedule in ("gpipe", "circular"):
            object.__setattr__(self, "schedule", "circular" if self.repeats > 1 else "gpipe")
        else:
            raise ValueError(f"unknown schedule {self.schedule!r}")

    @property
    def mesh(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "pipe": self.pipe}

    @property
    def n_devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.pipe


@dataclass
class Estimate:
    """Predicted per-device figures for one (workload, strategy, device)."""

    strategy: Strategy
    memory: dict[str, float]  # params, grads, optimizer, activations, temporaries, total (bytes)
    step_time_s: float
    compute_s: float
    comm_s: dict[str, float]  # tensor, fsdp, data, pipe (exposed seconds)
    comm_bytes: dict[str, float]  # per collective kind: all-reduce, all-gather, reduce-scatter, ppermute
    bubble: float
    mfu: float
    tokens_per_s: float
    layers_per_stage: tuple[int, ...] = ()
    fits: bool = True
    notes: list[str] = field(default_factory=list)
    traffic_s: float = 0.0  # elementwise memory traffic time (in step_time_s; 0 where not modelled)
    # per (axis, collective kind) -> [seconds, bytes sent per device]; seconds before overlap
    collectives: dict[str, list[float]] = field(default_factory=dict)

    @property
    def memory_per_device_bytes(self) -> float:
        return self.memory["total"]


@functools.lru_cache(maxsize=4096)
def _group_elems(m: ModelConfig, t: int, fe: int, fa: int, fm: int) -> dict[str, float]:
    D, V, P = m.n_embd, m.vocab_size, m.n_positions
    return {
        "embed": V * D / (t * fe) + P * D / fe + 2 * D / fe,
        "attn": 2 * D / fa + 3 * D * D / (t * fa) + 3 * D / t + D * D / (t * fa) + D / fa,
        "mlp": 2 * D / fm + 4 * D * D / (t * fm) + 4 * D / t + 4 * D * D / (t * fm) + D / fm,
    }


def group_elems(m: ModelConfig, t: int, f: int, sharded: dict[str, bool]) -> dict[str, float]:
    """Parameter elements per device of each OSDP group; attn/mlp are per layer."""
    return _group_elems(m, t, *(f if sharded[g] else 1 for g in GROUPS))


def _full_elems(m: ModelConfig, t: int) -> dict[str, float]:
    return group_elems(m, t, 1, {g: False for g in GROUPS})


# ----------------------------------------------------------------------------- collectives


def all_reduce(n: int, x: float, alpha: float, bw: float) -> tuple[float, float]:
    """Ring all-reduce of x bytes over n devices -> (seconds, bytes sent per device)."""
    if n <= 1:
        return 0.0, 0.0
    b = 2 * (n - 1) / n * x
    return 2 * (n - 1) * alpha + b / bw, b


def all_gather(n: int, x: float, alpha: float, bw: float) -> tuple[float, float]:
    """Ring all-gather (or reduce-scatter) whose full result is x bytes."""
    if n <= 1:
        return 0.0, 0.0
    b = (n - 1) / n * x
    return (n - 1) * alpha + b / bw, b


def ppermute(x: float, alpha: float, bw: float) -> tuple[float, float]:
    return alpha + x / bw, x


def axis_bandwidths(dev: DeviceSpec, s: Strategy) -> dict[str, float]:
    """Intra-node bandwidth for an axis whose devices sit in one node, else inter-node.
    Devices fill the mesh in `s.order` (outermost first; jaxpar: pipe, data, fsdp, tensor), so
    the span of an axis is its size times the sizes of the axes inside it: in the old
    pipe-innermost order a tensor axis of 8 inside a pipe axis of 8 spanned 64 devices (8 nodes)."""
    spans, inner = {}, 1
    for a in reversed(s.order):
        inner *= s.mesh[a]
        spans[a] = inner
    return {a: dev.bandwidth if n <= dev.node_size else dev.inter_bandwidth for a, n in spans.items()}


# ----------------------------------------------------------------------------- the estimate


@functools.lru_cache(maxsize=4096)
def _pipeline_split(n_layer: int, V: int) -> tuple[int, ...]:
    # pipeline.py runs embedding and head outside the stages, so stage costs are the layers only
    return partition_layers([1.0] * n_layer, V)


@functools.lru_cache(maxsize=256)
def _model_flops_per_token(m: ModelConfig, T: int) -> float:
    return m.flops_per_token(T)


def estimate(w: Workload, s: Strategy, dev: DeviceSpec, memory_limit: float | None = None,
             detail: bool = True) -> Estimate:
    """Predict memory, step time and MFU of strategy `s` (see the module docstring).
    detail=False skips the per-collective table (`Estimate.collectives`): the search's hot path."""
    m = w.model
    L, D, V, T = m.n_layer, m.n_embd, m.vocab_size, w.seq_len
    # XLA:CPU has no bf16 matmuls: it upcasts, so activations and their collectives are fp32.
    cb = w.cb if dev.native_bf16 else 4
    d, f, t, S, M, R = s.data, s.fsdp, s.tensor, s.pipe, s.microbatches, s.repeats
    # pipeline.py always rematerialises whole stages and runs the layers inside without remat,
    # so an inner policy has no effect there.
    mg = S > 1 and s.engine == "megatron"  # what-if: Megatron-LM's pipeline engine (Strategy.engine)
    mgl = s.engine == "megatron"  # ... and its layer, with or without a pipeline (dropout masks, 16-bit probs)
    sp = s.seq_parallel and t > 1  # sequence parallelism (Strategy.seq_parallel)
    # parallel/pipeline_1f1b.py's program shape: 1f1b, and zb / interleaved (planner/schedules.py)
    one_f = S > 1 and s.schedule in sched.BOUNDED and not mg
    remat = "none" if S > 1 and not mg else s.remat
    alpha = dev.latency
    sharded = {g: (f > 1 and g not in s.replicated) for g in GROUPS}
    el = group_elems(m, t, f, sharded)
    full = _full_elems(m, t)  # per-device elements before fsdp sharding
    full_layer = full["attn"] + full["mlp"]
    b_rep = w.batch_size / (d * f)  # rows per data replica
    b = b_rep / M  # rows per device per microbatch

    # --- FLOPs (per device, per microbatch): forward of one layer and of the head
    fl_layer = 24 * T * b * D * D / t + 4 * T * T * b * D / t
    fl_head = 2 * T * b * D * V / t
    extra_fwd = (1.0 if remat == "full" else 0.0) + (1.0 if S > 1 and not mg else 0.0)
    fl_layer_train = fl_layer * (3 + extra_fwd)
    if remat == "selective":
        fl_layer_train += 4 * T * T * b * D / t  # recompute scores + probs·V
    if s.mlp_chunks > 1:
        fl_layer_train += 8 * T * b * D * D / t  # recompute c_fc
    fl_head_train = fl_head * (3 + (1 if s.vocab_chunks > 1 else 0))
    peak = dev.peak_flops if w.precision == "bf16" else dev.peak_flops_fp32
    rows, cols = T * b, D / t
    eff = dev.efficiency * rows / (rows + dev.knee_rows) * cols / (cols + dev.knee_cols)
    # Emulated devices (shared_host) split one host's FLOP/s and memory bandwidth between them.
    share = s.n_devices if dev.shared_host else 1
    sec = share / (peak * eff)

    # The layer scan saves its residuals in the compute dtype even on XLA:CPU (bf16 there too:
    # tests/models/test_model_residuals.py), and the bf16 copy of the probs only on GPUs (see above).
    # The saved probs of the CPU core's causal query blocks: memory and the residual-stacking traffic
    # below. The FLOPs and the 5-pass traffic still count the full T x T (the cpu row was fitted so).
    nb = causal_blocks(T) if dev.causal_blocks and w.attention != "flash" and not mgl else 1
    saved, live = layer_activation_bytes(w, b, t, remat, s.mlp_chunks, w.cb, dev.native_bf16 and w.cb < 4, mgl, sp,
                                         blocks=nb)
    unit = T * b * D * cb  # one (b, T, D) activation in the compute dtype
    # XLA:CPU unrolls the layers (gpt2.scan_unroll) but not in pipeline stages or jaxpar.parallel.fsdp's
    # map; GPUs too (unmeasured: only the `cpu` row sets unrolled_fp32); bf16 is measured lower: left out
    fsdp_map = f > 1 and S == 1 and s.remat != "selective" and s.mlp_chunks == 1  # jaxpar.parallel.fsdp.applies
    unrolled = (dev.unrolled_fp32 and w.precision == "fp32" and S == 1 and not mgl and not fsdp_map
                and layers_unrolled(L, s.remat))
    if S > 1:
        # pipeline.py: S·R virtual stages, padded to the largest (lmax layers); one scan of
        # N = (R-1)·max(M, S) + M + S - 1 iterations, each stage recomputed in backward.
        lps = _pipeline_split(L, S * R)
        lmax = max(lps)
        if one_f:
            # pipeline_1f1b.py: one scan of M + 2S - 2 ticks (a ppermute each way every tick);
            # stage s forwards microbatch t - s and backwards t - (2S-2-s) (stage re-run + vjp),
            # idle halves skipped with lax.cond. Ticks run in lock step, so the critical path is
            # S-1 forward-only ticks, M forward+backward ticks (the last stage also runs head and
            # loss), S-1 backward-only ticks: (M + S - 1)·(F + B), as GPipe; a device runs M of each.
            # zb and interleaved: the same scan shape, their own critical path (planner/schedules.py)
            iters, crit = sched.ticks(S, M, R, s.schedule), sched.critical_runs(S, M, R, s.schedule)
        else:
            iters = crit = (R - 1) * max(M, S) + M + S - 1
        uniform = len(set(lps)) == 1
        layers_state = L / S if uniform else L  # non-uniform: stored `layers` dim replicated over pipe
        layers_run = crit * lmax
        layers_sent = R * M * lmax if one_f else layers_run  # layer runs per device (its tensor collectives)
        head_rows_share = 1.0 / S  # embedding and head run outside, batch split over pipe too
        if mg or one_f:  # the head runs on the last stage, per microbatch: that stage is the slowest
            head_rows_share = 1.0
        compute = (layers_run * fl_layer_train + M * fl_head_train * head_rows_share) * sec
        bubble = sched.bubble(S, M, R, "circular" if mg else s.schedule)
        if one_f:
            # stage 0 holds microbatch j's input from tick j to its backward at tick j + 2S - 2: a
            # ring of min(M, 2S-1) (b, T, D) slots (the same shape on every stage, SPMD); plus the
            # two transfers the scan carries (activation forward, gradient back) and one stage's
            # residuals while it is re-run. No embedded batch, no park buffer.
            # (the ring and the transfers are in the compute dtype even where XLA:CPU upcasts the math)
            # zb keeps 1f1b's ring; interleaved min(R·M, R·S + S - 1) chunk inputs (planner/schedules.py)
            acts = (sched.stash_slots(S, M, R, s.schedule) + ONE_F_CARRIED) * T * b * D * w.cb + lmax * saved
        elif mg:  # 1F1B: min(M, S) microbatches in flight on the first stage, each with its R·lmax layers
            inflight = min(M, S) * (1 + (S - 1) / (S * R) if R > 1 else 1)
            acts = inflight * R * lmax * saved + (live if remat == "full" else 0.0)
        else:
            # the (M, mb, T, D) park buffer exists only for R > 1 (pipeline.py: use_buf = R > 1 and M > S)
            acts = (iters + (M if R > 1 and M > S else 0)) * unit + lmax * saved
            acts += 2 * M * unit  # embedded inputs gathered over pipe + broadcast outputs (b_rep rows)
        passes = 1  # fsdp gathers / grad reductions happen once per step, outside the scan
    else:
        lps, layers_state, iters, bubble = (), L, M, 0.0
        layers_run, head_rows_share = M * L, 1.0
        layers_sent = layers_run
        compute = M * (L * fl_layer_train + fl_head_train) * sec
        if unrolled:  # every layer's kept values, no separately recomputed layer (see unrolled_layer_bytes)
            acts = L * (unrolled_layer_bytes(w, b, t, s.mlp_chunks, nb, sp)
                        + unrolled_gathered_bytes(full, el, sharded))
        else:
            acts = L * saved + (live if remat == "full" else 0.0)
        passes = M  # train.py's accumulation scan: each microbatch gathers and reduces
    if remat == "none" and w.precision == "bf16":
        acts += layers_state * (el["attn"] + el["mlp"] - 13 * D / t) * w.cb  # saved compute-dtype weight casts

    if s.mlp_chunks > 1 and S == 1:
        # chunked_mlp re-lays W_fc, b_fc, W_proj out as (k, ·, 4D/k) strided chunks; the scan saves
        # those fp32 copies for backward: one per layer (jax.ad_checkpoint.print_saved_residuals
        # lists exactly these three transposes besides x; row 18 measured temp fits this).
        acts += layers_state * 4 * el["mlp"]
    # --- memory (bytes)
    n_el = el["embed"] + layers_state * (el["attn"] + el["mlp"])
    # train.py's accumulation loop keeps a second fp32 grad tree; a pipeline accumulates inside its scan.
    mem = {"params": 4 * n_el, "grads": 4 * n_el * (2 if M > 1 and S == 1 else 1), "optimizer": 8 * n_el}
    head = 2 * T * b * V * 4 / t / s.vocab_chunks * (M * head_rows_share if S > 1 and not (mg or one_f) else 1)
    # logits/log-probs/grad + one layer's activation grads (a pipeline's stage re-run is in `acts`)
    tmp = head + live * (1 if remat != "full" and S == 1 else 0)
    if unrolled:  # the peak is the head's backward: ln_f's values, no live layer (unrolled_peak_bytes)
        tmp = head + unrolled_peak_bytes(w, b, t, nb)
    per_layer_gather = S > 1 and s.gather == "layer" and not mg
    if f > 1 and S > 1 and not per_layer_gather:
        # pipeline.gather=step gathers a stage's weights once per step; grads stay unsharded until the end.
        # Seen in the buffer assignment (row 10, 1x4x1x2): three fp32 stage-sized copies live at the
        # peak, e.g. f32[1, lmax, D, 3, N, D/N] for c_attn: the all-gather output (gathered dim
        # major), its wrapped_copy to the scan's row-major layout, and the unsharded grad carried
        # by the scan: 3 · 4 · R · lmax · (sharded block params per layer).
        tmp += 12 * R * lmax * sum(full[g] for g in ("attn", "mlp") if sharded[g])
    elif f > 1 and per_layer_gather:
        # pipeline.gather=layer: GATHER_LIVE fp32 copies of one layer's gathered weights (gathered,
        # re-laid out, its unsharded grad before the reduce-scatter), plus the stage re-run's saved
        # compute-dtype copies of all lmax layers' weights (the backward of each layer's matmuls).
        tmp += (GATHER_LIVE * 4 + lmax * cb) * sum(full[g] for g in ("attn", "mlp") if sharded[g])
    if S > 1 and R > 1 and not (mg or one_f):
        tmp += 4 * (L / S) * full_layer  # circular re-layout moves a copy of the stage's block params
    if one_f and lmax > 1:
        # 1f1b: each tick's vjp of the stage stacks the lmax layers' fp32 weight grads in a fresh
        # (lmax, ...) buffer (the layer scan's backward), added to the scan-carried accumulator
        # afterwards: one more stage copy (seen in the buffer assignment: a zero-broadcast +
        # dynamic-update-slice f32[lmax, ...] beside the accumulator's add; XLA inlines a
        # one-layer stage's scan, whose grads go straight into the accumulator)
        tmp += 4 * lmax * full_layer
    if s.mlp_chunks > 1 and S == 1 and not unrolled:
        # only one chunk of the MLP hidden activations is live at once; a pipeline's stage re-run
        # is in `acts`, whose `saved` already drops the MLP units, so there is nothing to take off
        tmp -= T * b * D * cb * MLP_UNITS / t * (1 - 1 / s.mlp_chunks)
    mem["activations"] = acts
    mem["temporaries"] = tmp
    mem["total"] = sum(mem.values())

    # --- communication: seconds on the critical path and bytes per collective kind
    cbytes = {"all-reduce": 0.0, "all-gather": 0.0, "reduce-scatter": 0.0, "ppermute": 0.0}
    comm = {"tensor": 0.0, "fsdp": 0.0, "data": 0.0, "pipe": 0.0}

    table: dict[str, list[float]] = {}

    def add(kind: str, axis: str, res: tuple[float, float], times: float = 1.0, sent: float | None = None) -> None:
        """`times` on the critical path; `sent` (default `times`) run by the busiest device."""
        sent = times if sent is None else sent
        comm[axis] += res[0] * times
        cbytes[kind] += res[1] * sent
        if detail and res[1] > 0:
            cell = table.setdefault(f"{axis} {kind}", [0.0, 0.0])
            cell[0] += res[0] * times
            cell[1] += res[1] * sent

    bws = axis_bandwidths(dev, s)
    if t > 1:
        # Megatron: 2 fwd + 2 bwd all-reduces per layer; a re-forward adds one (measured in the HLO:
        # XLA reuses the other from the saved block input's path).
        # 1f1b: the forward and the re-run sit in different ticks, so the re-run repeats both (6).
        # Megatron-LM (what-if): its recompute (mpu/random.py CheckpointFunction.backward) re-runs
        # the layer's forward, both RowParallelLinear all-reduces included (6 under full recompute).
        n_ar = 4 + extra_fwd * (2 if one_f or mgl else 1)
        # chunked_mlp sums the chunks' c_proj partial products in its scan carry, so XLA all-reduces
        # each chunk's (b, T, D) output over tensor (forward) and each chunk's input grad (backward):
        # 2·mlp_chunks MLP all-reduces per layer instead of 2 (seen in the HLO, row 19: trip count 16
        # = L·k in forward and backward).
        n_ar += 2 * (s.mlp_chunks - 1)
        if sp and dev.reduce_scatter:
            # sequence parallelism: each all-reduce becomes a reduce-scatter + an all-gather of the
            # same (b, T, D) tensor, equal total bytes (Korthikanti et al. 2022 §4.2.2); the head's too
            layer_cost = all_gather(t, unit, alpha, bws["tensor"])
            head_cost = all_gather(t, unit * head_rows_share, alpha, bws["tensor"])
            for kind in ("reduce-scatter", "all-gather"):
                add(kind, "tensor", layer_cost, layers_run * n_ar, layers_sent * n_ar)
                add(kind, "tensor", head_cost, 2 * M)
        else:
            add("all-reduce", "tensor", all_reduce(t, unit, alpha, bws["tensor"]), layers_run * n_ar, layers_sent * n_ar)
            add("all-reduce", "tensor", all_reduce(t, unit * head_rows_share, alpha, bws["tensor"]), 2 * M)
            if sp:
                # XLA:CPU has no reduce-scatter: the row-parallel output stays an all-reduce, sliced to
                # its T/t shard, and the column-parallel input is all-gathered back (seen in the HLO:
                # tensor=4, the all-reduce count unchanged, about as many all-gathers)
                add("all-gather", "tensor", all_gather(t, unit, alpha, bws["tensor"]), layers_run * n_ar,
                    layers_sent * n_ar)
                add("all-gather", "tensor", all_gather(t, unit * head_rows_share, alpha, bws["tensor"]), 2 * M)
    vc = s.vocab_chunks
    wte = V * D / t  # tied wte elements per tensor shard
    # chunked_cross_entropy closes over wte inside its lax.scan, so XLA reduces the logits part of
    # the wte gradient inside the scan: once per token chunk (vc times), not once after it (seen in
    # the HLO: an all-reduce of the (V/t, D) grad with trip count vc per pass, rows 17, 19, 20).
    # Without a pipeline ZeRO-3 runs in a shard_map with explicit gathers and reduce-scatters
    # (jaxpar.parallel.fsdp), on every backend. A pipeline's embedding is auto-sharded: there
    # (XLA:CPU has no reduce-scatter) a ZeRO-3 group gathers its weights over fsdp only and
    # reduces its grads with an all-reduce of the full grads over fsdp, then one of the 1/f
    # shard over data·pipe; the pipeline's own shard_map collectives lower to real
    # reduce-scatters even on CPU (all seen in the HLO).
    # (jaxpar.parallel.fsdp.applies: not with remat=selective or mlp_chunks > 1, which stay auto)
    zero3_map = S == 1 and s.remat != "selective" and s.mlp_chunks == 1
    # (1f1b runs the embedding and head inside its shard_map: explicit gathers there too)
    auto = {g: not dev.reduce_scatter and not zero3_map and (S == 1 or (g == "embed" and not one_f)) for g in GROUPS}
    rep = {g: d * (S if g == "embed" else 1) for g in GROUPS}  # replicas beside fsdp
    if f > 1:
        for g in GROUPS:
            if not sharded[g]:
                continue
            layers = 1 if g == "embed" else (R * lmax if S > 1 else L)
            n = full[g] * layers
            if auto[g] and g == "embed":
                # wte gathers (seen in the HLO): forward logits, plus backward logits when d > 1
                # (single step, no pipeline); a grad-accumulation loop hoists the loop-invariant
                # gather (once per step); with vocab_chunks the chunk recompute gathers per chunk.
                g_wte = 1 + vc * passes if vc > 1 else (2 if S == 1 and M == 1 and d > 1 else 1)
                add("all-gather", "fsdp", all_gather(f, 4 * wte, alpha, bws["fsdp"]), g_wte)
                add("all-gather", "fsdp", all_gather(f, 4 * (n - wte), alpha, bws["fsdp"]))  # wpe, ln_f
                if t > 1 and S == 1 and d > 1:
                    # lookup from a wte split over tensor (vocab) and fsdp (embed): XLA gathers the
                    # table's vocab dim over tensor, the looked-up (B, T, D/f) rows over data·fsdp,
                    # then their embed dim over fsdp (seen in the HLO, rows 3 and 16; with d = 1, row 13, XLA
                    # uses all-to-alls instead, not modelled: < 3% of that row)
                    add("all-gather", "tensor", all_gather(t, 4 * V * D / f, alpha, bws["tensor"]), passes)
                    add("all-gather", "fsdp", all_gather(d * f, w.batch_size / passes * T * D / f * cb, alpha,
                                                         bws["data"]), passes)
                    add("all-gather", "fsdp", all_gather(f, w.batch_size / passes * T * D * cb, alpha, bws["fsdp"]),
                        passes)
                r = rep[g]
                if r > 1:
                    # lookup backward: the (B/M, T, D) output grads are gathered over every batch
                    # shard (f·r devices) before the scatter-add (seen in the HLO)
                    x = w.batch_size / passes * T * D * cb
                    add("all-gather", "fsdp", all_gather(f * r, x, alpha, bws["data"]), passes)
                # logits part: full over fsdp + shard over the replicas, per chunk; lookup part:
                # shard over the replicas; wpe + ln_f: over all f·r devices
                add("all-reduce", "fsdp", all_reduce(f, 4 * wte, alpha, bws["fsdp"]), vc * passes)
                add("all-reduce", "data", all_reduce(r, 4 * wte / f, alpha, bws["data"]), (vc + 1) * passes)
                add("all-reduce", "data", all_reduce(f * r, 4 * (n - wte), alpha, bws["data"]), passes)
            elif auto[g]:
                add("all-gather", "fsdp", all_gather(f, 4 * n, alpha, bws["fsdp"]), 2 * passes)
                add("all-reduce", "fsdp", all_reduce(f, 4 * n, alpha, bws["fsdp"]), passes)
                add("all-reduce", "data", all_reduce(rep[g], 4 * n / f, alpha, bws["data"]), passes)
            elif per_layer_gather and g != "embed":
                # pipeline.gather=layer: every iteration gathers its lmax layers in forward and again
                # in the stage's backward re-run, and reduce-scatters their grads (N iterations,
                # bubble iterations included: the scan runs them all)
                n = full[g] * lmax
                add("all-gather", "fsdp", all_gather(f, 4 * n, alpha, bws["fsdp"]), 2 * iters)
                add("reduce-scatter", "fsdp", all_gather(f, 4 * n, alpha, bws["fsdp"]), iters)
            else:
                # ZeRO-3: gather weights for forward (+ again for backward, blocks only, no pipeline),
                # reduce-scatter grads; per microbatch without a pipeline, once per step with one.
                # Without a pipeline the vocab chunks' wte grads sum locally before the one
                # reduce-scatter (jaxpar.parallel.fsdp); XLA's auto step scatters per chunk.
                gathers = 1 if (g == "embed" and (S == 1 or one_f)) or (g != "embed" and S > 1) else 2
                add("all-gather", "fsdp", all_gather(f, 4 * n, alpha, bws["fsdp"]), gathers * passes)
                n += wte * (vc - 1) if g == "embed" and not (zero3_map or one_f) else 0.0
                add("reduce-scatter", "fsdp", all_gather(f, 4 * n, alpha, bws["fsdp"]), passes)
    # data-parallel gradient reduction: sharded groups over data, replicated ones over data·fsdp;
    # the embedding's rows are also split over pipe; the step sums the tied wte's lookup and head
    # grads (every chunk's too) before one reduction: per row shard (jaxpar.parallel.tied: data
    # parallelism, pipelines without fsdp) or per device (jaxpar.parallel.fsdp); only a pipeline
    # with fsdp reduces it once per use (seen in the HLO).
    tied_once = zero3_map or f == 1 or one_f
    for g in GROUPS:
        if auto[g] and sharded[g]:
            continue  # reduced above
        n = full[g] if g == "embed" else full[g] * (R * lmax if S > 1 else L)
        if g == "embed" and not tied_once:
            n += wte * (vc if not sharded[g] else vc - 1)
        n_red = (d if sharded[g] else d * f) * (S if g == "embed" else 1)
        # pipeline.gather=step psums the gathered (unsharded) stage grads over data, then
        # reduce-scatters; gather=layer and 1f1b (reduce-scatter first) psum the 1/f shards
        shard = f if sharded[g] and not (S > 1 and g != "embed" and not (per_layer_gather or one_f)) else 1
        bw = bws["data"] if d > 1 else bws["fsdp"] if not sharded[g] else bws["pipe"]
        add("all-reduce", "data", all_reduce(n_red, 4 * n / shard, alpha, bw), passes)
    if S > 1:
        bw = bws["pipe"]
        if mg:  # scatter/gather p2p: 1/t of the output per tensor rank, re-assembled over tensor
            add("ppermute", "pipe", ppermute(unit / t, alpha, bw), 2 * iters)
            if not sp:  # with sequence parallelism the stage output is already a T/t shard: no re-assembly
                add("all-gather", "tensor", all_gather(t, unit, alpha, bws["tensor"]), 2 * iters)
        else:
            add("ppermute", "pipe", ppermute(unit, alpha, bw), 2 * iters)
        if R > 1 and not (mg or one_f):  # circular re-layout: (R-1)/R of the stage's block params move, and their grads back
            add("ppermute", "pipe", ppermute(4 * (L / S) * full_layer * (R - 1) / R, alpha, bw), 2)
        if not (mg or one_f):
            add("all-gather", "pipe", all_gather(S, M * unit, alpha, bw), 2)  # embedded inputs to every stage
            add("all-reduce", "pipe", all_reduce(S, M * unit, alpha, bw), 2)  # last stage's outputs back

    # --- memory traffic outside the matmul fusions (bytes), what an XLA:CPU profile shows beside
    # the dots. Residual stacking: the layer scan stores each saved residual in an (L, ...) stack
    # that XLA zero-fills, copies, writes slice by slice and reads back in backward (STACK_PASSES
    # passes over the saved bytes: broadcast, copy, dynamic-update-slice and dynamic-slice
    # fusions, about a third of a no-remat step, mostly gone under remat=full). chunked_mlp also
    # re-lays the layer's MLP weights out in strided chunks (read + write) and their grads back
    # (read + write), stacks those copies, and re-writes the MLP activations it recomputes.
    # Streaming updates (AdamW, bias adds) run near memory speed inside fusions and are left out:
    # with them the fit over-charges replicated optimizers (data=8 measured no slower than fsdp=8).
    traffic = 0.0
    if dev.mem_bandwidth > 0:
        traffic = layers_run * STACK_PASSES * saved
        if s.mlp_chunks > 1:
            traffic += layers_run * ((4 + STACK_PASSES) * 4 * el["mlp"] + MLP_UNITS * T * b * D * cb / t)
    traffic_s = traffic * share / dev.mem_bandwidth if traffic else 0.0
    if dev.hbm_bandwidth > 0:
        # GPUs: memory-bound kernels (LayerNorm, GELU, softmax, casts, residual adds) stream the
        # activations through HBM. Counting argument: every byte a layer produces (`live`, the same
        # residual count as the memory model) is written and read once in forward, read once in
        # backward where its gradient is written and read: 5 passes; each forward recompute
        # (remat=full, a pipeline's stage re-run) adds 2, selective adds 2 over the attention core,
        # mlp_chunks 2 over the MLP. The head's fp32 logits / log-probs / grads: 5 passes (+2 for
        # vocab_chunks' recompute).
        # (jaxpar's SP: LayerNorm on T/t shards, but its gathered outputs still stream in full: unchanged)
        _, live_none = layer_activation_bytes(w, b, t, "none", 1, cb, None, mgl, sp and mgl)
        passes = 5 + 2 * extra_fwd
        layer_bytes = passes * live_none
        if remat == "selective":
            layer_bytes += 2 * (live_none - layer_activation_bytes(w, b, t, "selective", 1, cb, None, mgl,
                                                                   sp and mgl)[0])
        if mgl:
            # Megatron-LM's layer (what-if) also produces tensors it does not keep, which the count
            # above (what a layer keeps) misses: the attention scores torch.baddbmm writes as
            # (b·np, s, s) in 16 bits for the fused softmax to read (its backward needs only the
            # probs), and the two RowParallelLinear outputs that bias-dropout-add reads (its backward
            # needs only the mask) (megatron/model/transformer.py, 2021). Each is written and
            # read in forward and in every forward recompute, and its gradient written and read in
            # backward: 4 + 2 per recompute passes (selective re-runs the scores: +2).
            scores = m.n_head * T * T * b / t * cb
            row_out = 2 * T * b * D * cb
            layer_bytes += (4 + 2 * extra_fwd) * (scores + row_out) + (2 * scores if remat == "selective" else 0)
        if s.mlp_chunks > 1:
            layer_bytes += 2 * T * b * D * cb * MLP_UNITS / t
        head_bytes = (5 + 2 * (vc > 1)) * 2 * T * b * V * 4 / t * head_rows_share
        traffic_s += (layers_run * layer_bytes + M * head_bytes) / dev.hbm_bandwidth

    hidden = dev.overlap
    step = compute + traffic_s + comm["tensor"] + comm["pipe"] + (1 - hidden) * (comm["fsdp"] + comm["data"])
    model_flops = _model_flops_per_token(m, T) * w.batch_size * T
    mfu = model_flops / (step * s.n_devices * peak)
    fits = memory_limit is None or mem["total"] <= memory_limit
    return Estimate(s, mem, step, compute, comm, cbytes, bubble, mfu, w.batch_size * T / step, tuple(lps), fits,
                    traffic_s=traffic_s, collectives=table)
