"""1F1B (PipeDream-flush) pipeline schedule in one SPMD program, with manual gradients.

`pipeline.schedule=1f1b` (R = 1). The GPipe schedule of `jaxpar.parallel.pipeline` is one
forward scan differentiated by autodiff, so every forward precedes every backward and each
stage keeps one saved input per iteration (M + S - 1 of them) plus the (B, T, D) embedded inputs
and broadcast outputs. Here the backward is written by hand inside the same scan, so a stage
can run microbatch m's backward while later microbatches are still going forward:

Ticks. One `lax.scan` over N = M + 2S - 2 ticks, t = 0 .. M + 2S - 3. At tick t stage s runs
    forward  of microbatch  f = t - s              when 0 <= f < M   (ticks s .. s+M-1)
    backward of microbatch  b = t - (2S - 2 - s)   when 0 <= b < M   (ticks 2S-2-s .. 2S-3-s+M)
The last stage (s = S-1) runs forward, ln_f + tied head + loss, the head's vjp and its own
backward for the same microbatch in one tick. Stage 0 embeds microbatch f from the token ids
(M, mb, T) and, in its backward, pushes dx through the embedding's vjp (wte/wpe grads).
Each tick ends with one ppermute of the forward outputs s -> s+1 and one of the input
gradients s -> s-1 (both (mb, T, D), compute dtype).

Memory (per device). Stage inputs live in a ring buffer of K = min(M, 2S-1) slots of
(mb, T, D) compute dtype, slot f % K: stage s holds an input from its forward (tick s+f) to its
backward (tick 2S-2-s+f), i.e. 2S-1-2s microbatches in flight, at most 2S-1 on stage 0,
independent of M. The backward re-runs the stage from the saved input (`jax.vjp` of the
stage: the same compute as GPipe's checkpointed stage), so a tick's residuals are those of
one stage on one microbatch. Gradients accumulate in fp32 in the scan carry: the stage's
block weights (fsdp gathered once before the scan), wte/wpe/ln_f. Per-microbatch logits
(mb, T, V) of the head live only inside the tick. Unlike GPipe, no (B, T, D) embedded
inputs or outputs exist: token ids go in, the loss comes out. Measured (train step temp bytes,
gpt2-tiny L=4, T=64, 4 rows per microbatch, pipe=2): GPipe 14.8 -> 19.3 MiB from M=4 to 16 (+3
stage inputs per microbatch), 1F1B 13.88 -> 13.91 MiB (benchmarks/pipeline_1f1b.py).

Bubble. Idle forwards / backwards are skipped with `lax.cond` on a per-device predicate (its
branches contain only the automatic tensor-axis collectives, taken by all tensor peers
together), so a fill tick costs one forward, a drain tick one backward: step time is
(S-1)·F + M·(F+B) + (S-1)·B = (M+S-1)·(F+B), the same bubble (S-1)/(M+S-1) as GPipe
(`jaxpar.parallel.layout.bubble_fraction`). Busy: stage s forwards in ticks [s, s+M), backwards in
[2S-2-s, 2S-2-s+M); stage S-1 does both in [S-1, S-1+M).

Gradients leave the scan once: block grads reduce-scattered over fsdp (`psum_scatter`, the
transpose of the gather), then psum over data; wte/wpe/ln_f grads, nonzero only on stage 0
(lookup) and S-1 (tied head, ln_f), summed over (pipe, data) in one psum and reduce-scattered
over fsdp - the tied wte's two uses are summed by that one reduction. All in fp32 (the
precision policy's reduction dtype; params are fp32).

Autodiff sees a `jax.custom_vjp` loss: the forward runs the whole 1F1B step and keeps the
grads as its residual, the backward returns cotangent·grads (float0 for the token ids), so
`jax.value_and_grad(loss_fn)` in train.py is unchanged. Evaluation and sampling keep the
GPipe forward (`make_pipeline_logits_fn`). Not supported (one-line errors in
`jaxpar.parallel.layout`): repeats > 1, dropout > 0, pipeline.gather=layer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config
from jaxpar.models import gpt2
from jaxpar.models.precision import get_policy
from jaxpar.parallel.fsdp import _gather
from jaxpar.parallel.layout import ParallelLayout, n_ticks, ring_slots
from jaxpar.parallel.logical import activation_rules, spec_for
from jaxpar.parallel.pipeline import _manual_spec, _varying, to_stage_layout

OUTER = ("wte", "wpe", "ln_f")  # the non-block params: embedding on stage 0, ln_f + tied head on S-1


# ----------------------------------------------------------------------------- schedule arithmetic (numpy)


def schedule_table(S: int, M: int) -> np.ndarray:
    """(N, S, 2) int: [forward microbatch, backward microbatch] of each stage at each tick, -1 idle.
    The same arithmetic as the scan body (`_tick`)."""
    t = np.arange(n_ticks(S, M))[:, None]
    s = np.arange(S)[None, :]
    f, b = t - s, t - (2 * S - 2 - s)
    return np.stack([np.where((f >= 0) & (f < M), f, -1), np.where((b >= 0) & (b < M), b, -1)], -1)


# ----------------------------------------------------------------------------- the step


def _reduce(g, spec: P, tensor_spec: P, extra: tuple[str, ...] = ()):
    """Sum a gradient over the data-parallel axes (and `extra`) and keep this device's shard:
    reduce-scatter over each manual axis `spec` names (the transpose of `fsdp._gather`, (.., D, ..)
    -> (.., D/f, ..)), then one psum over the rest of (data, fsdp, *extra). Runs in a nested
    shard_map over tensor when `g` is tensor-split, as `_gather` does."""
    named = {e for e in spec if e is not None}
    rest = tuple(a for a in ("data", "fsdp", *extra) if a not in named)

    def reduce(x):
        for dim, axis in enumerate(spec):
            if axis is not None:
                x = jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
        return jax.lax.psum(x, rest)

    if all(e is None for e in tensor_spec):
        return reduce(g)
    return jax.shard_map(reduce, in_specs=tensor_spec, out_specs=tensor_spec, axis_names=frozenset({"tensor"}))(g)


def _add(acc: dict, d: dict) -> dict:
    """acc + d for the keys d has (grad trees of wte / wpe / ln_f)."""
    return {**acc, **{k: jax.tree.map(jnp.add, acc[k], d[k]) for k in d}}


def make_1f1b_step(cfg: Config, lay: ParallelLayout, mesh) -> Callable:
    """(params, inputs (B,T), targets (B,T)) -> (mean fp32 loss, grads like params)."""
    policy, mc, tc = get_policy(cfg.precision), cfg.model, cfg.train
    layout, manual, batch = lay.stages, lay.manual_axes, lay.batch_axes
    S, M = layout.n_stages, cfg.pipeline.microbatches
    N, K = n_ticks(S, M), ring_slots(S, M)
    masked = not layout.uniform
    sizes = dict(mesh.shape)
    n_rows = sizes.get("data", 1) * sizes.get("fsdp", 1)  # data-parallel replicas of the batch

    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs = lay.param_specs(gpt2.param_axes(mc))
    # block weights in stage layout (1, S, Lmax, ...): stage dim over pipe, block dims keep their
    # manual (fsdp) split; per-layer manual / tensor specs for the gather and the reduce-scatter
    rules = lay.block_rules()
    block_specs = {k: jax.tree.map(lambda a, k=k: spec_for(a, rules[k]), sub, is_leaf=lambda a: isinstance(a, tuple))
                   for k, sub in gpt2.BLOCK_AXES.items()}
    w_specs = jax.tree.map(lambda sp: P(None, "pipe", None, *_manual_spec(sp, manual)), block_specs, is_leaf=is_spec)
    w_gather = jax.tree.map(lambda sp: (P(None, *_manual_spec(sp, manual)), P(None, *_manual_spec(sp, ("tensor",)))),
                            block_specs, is_leaf=is_spec)  # (Lmax, ...) dims
    o_specs = {k: jax.tree.map(lambda sp: _manual_spec(sp, manual), specs[k], is_leaf=is_spec) for k in OUTER}
    o_tensor = {k: jax.tree.map(lambda sp: _manual_spec(sp, ("tensor",)), specs[k], is_leaf=is_spec) for k in OUTER}
    valid = jnp.asarray(layout.valid[0])  # (S, Lmax) bool: False on the pads of non-uniform stages
    block = nnx.graphdef(gpt2.Block(mc, policy, mlp_chunks=tc.mlp_chunks))

    def run_stage(w, ok, h):
        """The stage's Lmax layers on one microbatch, (mb, T, D) -> (mb, T, D)."""
        def layer(h, xs):
            lp, v = xs
            y = nnx.merge(block, lp)(h)
            return (jnp.where(v, y, h) if masked else y), None

        return jax.lax.scan(layer, h, (w, ok))[0]

    def body(w, ok, outer, tok, tgt):
        # w: (1, 1, Lmax, ...) local (fsdp-split) block weights; outer: wte/wpe/ln_f local shards;
        # tok, tgt: (M, mb, T) int32 this replica's microbatches (the same on every pipe rank).
        s = jax.lax.axis_index("pipe")
        first, last = s == 0, s == S - 1
        # gather fsdp once per step; everything varying over the manual axes from here on, so no
        # collective is implied inside the loop (reductions are written out after it)
        w = jax.tree.map(lambda a, g: _varying(_gather(a[0, 0], *g), manual), w, w_gather)
        ok = _varying(ok[0], manual)
        outer = {k: jax.tree.map(lambda a, sp, ts: _varying(_gather(a, sp, ts), manual), outer[k], o_specs[k],
                                 o_tensor[k]) for k in OUTER}
        mb, T = tok.shape[1:]
        D = mc.n_embd
        act = lambda: _varying(jnp.zeros((mb, T, D), policy.compute_dtype), manual)  # noqa: E731
        f32_zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
        # d(global mean loss) / d(one microbatch's mean loss)
        seed = _varying(jnp.full((), 1.0 / (M * n_rows), jnp.float32), manual)

        def embed(o, x_tok):  # (mb, T) -> (mb, T, D)
            return gpt2.GPT2(mc, {**o, "h": None}, policy=policy).embed(x_tok)

        def head_loss(o, y, y_tgt):  # (mb, T, D) -> mean fp32 loss of the microbatch
            return gpt2.GPT2(mc, {**outer, **o, "h": None}, policy=policy,
                             vocab_chunks=tc.vocab_chunks).head_loss(y, y_tgt)

        def tick(carry, t):
            x_recv, g_recv, ring, gw, go, loss = carry
            f, b = t - s, t - (2 * S - 2 - s)
            f_ok, b_ok = (f >= 0) & (f < M), (b >= 0) & (b < M)
            fi, bi = jnp.clip(f, 0, M - 1), jnp.clip(b, 0, M - 1)

            # ---- forward of microbatch f: input from stage s-1 (or the embedding), saved in the ring
            def forward(ring):
                x = jax.lax.cond(first, lambda: embed(outer, tok[fi]), lambda: x_recv)
                ring = jax.lax.dynamic_update_index_in_dim(ring, x, fi % K, 0)
                return ring, run_stage(w, ok, x)

            ring, y = jax.lax.cond(f_ok, forward, lambda ring: (ring, act()), ring)

            # ---- last stage: loss of microbatch f and its head's vjp, the seed of the backward
            def head(go, loss):
                l_m, vjp = jax.vjp(lambda o, y: head_loss(o, y, tgt[fi]), {k: outer[k] for k in ("wte", "ln_f")}, y)
                d_o, dy = vjp(seed)
                return _add(go, d_o), loss + l_m, dy

            go, loss, dy = jax.lax.cond(last & f_ok, head, lambda go, loss: (go, loss, act()), go, loss)

            # ---- backward of microbatch b: re-run the stage from its saved input, vjp
            def backward(gw, go):
                g = jnp.where(last, dy, g_recv)
                x = jax.lax.dynamic_index_in_dim(ring, bi % K, keepdims=False)
                _, vjp = jax.vjp(lambda w, x: run_stage(w, ok, x), w, x)
                dw, dx = vjp(g)
                gw = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), gw, dw)

                def embed_grad(go):  # stage 0: dx through the lookup into wte / wpe
                    _, vjp_e = jax.vjp(lambda o: embed({**outer, **o}, tok[bi]), {k: outer[k] for k in ("wte", "wpe")})
                    (d_o,) = vjp_e(dx)
                    return _add(go, d_o)

                go = jax.lax.cond(first, embed_grad, lambda go: go, go)
                return gw, go, dx

            gw, go, dx = jax.lax.cond(b_ok, backward, lambda gw, go: (gw, go, act()), gw, go)

            # ---- one hop each way: activations s -> s+1, input gradients s -> s-1
            x_next = jax.lax.ppermute(y, "pipe", [(j, j + 1) for j in range(S - 1)])
            g_next = jax.lax.ppermute(dx, "pipe", [(j + 1, j) for j in range(S - 1)])
            return (x_next, g_next, ring, gw, go, loss), None

        ring = _varying(jnp.zeros((K, mb, T, D), policy.compute_dtype), manual)
        vary = lambda tree: jax.tree.map(lambda a: _varying(a, manual), tree)  # noqa: E731
        carry = (act(), act(), ring, vary(f32_zeros(w)), vary(f32_zeros(outer)), vary(jnp.zeros((), jnp.float32)))
        with activation_rules(jax.sharding.get_abstract_mesh(), lay.pipeline_rules):
            (_, _, _, gw, go, loss), _ = jax.lax.scan(tick, carry, jnp.arange(N))
        # ---- the reductions, once per step, fp32
        gw = jax.tree.map(lambda g, gs: _reduce(g, *gs)[None, None], gw, w_gather)
        # stage 0's lookup and stage S-1's head grads of the tied wte meet in this one reduction
        go = {k: jax.tree.map(lambda g, sp, ts: _reduce(g, sp, ts, ("pipe",)), go[k], o_specs[k], o_tensor[k])
              for k in OUTER}
        loss = jax.lax.psum(loss, manual) / (M * n_rows)
        return loss, gw, go

    tok_spec = P(None, batch)
    f = jax.shard_map(body, mesh=mesh,
                      in_specs=(w_specs, P("pipe"), {k: o_specs[k] for k in OUTER}, tok_spec, tok_spec),
                      out_specs=(P(), w_specs, {k: o_specs[k] for k in OUTER}), axis_names=frozenset(manual))

    def step(params, inputs, targets):
        B, T = inputs.shape
        # (B, T) -> (M, B/M, T) taking every M-th row, as the GPipe schedule splits microbatches
        split = lambda a: jax.lax.with_sharding_constraint(  # noqa: E731
            a.reshape(B // M, M, T).swapaxes(0, 1), NamedSharding(mesh, P(None, batch)))
        w, back = jax.vjp(lambda h: to_stage_layout(h, layout), params["h"])
        loss, gw, go = f(w, valid, {k: params[k] for k in OUTER}, split(inputs), split(targets))
        (gh,) = back(gw)  # stage layout -> the stored (L, ...) layout (pads of non-uniform stages drop out)
        return loss, {**go, "h": gh}

    return step


def make_1f1b_loss_fn(cfg: Config, lay: ParallelLayout, mesh) -> Callable:
    """(params, inputs (B,T), targets (B,T), key=None) -> mean fp32 loss whose gradient (via
    `jax.custom_vjp`) is the one the 1F1B step computed alongside it."""
    step = make_1f1b_step(cfg, lay, mesh)

    @jax.custom_vjp
    def loss(params, inputs, targets):
        return step(params, inputs, targets)[0]

    def fwd(params, inputs, targets):
        value, grads = step(params, inputs, targets)
        return value, (grads, inputs, targets)

    def bwd(res, ct):
        grads, inputs, targets = res
        zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731  (integer inputs)
        return jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads), zero(inputs), zero(targets)

    loss.defvjp(fwd, bwd)

    def loss_fn(params, inputs, targets, key=None):
        assert key is None, "pipeline.schedule=1f1b has no dropout (jaxpar.parallel.layout refuses model.dropout > 0)"
        return loss(params, inputs, targets)

    return loss_fn
