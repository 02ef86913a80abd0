"""Pipeline parallelism on the `pipe` mesh axis: stages, GPipe and circular schedules.

Everything runs inside the one jit-compiled SPMD train step; there is no per-stage program.

Stages. The transformer blocks are cut into V = S·R contiguous *virtual stages* (S = mesh.pipe,
R = pipeline.repeats) by `jaxpar.parallel.partition` (exact DP minimising the slowest stage) or
by a manual `pipeline.layers_per_stage`. Virtual stage v = r·S + s runs on pipe rank s, so with
R > 1 every rank holds R non-contiguous chunks (the circular / interleaved schedule of Narayanan
et al. 2021 and praxis/MaxText); R = 1 is GPipe. Params stay stored in the model's canonical
layout (`h.*` stacked on a leading `layers` dim, same tree as checkpoints and HF export); the
step re-lays them out to (R, S, Lmax, ...) with dim 1 over `pipe`:
  * uniform stages (all V stages the same size): a reshape (L,...) -> (R, S, L/V, ...). For GPipe
    this is free: the stored `layers` dim is sharded over `pipe` (`layout.PIPE_PARAM_RULES`),
    so rank s already holds layers [s·L/S, (s+1)·L/S). For R > 1 the stored contiguous blocks are
    not the interleaved chunks, so XLA moves (R-1)/R of the block params once per step (and the
    grads back): the price of keeping one on-disk layout.
  * non-uniform stages (e.g. [3, 2, 3]): a gather into (R, S, Lmax, ...) padded to the largest
    stage; padded slots hold a copy of some layer and are masked to the identity
    (`h = where(valid, block(h), h)`), so they get exactly zero gradient. Cost: a padded stage
    still computes its masked layers (compute of Lmax per stage, which equals the slowest stage
    anyway, so step time is unchanged), and the stored `layers` dim is replicated over `pipe`.

Embedding and head. `wte/wpe` lookup and `ln_f` + tied logits + loss run outside the pipelined
loop, in ordinary auto-sharded SPMD, with the batch split over (data, fsdp, pipe) when it
divides, so they are not replicated work: each pipe rank embeds / scores 1/S of the rows. Cost:
one all-gather over `pipe` of the embedded (B, T, D) inputs before the loop and one psum
(broadcast) of the last stage's (B, T, D) outputs after it; the embedding and head FLOPs do not
load stage 0 / stage S-1, so the partitioner is called with first/last extras = 0 (they are
spread over all stages instead). The tied `wte` is replicated over `pipe`.

Schedule (one `lax.scan` over N iterations; stage s works on virtual index i = t - s):
    Mp = max(M, S);  r = i // Mp;  m = i % Mp;  valid = 0 <= i, m < M, r < R
    N  = (R-1)·Mp + M + S - 1          (= R·M + S - 1 when M >= S)
Stage 0 takes microbatch m from the embedded inputs when r = 0, else the output of stage S-1
for (r-1, m), which arrived through the wrap-around of the ring (M = S: directly; M > S: parked
in an (M, mb, T, D) buffer for M - S iterations). Every iteration each rank runs its stage on
one (mb, T, D) microbatch, then one `ppermute` shifts the outputs s -> s+1 (mod S). Bubble:
(S-1)/(R·M+S-1) of stage-iterations are idle (more when R > 1 and M < S).

Transfers: `jax.shard_map` + `ppermute`, manual over (pipe, data, fsdp), auto over tensor.
Chosen over sharding-constrained shifts (`jnp.roll` on a pipe-sharded dim, MaxText's default)
because (1) each rank indexes its own repeat / microbatch with `axis_index`, so there is no
vmap over stages and no dynamic-slice of a pipe-sharded array that XLA might lower to gathers;
(2) the transfer is exactly one collective-permute per iteration, visible in the HLO; and (3)
making data and fsdp manual lets us place the gradient reductions: block weights enter the
body through `pcast(..., to='varying')` (data) and a tiled `all_gather` (fsdp) *before* the
scan, so their transposes - one psum over data, one reduce-scatter over fsdp - run once per
step on the gradients summed over all microbatches, not once per microbatch (auto-SPMD would
reduce inside the loop). That keeps the whole gathered stage (R·Lmax layers, fp32) live for
the step; `pipeline.gather=layer` instead gathers each layer's shards inside the checkpointed
stage, just before the layer runs (again in the backward re-run; grads reduce-scattered every
iteration, then one psum over data of the 1/f shards): one layer's weights live instead of the
stage's, for 3·N instead of 2 rounds of fsdp collectives (the planner weighs the two; on 8 CPU
devices, 8 layers of D=512 on 1×4×1×2: 205 -> 138 MiB per device, benchmarks/planner_accuracy.py
rows 23-25). Tensor parallelism stays automatic inside the stage: the model's
`constrain` calls resolve against the abstract mesh with only the tensor rules.

Remat: the stage computation of each iteration is `jax.checkpoint`-ed, so the scan saves only
the (mb, T, D) stage input per iteration and recomputes the stage in the backward pass.

1F1B, ZB-H1 and Megatron's interleaved order (`pipeline.schedule=1f1b | zb | interleaved`) run
from tables (`jaxpar.parallel.schedules`) by one executor, `jaxpar.parallel.pipeline_exec`.
Autodiff of this forward scan puts every forward before every backward, but one SPMD program can
still interleave them when the backward is written by hand inside the scan (a `jax.custom_vjp`
loss whose forward runs the whole step): 1f1b's stage s forwards microbatch t-s and backwards
t-(2S-2-s) at tick t, holding at most min(M, 2S-1) stage inputs instead of M+S-1, with the
embedding and head per microbatch on the first / last stage. Eval and sampling (forward only)
use this module's GPipe forward (with R chunks: the circular forward, the same virtual stages).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config, ModelConfig
from jaxpar.models import gpt2
from jaxpar.models.precision import Policy, get_policy
from jaxpar.parallel.layout import TABLE_SCHEDULES, ParallelLayout, StageLayout, bubble_fraction, n_iterations
from jaxpar.parallel.logical import activation_rules, spec_for

# ----------------------------------------------------------------------------- schedule arithmetic


# n_iterations (the schedule's scan length) and the bubble live in jaxpar.parallel.layout, which reports
# them before JAX starts; re-exported here beside the schedule they describe.
bubble_theory = bubble_fraction  # idle fraction of stage-iterations, (S-1)/(R·M+S-1) for M >= S


def schedule_table(S: int, M: int, R: int = 1) -> np.ndarray:
    """(N, S, 2) int: (repeat, microbatch) each stage works on at each iteration, (-1, -1) when idle."""
    N, Mp = n_iterations(S, M, R), max(M, S)
    out = np.full((N, S, 2), -1, np.int64)
    for t in range(N):
        for s in range(S):
            i = t - s
            if i >= 0 and i % Mp < M and i // Mp < R:
                out[t, s] = (i // Mp, i % Mp)
    return out


# ----------------------------------------------------------------------------- the pipelined blocks


def to_stage_layout(stacked, layout: StageLayout):
    """(L, ...) stacked block params -> (R, S, Lmax, ...) in virtual-stage order."""
    R, S, lmax = layout.repeats, layout.n_stages, layout.lmax
    if layout.uniform:
        return jax.tree.map(lambda a: a.reshape(R, S, lmax, *a.shape[1:]), stacked)
    idx = jnp.asarray(layout.index.reshape(-1))
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=0).reshape(R, S, lmax, *a.shape[1:]), stacked)


def _manual_spec(spec: P, manual) -> P:
    """Keep only the manual mesh axes of a PartitionSpec (shard_map specs cannot name auto axes)."""
    out = []
    for e in spec:
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        axes = tuple(a for a in axes if a in manual)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _varying(x, axes) -> jax.Array:
    """Mark `x` varying over `axes` now (once), so the transpose - a psum of the cotangent -
    runs here, outside the loop, instead of wherever x first meets a varying value."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _gather_fsdp(a, spec: P, lead: int = 0):
    """All-gather (tiled) every dim of `a` that `spec` shards over a manual axis; `spec` names the
    dims after the first `lead` ones. Transpose: a reduce-scatter of the cotangent."""
    for dim, e in enumerate(spec):
        if e is not None:
            a = jax.lax.all_gather(a, e, axis=dim + lead, tiled=True)
    return a


