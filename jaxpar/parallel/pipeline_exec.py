"""The one executor of schedule tables: any `jaxpar.parallel.schedules` plan in one SPMD program.

`pipeline.schedule=1f1b | zb | interleaved`. The GPipe schedule of `jaxpar.parallel.pipeline` is
one forward scan differentiated by autodiff, so every forward precedes every backward. Here the
backward is written by hand inside the same scan, and which rank runs what at each tick is read
from a table: `schedules.make_table` (tick × rank -> F / B / W / BW of (microbatch m, virtual
stage v = r·S + s)), packed for lock step by `schedules.lockstep` into N ticks of up to three
lanes per rank (F, then B or BW, then W).

Ticks. One `lax.scan` over the N plan ticks; tick t's row of the plan (per rank: the slots
arriving data go to, and each lane's m, chunk r and slots) is a scan input, and rank s reads its
own column. A tick: store the activation and the gradient that arrived (into the slots the plan
names), run the lanes, then one ppermute of the forward output s -> s+1 and one of the input
gradient s -> s-1 (both (mb, T, D), compute dtype; around the ring, S-1 -> 0 and 0 -> S-1, when
R > 1: virtual stage r·S + S-1 feeds (r+1)·S). Idle lanes are skipped with `lax.cond` /
`lax.switch` on per-rank values (branches hold only the automatic tensor-axis collectives,
taken by all tensor peers together).
  F   stage 0 of chunk 0 embeds microbatch m from the token ids (M, mb, T); others read the
      input that arrived. The last virtual stage runs nothing here (its B runs it).
  B   re-runs the stage from its saved input, `jax.vjp` for the input only; on the last virtual
      stage first ln_f + tied head + loss and the head's vjp, whose dy is saved for the W; on
      virtual stage 0 the input gradient goes through the embedding's vjp (wte / wpe).
  W   the vjp for the stage's weights from the saved input and output gradient.
  BW  B and W in one vjp (1f1b, interleaved).

Memory (per rank). Saved stage inputs (K_x slots of (mb, T, D)) live from arrival to their last
use (W or BW), output gradients (K_g slots) from arrival to theirs; the slots come from an
interval colouring of the plan (`schedules.assign_slots`), so their number is the plan's peak:
1f1b and zb min(M, 2S-1) inputs, zb also min(M, S) gradients, interleaved (R+1)S - 1 chunk
inputs (M >= 2S), all independent of M. A tick's residuals are one stage's on one microbatch
(the vjps re-run it). Gradients accumulate in fp32 in the carry: the rank's R chunks of block
weights (fsdp gathered once before the scan; with pipeline.gather=layer each layer is gathered
where it runs and its gradient reduce-scattered there) and wte / wpe / ln_f. Token ids go in, the loss
comes out: no (B, T, D) embedded batch or (B, T, V) logits exist.

Time. The tables' bubbles (`jaxpar.parallel.layout.bubble_fraction`) count each rank's own idle
ticks, as an asynchronous runtime would see them. One SPMD scan runs in lock step: a tick lasts
as long as its busiest rank's lanes (idle lanes are skipped with lax.cond). Counting F as one
stage forward and B, W, BW as the re-run plus one, one or two backward passes (2, 2, 3), the packed
plans take: 1f1b M + S - 1 stage runs (F + BW each) over M + 2S - 2 ticks, its table's bubble;
interleaved R·M + S - 1 chunk runs over R·M + (R+1)S - 2 ticks, Megatron's bubble; zb
(5M + 3(S-1))/4 stage runs over M + 2S - 2 ticks, more than 1f1b, since B and W each re-run the
stage from its saved input (no residuals are kept between them). Its split pays off only where
ranks run asynchronously (jaxpar.planner.schedules checks these forms against the packed plans).

Gradients leave the scan once: block grads reduce-scattered over fsdp (`psum_scatter`, the
transpose of the gather), then psum over data; wte/wpe/ln_f grads, nonzero only on the ranks
of the first and the last virtual stage, summed over (pipe, data) in one psum and
reduce-scattered over fsdp - the tied wte's two uses meet in that one reduction. All in fp32.
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
from jaxpar.parallel import schedules as sc
from jaxpar.parallel.fsdp import _gather
from jaxpar.parallel.layout import ParallelLayout
from jaxpar.parallel.logical import activation_rules, constrain, spec_for
from jaxpar.parallel.pipeline import _manual_spec, _varying, embed_keep, to_stage_layout

OUTER = ("wte", "wpe", "ln_f")  # the non-block params: embedding on virtual stage 0, ln_f + tied head on the last

# columns of a plan row (per tick and rank): arrival slots, then each lane's action
XIN, GIN, F_ON, F_M, F_R, F_X, B_KIND, B_M, B_R, B_X, B_G, W_ON, W_M, W_R, W_X, W_G = range(16)


def plan_for(schedule: str, S: int, M: int, R: int = 1) -> tuple[np.ndarray, int, int]:
    """(N, S, 16) int32 plan rows, the stash slots K_x and the gradient slots K_g of `schedule`."""
    plan = sc.lockstep(sc.make_table(schedule, S, M, R))
    xs, gs = sc.plan_intervals(plan)
    xslot, kx = sc.assign_slots(xs)
    gslot, kg = sc.assign_slots(gs)
    N, V = len(plan), R * S
    rows = np.full((N, S, 16), -1, np.int32)
    rows[..., (F_ON, B_KIND, W_ON)] = 0
    at = {}
    for t, s, lane in zip(*np.nonzero(plan[..., 0] != sc.IDLE)):
        k, m, v = (int(x) for x in plan[t, s, lane])
        at[(sc.B if k == sc.BW else k, m, v)] = int(t)
        key = (int(s), m, v)
        if k == sc.F:
            rows[t, s, F_ON:F_X + 1] = (1, m, v // S, xslot[key])
        elif k in (sc.B, sc.BW):
            rows[t, s, B_KIND:B_G + 1] = (1 if k == sc.B else 2, m, v // S, xslot[key], gslot[key])
        else:
            rows[t, s, W_ON:W_G + 1] = (1, m, v // S, xslot[key], gslot[key])
    for (k, m, v), t in at.items():  # arrivals: the tick after the neighbour's F / B
        if k == sc.F and v + 1 < V:
            rows[t + 1, (v + 1) % S, XIN] = xslot[((v + 1) % S, m, v + 1)]
        if k == sc.B and v > 0:
            rows[t + 1, (v - 1) % S, GIN] = gslot[((v - 1) % S, m, v - 1)]
    return rows, kx, kg


def _reduce(g, spec: P, tensor_spec: P, extra: tuple[str, ...] = (), scattered: bool = False):
    """Sum a gradient over the data-parallel axes (and `extra`) and keep this device's shard:
    reduce-scatter over each manual axis `spec` names (the transpose of `fsdp._gather`, (.., D, ..)
    -> (.., D/f, ..)), then one psum over the rest of (data, fsdp, *extra). scattered: `g` is
    already this device's shard, summed over those axes (pipeline.gather=layer: each layer's
    gather was transposed inside the loop). Runs in a nested shard_map over tensor when `g` is
    tensor-split, as `_gather` does."""
    named = {e for e in spec if e is not None}
    rest = tuple(a for a in ("data", "fsdp", *extra) if a not in named)

    def reduce(x):
        for dim, axis in enumerate(spec):
            if axis is not None and not scattered:
                x = jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
        return jax.lax.psum(x, rest)

    if all(e is None for e in tensor_spec):
        return reduce(g)
    return jax.shard_map(reduce, in_specs=tensor_spec, out_specs=tensor_spec, axis_names=frozenset({"tensor"}))(g)


def _add(acc: dict, d: dict) -> dict:
    """acc + d for the keys d has (grad trees of wte / wpe / ln_f)."""
    return {**acc, **{k: jax.tree.map(jnp.add, acc[k], d[k]) for k in d}}


def make_schedule_step(cfg: Config, lay: ParallelLayout, mesh, dropout: bool = False) -> Callable:
    """(params, inputs (B,T), targets (B,T), key) -> (mean fp32 loss, grads like params), running
    cfg.pipeline.schedule's plan. dropout: draw model.dropout's masks from `key` (uint32 (2,)),
    as GPipe draws them: the embedding's per microbatch (`pipeline.embed_keep`), chunk r of
    microbatch m's layers from fold_in(key_blocks, r·M + m), the same in the forward and in every
    re-run of the stage."""
    policy, mc, tc = get_policy(cfg.precision), cfg.model, cfg.train
    layout, manual, batch = lay.stages, lay.manual_axes, lay.batch_axes
    S, R, M = layout.n_stages, layout.repeats, cfg.pipeline.microbatches
    rows, KX, KG = plan_for(cfg.pipeline.schedule, S, M, R)
    masked = not layout.uniform
    per_layer = cfg.pipeline.gather == "layer"  # gather each layer's fsdp shards where it runs
    sizes = dict(mesh.shape)
    n_rows = sizes.get("data", 1) * sizes.get("fsdp", 1)  # data-parallel replicas of the batch

    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs = lay.param_specs(gpt2.param_axes(mc))
    # block weights in stage layout (R, S, Lmax, ...): stage dim over pipe, block dims keep their
    # manual (fsdp) split; per-layer manual / tensor specs for the gather and the reduce-scatter
    rules = lay.block_rules()
    block_specs = {k: jax.tree.map(lambda a, k=k: spec_for(a, rules[k]), sub, is_leaf=lambda a: isinstance(a, tuple))
                   for k, sub in gpt2.BLOCK_AXES.items()}
    w_specs = jax.tree.map(lambda sp: P(None, "pipe", None, *_manual_spec(sp, manual)), block_specs, is_leaf=is_spec)
    w_gather = jax.tree.map(lambda sp: (P(None, None, *_manual_spec(sp, manual)),
                                        P(None, None, *_manual_spec(sp, ("tensor",)))),
                            block_specs, is_leaf=is_spec)  # (R, Lmax, ...) dims
    o_specs = {k: jax.tree.map(lambda sp: _manual_spec(sp, manual), specs[k], is_leaf=is_spec) for k in OUTER}
    o_tensor = {k: jax.tree.map(lambda sp: _manual_spec(sp, ("tensor",)), specs[k], is_leaf=is_spec) for k in OUTER}
    valid = jnp.asarray(layout.valid)  # (R, S, Lmax) bool: False on the pads of non-uniform stages
    block = nnx.graphdef(gpt2.Block(mc, policy, mlp_chunks=tc.mlp_chunks))
    whole_t = {**lay.pipeline_rules, "resid_seq": None}  # the embedding's output keeps T whole
    fwd_perm = [(j, (j + 1) % S) for j in range(S if R > 1 else S - 1)]
    bwd_perm = [((j + 1) % S, j) for j in range(S if R > 1 else S - 1)]

    def run_stage(w, ok, h, keys):
        """One chunk's Lmax layers on one microbatch, (mb, T, D) -> (mb, T, D); keys (Lmax, 2) or None."""
        def layer(h, xs):
            lp, v, k = xs
            if per_layer:  # (..., X/f) -> (..., X) for this layer only; transpose: a reduce-scatter
                lp = jax.tree.map(lambda a, g: _gather(a, P(*g[0][2:]), P(*g[1][2:])), lp, w_gather)
            y = nnx.merge(block, lp)(h, k)
            return (jnp.where(v, y, h) if masked else y), None

        return jax.lax.scan(layer, h, (w, ok, keys))[0]

    def body(w, ok, outer, tok, tgt, plan, key):
        # w: (R, 1, Lmax, ...) local (fsdp-split) block weights; outer: wte/wpe/ln_f local shards;
        # tok, tgt: (M, mb, T) int32 this replica's microbatches (the same on every pipe rank);
        # plan: (N, S, 16) int32, the same on every rank; key: (2,) uint32 (used with dropout)
        s = jax.lax.axis_index("pipe")
        # gather fsdp once per step (gather=step); everything varying over the manual axes from here
        # on, so no collective is implied inside the loop (reductions are written out after it)
        w = jax.tree.map(lambda a, g: _varying(a[:, 0] if per_layer else _gather(a[:, 0], *g), manual), w, w_gather)
        ok = _varying(ok[:, 0], manual)
        outer = {k: jax.tree.map(lambda a, sp, ts: _varying(_gather(a, sp, ts), manual), outer[k], o_specs[k],
                                 o_tensor[k]) for k in OUTER}
        mb, T = tok.shape[1:]
        D = mc.n_embd
        # Every (mb, T, D) value that leaves a cond / switch branch, is stashed or sent to the next
        # stage has T whole: XLA requires one sharding per conditional result, and resharding a
        # T-split value inside a lane only some ranks run would put a collective-permute among
        # the tensor peers there, which XLA:CPU rendezvouses over every device (a deadlock).
        # Sequence parallelism (resid_seq -> tensor) still splits T inside each stage's blocks.
        resid = lambda x: constrain(x, ("batch", "seq", "embed"))  # noqa: E731
        act = lambda: resid(_varying(jnp.zeros((mb, T, D), policy.compute_dtype), manual))  # noqa: E731
        f32_zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
        # d(global mean loss) / d(one microbatch's mean loss)
        seed = _varying(jnp.full((), 1.0 / (M * n_rows), jnp.float32), manual)
        chunk = lambda tree, r: jax.tree.map(lambda a: a[r], tree)  # noqa: E731
        read = lambda buf, i: jax.lax.dynamic_index_in_dim(buf, i, keepdims=False)  # noqa: E731
        write = lambda buf, x, i: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0)  # noqa: E731

        def store(buf, x, i):  # an arrival into slot i; i = -1: nothing arrived
            return write(buf, jnp.where(i >= 0, x, read(buf, jnp.maximum(i, 0))), jnp.maximum(i, 0))

        k_embed, k_blocks = jax.random.split(key)  # as GPipe splits its key

        def stage_keys(m, r):  # (Lmax, 2) layer keys of chunk r on microbatch m, or None
            return jax.random.split(jax.random.fold_in(k_blocks, r * M + m), layout.lmax) if dropout else None

        def embed(o, x_tok, m):  # (mb, T) -> (mb, T, D); with dropout this replica's rows of GPipe's mask
            keep = None
            if dropout:
                j = jax.lax.axis_index(("data", "fsdp"))  # this replica's row block of the microbatch
                keep = embed_keep(k_embed, m, mb * n_rows, T, D, mc.dropout)
                keep = jax.lax.dynamic_slice_in_dim(keep, j * mb, mb, 0)
            with activation_rules(jax.sharding.get_abstract_mesh(), whole_t):  # see `resid` below
                return gpt2.GPT2(mc, {**o, "h": None}, policy=policy).embed(x_tok, keep=keep)

        def head_loss(o, y, y_tgt):  # (mb, T, D) -> mean fp32 loss of the microbatch
            return gpt2.GPT2(mc, {**outer, **o, "h": None}, policy=policy,
                             vocab_chunks=tc.vocab_chunks).head_loss(y, y_tgt)

        def add_chunk(gw, dw, r):  # gw (R, Lmax, ...) fp32 += dw (Lmax, ...) at chunk r
            return jax.tree.map(lambda a, d: a.at[r].add(d.astype(jnp.float32)), gw, dw)

        def tick(carry, row):
            x_recv, g_recv, xbuf, gbuf, gw, go, loss = carry
            c = read(row, s)  # (16,) this rank's columns
            xbuf, gbuf = store(xbuf, x_recv, c[XIN]), store(gbuf, g_recv, c[GIN])

            # ---- F lane: input from virtual stage v-1 (or the embedding), kept in its slot
            def forward(xbuf):
                m, r, i = c[F_M], c[F_R], c[F_X]
                first, last = (r == 0) & (s == 0), (r == R - 1) & (s == S - 1)
                x = jax.lax.cond(first, lambda: resid(embed(outer, tok[m], m)), lambda: resid(read(xbuf, i)))
                y = jax.lax.cond(last, act, lambda: resid(run_stage(chunk(w, r), ok[r], x, stage_keys(m, r))))
                return write(xbuf, x, i), y

            xbuf, y = jax.lax.cond(c[F_ON] > 0, forward, lambda xbuf: (xbuf, act()), xbuf)

            # ---- B lane: B (input gradient) or BW (both), re-running the stage from its saved input
            def backward(fused, gw, go, loss, gbuf):
                m, r, i, j = c[B_M], c[B_R], c[B_X], c[B_G]
                first, last = (r == 0) & (s == 0), (r == R - 1) & (s == S - 1)
                x, wr, ks = read(xbuf, i), chunk(w, r), stage_keys(m, r)

                def head(go, loss, gbuf):  # last virtual stage: loss and its head's vjp, the seed
                    y = run_stage(wr, ok[r], x, ks)
                    l_m, vjp = jax.vjp(lambda o, y: head_loss(o, y, tgt[m]), {k: outer[k] for k in ("wte", "ln_f")}, y)
                    d_o, dy = vjp(seed)
                    return _add(go, d_o), loss + l_m, write(gbuf, dy.astype(gbuf.dtype), j)

                go, loss, gbuf = jax.lax.cond(last, head, lambda *a: a, go, loss, gbuf)
                g = read(gbuf, j)
                if fused:
                    _, vjp = jax.vjp(lambda wr, x: run_stage(wr, ok[r], x, ks), wr, x)
                    dw, dx = vjp(g)
                    gw = add_chunk(gw, dw, r)
                else:
                    _, vjp = jax.vjp(lambda x: run_stage(wr, ok[r], x, ks), x)
                    (dx,) = vjp(g)

                def embed_grad(go):  # virtual stage 0: dx through the lookup into wte / wpe
                    _, vjp_e = jax.vjp(lambda o: embed({**outer, **o}, tok[m], m), {k: outer[k] for k in ("wte", "wpe")})
                    (d_o,) = vjp_e(dx)
                    return _add(go, d_o)

                go = jax.lax.cond(first, embed_grad, lambda go: go, go)
                return gw, go, loss, gbuf, resid(dx)

            gw, go, loss, gbuf, dx = jax.lax.switch(
                c[B_KIND], [lambda gw, go, loss, gbuf: (gw, go, loss, gbuf, act()),
                            lambda *a: backward(False, *a), lambda *a: backward(True, *a)], gw, go, loss, gbuf)

            # ---- W lane: the weight gradient from the saved input and output gradient
            def weights(gw):
                r = c[W_R]
                ks = stage_keys(c[W_M], r)
                _, vjp = jax.vjp(lambda wr: run_stage(wr, ok[r], read(xbuf, c[W_X]), ks), chunk(w, r))
                (dw,) = vjp(read(gbuf, c[W_G]))
                return add_chunk(gw, dw, r)

            gw = jax.lax.cond(c[W_ON] > 0, weights, lambda gw: gw, gw)

            # ---- one hop each way: activations v -> v+1, input gradients v -> v-1
            x_next = jax.lax.ppermute(y, "pipe", fwd_perm)
            g_next = jax.lax.ppermute(dx, "pipe", bwd_perm)
            return (x_next, g_next, xbuf, gbuf, gw, go, loss), None

        buf = lambda k: _varying(jnp.zeros((k, mb, T, D), policy.compute_dtype), manual)  # noqa: E731
        vary = lambda tree: jax.tree.map(lambda a: _varying(a, manual), tree)  # noqa: E731
        carry = (act(), act(), buf(KX), buf(KG), vary(f32_zeros(w)), vary(f32_zeros(outer)),
                 vary(jnp.zeros((), jnp.float32)))
        with activation_rules(jax.sharding.get_abstract_mesh(), lay.pipeline_rules):
            (_, _, _, _, gw, go, loss), _ = jax.lax.scan(tick, carry, plan)
        # ---- the reductions, once per step, fp32
        gw = jax.tree.map(lambda g, gs: _reduce(g, *gs, scattered=per_layer)[:, None], gw, w_gather)
        # the first stage's lookup and the last stage's head grads of the tied wte meet in this one reduction
        go = {k: jax.tree.map(lambda g, sp, ts: _reduce(g, sp, ts, ("pipe",)), go[k], o_specs[k], o_tensor[k])
              for k in OUTER}
        loss = jax.lax.psum(loss, manual) / (M * n_rows)
        return loss, gw, go

    tok_spec = P(None, batch)
    f = jax.shard_map(body, mesh=mesh,
                      in_specs=(w_specs, P(None, "pipe"), {k: o_specs[k] for k in OUTER}, tok_spec, tok_spec, P(), P()),
                      out_specs=(P(), w_specs, {k: o_specs[k] for k in OUTER}), axis_names=frozenset(manual))

    def step(params, inputs, targets, key):
        B, T = inputs.shape
        # (B, T) -> (M, B/M, T) taking every M-th row, as the GPipe schedule splits microbatches
        split = lambda a: jax.lax.with_sharding_constraint(  # noqa: E731
            a.reshape(B // M, M, T).swapaxes(0, 1), NamedSharding(mesh, P(None, batch)))
        w, back = jax.vjp(lambda h: to_stage_layout(h, layout), params["h"])
        loss, gw, go = f(w, valid, {k: params[k] for k in OUTER}, split(inputs), split(targets), jnp.asarray(rows),
                         key)
        (gh,) = back(gw)  # stage layout -> the stored (L, ...) layout (pads of non-uniform stages drop out)
        return loss, {**go, "h": gh}

    return step