def _psum_f32(x, axis):
    """psum in fp32, cast back. bf16 psums inside shard_map lower to a reducer whose root is a
    copy, and XLA:CPU's AllReducePromotion aborts on it ("Invalid binary instruction opcode
    copy"); fp32 is also the precision policy's reduction dtype."""
    return jax.lax.psum(x.astype(jnp.float32), axis).astype(x.dtype)


def pipeline_blocks(mc: ModelConfig, policy: Policy, mesh, lay: ParallelLayout, stage_params, x,
                    microbatches: int, key=None, remat: bool = True, iterations: int | None = None,
                    mlp_chunks: int = 1, gather: str = "step"):
    """Run the transformer blocks as a pipeline. x (B, T, D) -> (B, T, D).

    lay: the resolved layout: its stage layout, the block parameter rules of each OSDP group
    (to find which block-param dims are sharded over fsdp, gathered once per step inside the
    body), the manual axes and batch axes of the shard_map, the rules inside the body.
    stage_params: block params in (R, S, Lmax, ...) layout (`to_stage_layout`).
    gather: when the fsdp-sharded block weights are all-gathered (`pipeline.gather`). "step":
    the whole stage (R·Lmax layers) once per step, kept for the loop and backward (grads
    reduce-scattered once per step, summed over microbatches). "layer": each layer's weights
    just before the layer runs, every iteration (the checkpointed stage re-gathers them in its
    backward re-run; the transpose reduce-scatters each layer's grads per iteration): ZeRO-3's
    memory (one layer gathered at a time) at ~1.5·N/R times the fsdp traffic of "step".
    iterations: benchmarks only - run this many loop iterations instead of the schedule's N
    (wrong results; used to time the loop without its fill/drain iterations).
    """
    layout, manual, batch = lay.stages, lay.manual_axes, lay.batch_axes
    S, R, M = layout.n_stages, layout.repeats, microbatches
    Mp, N = max(M, S), n_iterations(S, M, R)
    N_run = N if iterations is None else iterations
    B, T, D = x.shape
    use_buf = R > 1 and M > S
    masked = not layout.uniform

    # (B, T, D) -> (M, B/M, T, D) taking every M-th row, so each microbatch spans all data shards.
    xm = x.reshape(B // M, M, T, D).swapaxes(0, 1)
    xm = jax.lax.with_sharding_constraint(xm, NamedSharding(mesh, P(None, batch)))

    # shard_map specs: stage dim over pipe; block dims keep their fsdp sharding (gathered inside).
    # Each top-level block key (ln_1, attn, ln_2, mlp) follows its OSDP group's rules.
    rules = lay.block_rules()
    block_specs = {k: jax.tree.map(lambda a, k=k: spec_for(a, rules[k]), sub, is_leaf=lambda a: isinstance(a, tuple))
                   for k, sub in gpt2.BLOCK_AXES.items()}
    w_specs = jax.tree.map(lambda sp: P(None, "pipe", None, *_manual_spec(sp, manual)), block_specs,
                           is_leaf=lambda a: isinstance(a, P))
    # per-layer spec (the block dims) of each weight: which dims `_gather_fsdp` gathers
    layer_specs = jax.tree.map(lambda sp: P(*sp[3:]), w_specs, is_leaf=lambda a: isinstance(a, P))
    valid = jnp.asarray(layout.valid)
    block = nnx.graphdef(gpt2.Block(mc, policy, mlp_chunks=mlp_chunks))  # one layer; weights merged per step

    def stage(w_all, valid_all, r, h, k):
        """One stage of one iteration: the Lmax layers of repeat r on (mb, T, D)."""
        w = jax.tree.map(lambda a: a[r], w_all)
        ok = valid_all[r]
        keys = None if k is None else jax.random.split(k, layout.lmax)

        def layer(h, xs):
            lp, v, kk = xs
            if gather == "layer":  # (..., X/f) -> (..., X) for this layer only
                lp = jax.tree.map(_gather_fsdp, lp, layer_specs)
            y = nnx.merge(block, lp)(h, kk)
            return (jnp.where(v, y, h) if masked else y), None

        h, _ = jax.lax.scan(layer, h, (w, ok, keys))
        return h

    if remat:
        stage = jax.checkpoint(stage, prevent_cse=False)

    def body(w, ok, xm, key):
        s = jax.lax.axis_index("pipe")
        # (R, 1, Lmax, ...) local -> (R, Lmax, ...); gather="step": gather fsdp shards once per
        # step (transpose: one reduce-scatter of the summed grads); mark varying over data once
        # (transpose: one psum, of the 1/f shards when gather="layer").
        def prep(a, sp):
            a = a[:, 0]
            if gather == "step":
                a = _gather_fsdp(a, P(*sp[3:]), lead=2)
            return _varying(a, manual)

        w = jax.tree.map(prep, w, w_specs)
        ok = _varying(ok[:, 0], manual)
        # pvary in fp32: its transpose (a psum of the cotangent over pipe) then runs in fp32 too.
        xm = _varying(xm.astype(jnp.float32), manual).astype(xm.dtype)
        mb = xm.shape[1]
        state = _varying(jnp.zeros((mb, T, D), xm.dtype), manual)
        buf = _varying(jnp.zeros((M, mb, T, D), xm.dtype), manual) if use_buf else None

        def iteration(carry, t):
            state, buf = carry
            i = t - s
            r, m = jnp.clip(i // Mp, 0, R - 1), jnp.clip(i % Mp, 0, M - 1)
            fresh = jax.lax.dynamic_index_in_dim(xm, m, keepdims=False)
            if R > 1:
                back = jax.lax.dynamic_index_in_dim(buf, m, keepdims=False) if use_buf else state
                fresh = jnp.where(r == 0, fresh, back)
            inp = jnp.where(s == 0, fresh, state)
            k = None if key is None else jax.random.fold_in(key, r * M + m)
            out = stage(w, ok, r, inp, k)
            shifted = jax.lax.ppermute(out, "pipe", [(j, (j + 1) % S) for j in range(S)])
            if use_buf:  # park stage S-1's output of (r, m) until stage 0 needs it at (r+1, m)
                il = t - (S - 1)
                ml = jnp.clip(il % Mp, 0, M - 1)
                keep = (il >= 0) & (il % Mp < M) & (il // Mp < R - 1)
                old = jax.lax.dynamic_index_in_dim(buf, ml, keepdims=False)
                buf = jax.lax.dynamic_update_index_in_dim(buf, jnp.where(keep, shifted, old), ml, 0)
            return (shifted, buf), out

        with activation_rules(jax.sharding.get_abstract_mesh(), lay.pipeline_rules):
            _, ys = jax.lax.scan(iteration, (state, buf), jnp.arange(N_run))
        if N_run != N:  # benchmark mode: pad / cut to M outputs
            ys = jnp.concatenate([ys, jnp.zeros((max(M - N_run, 0), *ys.shape[1:]), ys.dtype)])[:M]
            return _psum_f32(ys, "pipe")
        # Stage S-1 finished microbatch m of the last repeat at iteration ·Mp + m + S - 1.
        first = (R - 1) * Mp + S - 1
        y = ys[first:first + M]
        return _psum_f32(jnp.where(s == S - 1, y, jnp.zeros_like(y)), "pipe")

    key_spec = None if key is None else P()
    f = jax.shard_map(body, mesh=mesh, in_specs=(w_specs, P(None, "pipe"), P(None, batch), key_spec),
                      out_specs=P(None, batch), axis_names=frozenset(manual))
    ym = f(stage_params, valid, xm, key)
    return ym.swapaxes(0, 1).reshape(B, T, D)


# ----------------------------------------------------------------------------- loss and logits


def embed_keep(key, m, rows: int, T: int, D: int, rate: float):
    """The embedding's dropout mask of microbatch m, (rows, T, D) bool, rows = B/M: drawn per
    microbatch so a table schedule (jaxpar.parallel.pipeline_exec), which embeds one microbatch at
    a time, draws GPipe's mask."""
    return jax.random.bernoulli(jax.random.fold_in(key, m), 1.0 - rate, (rows, T, D))


def _pipeline_model(cfg: Config, lay: ParallelLayout, mesh) -> Callable:
    """run(params, inputs (B,T), key|None, remat) -> (GPT2 model, (B,T,D) block outputs):
    embedding, then the blocks pipelined over `pipe`. Callers apply the head (loss for
    training, logits for eval and sample) inside `lay.activation_rules`."""
    policy, mc, M = get_policy(cfg.precision), cfg.model, cfg.pipeline.microbatches
    graphdef = nnx.graphdef(gpt2.GPT2(mc, policy=policy, vocab_chunks=cfg.train.vocab_chunks))

    def run(params, inputs, key, remat, x=None):
        # x: the embedded (B, T, D) inputs when the caller embeds (tied.per_group)
        k_embed = k_blocks = None
        if key is not None:
            k_embed, k_blocks = jax.random.split(key)
        model = nnx.merge(graphdef, params)
        if x is None and k_embed is not None and mc.dropout > 0:  # one mask per microbatch (embed_keep)
            B, T = inputs.shape
            keep = jax.vmap(lambda m: embed_keep(k_embed, m, B // M, T, mc.n_embd, mc.dropout))(jnp.arange(M))
            x = model.embed(inputs, keep=keep.swapaxes(0, 1).reshape(B, T, mc.n_embd))  # microbatch m: rows i·M + m
        x = model.embed(inputs, k_embed) if x is None else x
        w = to_stage_layout(params["h"], lay.stages)
        y = pipeline_blocks(mc, policy, mesh, lay, w, x, M, k_blocks, remat=remat, mlp_chunks=cfg.train.mlp_chunks,
                            gather=cfg.pipeline.gather)
        return model, y

    return run


def make_pipeline_loss_fn(cfg: Config, lay: ParallelLayout, mesh) -> Callable:
    """(params, inputs (B,T), targets (B,T), key|None) -> mean fp32 loss, blocks pipelined over `pipe`."""
    from jaxpar.parallel import tied

    run = _pipeline_model(cfg, lay, mesh)
    rules = lay.activation_rules
    axes = rules["batch"]
    groups = tied.pipeline_groups(mesh, axes) if cfg.model.dropout == 0 else 1

    def loss(params, inputs, targets, key):
        with activation_rules(mesh, lay.activation_rules):
            model, y = run(params, inputs, key, True)
            return model.head_loss(y, targets)

    if groups == 1:
        return loss
    # the tied wte's lookup and head gradients summed per row shard, then reduced once (tied.py).
    # Dropout keeps the ungrouped loss (per-group keys would change its masks).
    mc, policy, vc = cfg.model, get_policy(cfg.precision), cfg.train.vocab_chunks
    wte_spec = lay.param_specs(gpt2.param_axes(mc))["wte"]["weight"]
    inner = {**rules, "batch": None}  # inside the group vmap the G dim carries the row split

    def grouped(params, inputs, targets, key):
        wte_g = tied.broadcast_groups(params["wte"]["weight"], mesh, groups, axes, wte_spec)
        model_for = lambda w: gpt2.GPT2(mc, {**params, "wte": {"weight": w}}, policy=policy, vocab_chunks=vc)  # noqa: E731

        def embed(w, x):
            with activation_rules(mesh, inner):
                return model_for(w).embed(x)

        def head_loss(w, y, t):
            with activation_rules(mesh, inner):
                return model_for(w).head_loss(y, t)

        with activation_rules(mesh, rules):
            B, T = inputs.shape
            x = tied.per_group(embed, wte_g, axes, inputs).reshape(B, T, -1)  # (B, T, D)
            _, y = run(params, inputs, None, True, x=x)
            return tied.per_group(head_loss, wte_g, axes, y, targets).mean()

    return grouped


def make_pipeline_logits_fn(cfg: Config, lay: ParallelLayout, mesh) -> Callable:
    """(params, inputs (B,T)) -> fp32 logits (B,T,V), blocks pipelined over `pipe` (eval, sample).
    B must split into pipeline.microbatches per data-parallel replica, as in training."""
    run = _pipeline_model(cfg, lay, mesh)

    def logits(params, inputs):
        with activation_rules(mesh, lay.activation_rules):
            model, y = run(params, inputs, None, False)
            return model.head(y)

    return logits


def describe(cfg: Config, lay: ParallelLayout) -> dict[str, Any]:
    """Summary used by the CLI / example: stages, iterations, theoretical bubble."""

    pc, S = cfg.pipeline, lay.mesh.pipe
    if pc.schedule in TABLE_SCHEDULES:  # the packed plan's ticks (jaxpar.parallel.pipeline_exec)
        from jaxpar.parallel.schedules import lockstep, make_table

        iters = len(lockstep(make_table(pc.schedule, S, pc.microbatches, pc.repeats)))
    else:
        iters = n_iterations(S, pc.microbatches, pc.repeats)
    return {"stages": S, "schedule": pc.schedule, "repeats": pc.repeats, "microbatches": pc.microbatches,
            "layers_per_stage": list(lay.stages.layers_per_stage), "iterations": iters,
            "bubble_theory": bubble_theory(S, pc.microbatches, pc.repeats, pc.schedule)}
