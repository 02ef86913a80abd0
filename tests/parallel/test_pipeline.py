"""Pipeline parallelism: schedule arithmetic, stage layout, config errors, forward ==
sequential layer loop, and pipelined training == single device (fp32, 8 emulated CPU devices).

Multi-device work runs in one subprocess per fixture (XLA's device count must be set before
JAX initialises); the tests assert on the JSON it writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.config import PRESETS, Config, ConfigError, MeshConfig, PipelineConfig, TrainConfig
from jaxpar.parallel.layout import build_layout, make_stage_layout
from jaxpar.parallel.pipeline import bubble_theory, n_iterations, schedule_table
from jaxpar.tolerances import PIPELINE_FORWARD, SHARDED_VS_SINGLE

STEPS = 5
# name -> (mesh sizes, pipeline settings, n_layer)
CASES = {
    "pipe=2/gpipe": ({"pipe": 2}, {"microbatches": 4}, 4),
    "pipe=2/circular-R2": ({"pipe": 2}, {"microbatches": 4, "schedule": "circular", "repeats": 2}, 8),
    "pipe=4/gpipe": ({"pipe": 4}, {"microbatches": 4}, 4),
    "pipe=4/circular-R2": ({"pipe": 4}, {"microbatches": 4, "schedule": "circular", "repeats": 2}, 8),
    "data=2,tensor=2,pipe=2": ({"data": 2, "tensor": 2, "pipe": 2}, {"microbatches": 2}, 4),
    "fsdp=2,pipe=2/circular-R2": ({"fsdp": 2, "pipe": 2}, {"microbatches": 2, "schedule": "circular",
                                                           "repeats": 2}, 4),
    # the chunked MLP's scan inside the pipeline's shard_map (its carry once failed to trace there);
    # compared with the plain single-device model: chunking is exact to 1e-6 (jaxpar.tolerances)
    "pipe=2/gpipe,mlp_chunks=2": ({"pipe": 2}, {"microbatches": 4}, 4, {"mlp_chunks": 2}),
    # bf16: the chunked MLP's hand-written backward (jaxpar.models.chunked._chunk_scan_fp32_dx, bf16 only) inside the
    # pipeline's shard_map, against one device with mlp_chunks=2 too (jaxpar.tolerances sharded.bf16.*).
    # Measured on the AMD Zen 4 host: loss 7.44e-5 (bound 1e-4), grad 1.04e-2 (2e-2, ln_1.bias); slow-marked
    # (not in FAST) until another host kind has measured it: 74% of the loss bound on the one kind measured.
    # It fails on the backward's carry built with jnp.zeros instead of zeros_like (a scan carry type error
    # under shard_map), which every single-device test passes; the reference shares the chunked code, so
    # a bug in the backward's math is test_ops' to catch
    "pipe=2/gpipe,mlp_chunks=2,bf16": ({"pipe": 2}, {"microbatches": 4}, 4, {"mlp_chunks": 2}, "bf16"),
    # pipeline.gather=layer: fsdp weights gathered per layer inside the checkpointed stage (their
    # grads reduce-scattered per iteration, the data psum on the 1/f shards), circular schedule
    "data=2,fsdp=2,pipe=2/circular-R2,gather=layer": ({"data": 2, "fsdp": 2, "pipe": 2},
                                                      {"microbatches": 2, "schedule": "circular", "repeats": 2,
                                                       "gather": "layer"}, 4),
}
# 2×2×2 is also checked end to end (jaxpar train == one device) in test_pipeline_cli.py.
# pipe=4/circular-R2 (8 layers, the costliest compile) is slow: circular R=2 runs here with gather=layer
FAST = ("pipe=2/gpipe,mlp_chunks=2", "data=2,fsdp=2,pipe=2/circular-R2,gather=layer")


def tiny(n_layer: int):
    return dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=n_layer)


# ----------------------------------------------------------------------------- subprocess workers


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _train_worker(names: list[str]) -> dict:
    import jax

    from jaxpar.models import gpt2
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.run.evaluation import mean_loss
    from jaxpar.train import build_trainer, make_loss_fn

    devs = jax.devices()
    assert len(devs) == 8, devs
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (2, 8, 32), dtype=np.int32)] * STEPS  # one batch, memorised: loss falls

    def run(sizes, pipe_kw, n_layer, train_kw=None, precision="fp32"):
        """5 AdamW steps; grads at step 1. One compile of the sharded value_and_grad (the part under
        test); the optimizer update is a separate, cheap jit (train.step_fn composes the same two)."""
        import optax

        model = tiny(n_layer)
        tc = TrainConfig(steps=STEPS, batch_size=8, seq_len=32, lr=1e-3, warmup_steps=0, **(train_kw or {}))
        cfg = Config(model=model, mesh=MeshConfig(**sizes), pipeline=PipelineConfig(**pipe_kw), train=tc,
                     precision=precision)
        mesh = build_mesh(cfg.mesh, devs[:int(np.prod(list(sizes.values())))] if sizes else devs[:1])
        tr = build_trainer(build_layout(cfg, mesh.devices.size), mesh)
        loss_fn = make_loss_fn(tr.layout, mesh)
        psh = tr.state_shardings["params"]
        vg = jax.jit(jax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, None)),
                     in_shardings=(psh, tr.batch_sharding, tr.batch_sharding), out_shardings=(None, psh))
        update = jax.jit(lambda g, o, p: (lambda u, o2: (optax.apply_updates(p, u), o2))(*tr.tx.update(g, o, p)))
        state = tr.init_state(gpt2.init_params(model, 0))
        # the one eval path (loop's val_loss and `jaxpar eval`) on the initial params, and whether
        # its step runs the pipeline schedule (a collective-permute between stages)
        x0, y0 = tr.put_batch(batches[0][0]), tr.put_batch(batches[0][1])
        total, n = mean_loss(tr.eval_fn, tr.put_batch, state["params"], [batches[0]], 8)
        ev = {"loss": total / n, "permutes": tr.eval_fn.lower(state["params"], x0, y0).as_text().count("collective_permute")}
        params, opt, losses, g0 = state["params"], state["opt_state"], [], None
        for x, y in batches:
            loss, g = vg(params, tr.put_batch(x), tr.put_batch(y))
            g0 = g if g0 is None else g0
            losses.append(float(loss))
            params, opt = update(g, opt, params)
        g0 = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(g0)[0]}
        return losses, g0, str(psh["h"]["mlp"]["c_fc"]["weight"].spec), ev

    out, refs = {}, {}
    for name in names:
        sizes, pipe_kw, n_layer, *rest = CASES[name]
        train_kw = rest[0] if rest else None
        precision = rest[1] if len(rest) > 1 else "fp32"
        # fp32 against the plain model (chunking is exact to 1e-6); bf16 against one device with the same
        # train settings: chunking's own bf16 difference has its bound (tests/models/test_chunked.py), not this one
        ref_kw = None if precision == "fp32" else train_kw
        key = (n_layer, precision, str(ref_kw))
        if key not in refs:
            refs[key] = run({}, {}, n_layer, ref_kw, precision)
        ref_l, ref_g, _, ref_ev = refs[key]
        losses, g, spec, ev = run(sizes, pipe_kw, n_layer, train_kw, precision)
        out[name] = {"precision": precision, "losses": losses, "ref_losses": ref_l, "eval": ev, "ref_eval": ref_ev,
                     "loss_rel": [abs(a - b) / abs(b) for a, b in zip(losses, ref_l)],
                     "grad_rel": {k: _rel(g[k], ref_g[k]) for k in ref_g}, "c_fc_spec": spec}
    return out


def _forward_worker() -> dict:
    """pipeline_blocks vs the model's own sequential layer scan (`GPT2.blocks`) on one device, several layouts."""
    import jax
    import jax.numpy as jnp

    from jaxpar.models import gpt2
    from jaxpar.models.precision import get_policy
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.parallel.pipeline import pipeline_blocks, to_stage_layout

    pol = get_policy("fp32")
    out = {}
    # (name, mesh sizes, layers per virtual stage, repeats, microbatches)
    for name, sizes, lps, R, M in [("S4-nonuniform-3,2,2,1-M2", {"pipe": 4}, (3, 2, 2, 1), 1, 2),
                                   ("S2-circular-R2-M4", {"pipe": 2}, (1, 1, 1, 1), 2, 4),  # parked in buffer
                                   ("S2-circular-R2-M1", {"pipe": 2}, (1, 2, 1, 1), 2, 1)]:  # M < S, padded
        L = sum(lps)
        mc = tiny(L)
        params = gpt2.init_params(mc, 1)
        x = np.random.default_rng(2).standard_normal((8, 32, mc.n_embd)).astype(np.float32)
        ref = jax.jit(lambda p, xx: gpt2.GPT2(mc, p, policy=pol).blocks(xx))(params, x)
        mesh = build_mesh(MeshConfig(**sizes), jax.devices()[:sizes["pipe"]])
        S = sizes["pipe"]
        lay = build_layout(Config(model=mc, mesh=MeshConfig(**sizes), train=TrainConfig(batch_size=8, seq_len=32),
                                  pipeline=PipelineConfig(microbatches=M, repeats=R, layers_per_stage=lps,
                                                          schedule="circular" if R > 1 else "gpipe")), S)
        assert lay.stages.layers_per_stage == lps
        f = jax.jit(lambda h, xx: pipeline_blocks(mc, pol, mesh, lay, to_stage_layout(h, lay.stages), xx, M))
        y = f(params["h"], jnp.asarray(x))
        out[name] = {"rel": _rel(np.asarray(y), np.asarray(ref)), "layers": L}
    return out


def _run_worker(tmp_path, kind: str, *names: str) -> dict:
    from support.cli_helpers import run_worker

    return run_worker(__file__, tmp_path, kind, *names)


# ----------------------------------------------------------------------------- schedule / layout (no devices)


def test_schedule_counts_match_theory():
    for S, M, R in [(2, 4, 1), (4, 8, 1), (4, 4, 2), (2, 8, 3), (4, 1, 1), (4, 2, 2)]:
        tab = schedule_table(S, M, R)
        N = n_iterations(S, M, R)
        busy = (tab[..., 0] >= 0).sum(0)
        assert tab.shape == (N, S, 2) and (busy == R * M).all()  # every stage does each (r, m) once
        idle = 1 - busy.sum() / (N * S)
        assert idle == pytest.approx(bubble_theory(S, M, R))
        if M >= S:
            assert N == R * M + S - 1 and idle == pytest.approx((S - 1) / (R * M + S - 1))
        for s in range(S):  # each stage sees (r, m) in order, one step after the previous stage
            seen = [tuple(v) for v in tab[:, s] if v[0] >= 0]
            assert seen == [(r, m) for r in range(R) for m in range(M)]
            if s:
                assert np.argmax(tab[:, s, 0] >= 0) == np.argmax(tab[:, s - 1, 0] >= 0) + 1


def test_circular_feedback_arrives_before_it_is_needed():
    # Stage S-1 finishes (r, m) at t1; stage 0 starts (r+1, m) at t0 > t1 (one ppermute hop later).
    for S, M, R in [(2, 2, 2), (4, 4, 2), (2, 5, 3), (4, 2, 2)]:
        tab = schedule_table(S, M, R)
        when = {(s, tuple(v)): t for t in range(len(tab)) for s in range(S) for v in [tab[t, s]] if v[0] >= 0}
        for r in range(R - 1):
            for m in range(M):
                assert when[(0, (r + 1, m))] >= when[(S - 1, (r, m))] + 1


def test_layout_pads_and_masks_nonuniform_stages():
    lay = make_stage_layout((3, 2, 3), 3, 1)
    assert lay.lmax == 3 and not lay.uniform
    assert lay.index.tolist() == [[[0, 1, 2], [3, 4, 4], [5, 6, 7]]]
    assert lay.valid.tolist() == [[[True] * 3, [True, True, False], [True] * 3]]
    circ = make_stage_layout((1, 1, 1, 1), 2, 2)  # virtual stage v = r*S + s
    assert circ.index[:, :, 0].tolist() == [[0, 1], [2, 3]] and circ.uniform


def _cfg(n_layer=4, pipe=2, batch=8, data=1, **pipe_kw):
    return Config(model=tiny(n_layer), mesh=MeshConfig(data=data, pipe=pipe), pipeline=PipelineConfig(**pipe_kw),
                  train=TrainConfig(batch_size=batch, seq_len=32), precision="fp32")


@pytest.mark.parametrize("kw,msg", [
    (dict(pipe=4, n_layer=2), "mesh.pipe=4 stages exceed model.n_layer=2 layers"),
    (dict(layers_per_stage=(1, 2)), "pipeline.layers_per_stage=[1, 2] sums to 3, not model.n_layer=4"),
    (dict(microbatches=3), "pipeline.microbatches=3 does not divide the per-replica batch 8 "
                           "(train.batch_size=8 / mesh.data×mesh.fsdp=1 / train.grad_accum=1)"),
    (dict(microbatches=8, data=2, batch=8), "pipeline.microbatches=8 does not divide the per-replica batch 4 "
                                            "(train.batch_size=8 / mesh.data×mesh.fsdp=2 / train.grad_accum=1)"),
    (dict(schedule="circular", repeats=3), "pipeline.repeats×mesh.pipe=3×2=6 exceeds model.n_layer=4 layers"),
    (dict(repeats=2), "pipeline.repeats=2 needs pipeline.schedule=circular or interleaved (got 'gpipe')"),
    (dict(schedule="circular", repeats=2, layers_per_stage=(2, 2)),
     "pipeline.layers_per_stage=[2, 2] has 2 entries, not mesh.pipe×pipeline.repeats=4"),
])
def test_config_errors_are_one_line(kw, msg):
    with pytest.raises(ConfigError) as e:
        _layout(_cfg(**kw))
    assert str(e.value) == msg


def _layout(cfg):
    return build_layout(cfg, cfg.mesh.data * cfg.mesh.pipe)


def _lps(cfg):
    return _layout(cfg).stages.layers_per_stage


def test_auto_partition_and_bubble_warning(capsys):
    assert _lps(_cfg(microbatches=4, data=2, batch=8)) == (2, 2)  # 4 | per-replica 4
    assert _lps(_cfg(n_layer=8, pipe=3, microbatches=4)) in {(3, 3, 2), (3, 2, 3), (2, 3, 3)}
    lay = _layout(_cfg(n_layer=8, pipe=2, microbatches=4, schedule="circular", repeats=2))
    assert lay.stages.layers_per_stage == (2, 2, 2, 2) and lay.warnings == ()
    # the layout carries the warning; the command prints it once (library code prints nothing)
    assert _layout(_cfg(n_layer=4, pipe=4, microbatches=2)).warnings == (
        "warning: pipeline.microbatches=2 < mesh.pipe=4 stages: the pipeline bubble (60% of stage time idle) "
        "will dominate",)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- multi-device


@pytest.fixture(scope="module")
def forward(tmp_path_factory):
    return _run_worker(tmp_path_factory.mktemp("pipe_fwd"), "forward")


def test_pipeline_forward_equals_sequential_layer_loop(forward):
    assert len(forward) == 3
    for name, r in forward.items():
        assert r["rel"] <= PIPELINE_FORWARD, (name, r)


def _check(r):
    tol = SHARDED_VS_SINGLE[r["precision"]]
    assert len(r["losses"]) == STEPS and max(r["loss_rel"]) <= tol["loss"], r["loss_rel"]
    assert r["ref_losses"][0] - r["ref_losses"][-1] > 1e-2  # it trains: losses move far beyond the tolerance
    assert len(r["grad_rel"]) == 16
    worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
    assert worst[1] <= tol["grad"], worst
    # evaluation (train's val_loss and `jaxpar eval`: one function) runs through the pipeline and
    # equals the pipe=1 eval loss; at init the loss is near ln(256) = 5.55 (byte vocab)
    ev, ref = r["eval"], r["ref_eval"]
    assert abs(ev["loss"] - ref["loss"]) <= tol["loss"] * ref["loss"] and abs(ref["loss"] - 5.55) < 0.5, (ev, ref)
    assert ref["permutes"] == 0 and ev["permutes"] > 0, (ev, ref)


@pytest.fixture(scope="module")
def trained_fast(tmp_path_factory):
    return _run_worker(tmp_path_factory.mktemp("pipe_train"), "train", *FAST)


@pytest.mark.parametrize("name", FAST)
def test_pipelined_training_matches_single_device(trained_fast, name):
    _check(trained_fast[name])
    # the stacked layers dim is stored over pipe (GPipe stage s holds exactly its own layers)
    # (layers, embed, mlp): embed over fsdp (ZeRO-3), mlp over tensor
    want = f"P('pipe', {repr('fsdp') if 'fsdp' in name else None}, {repr('tensor') if 'tensor' in name else None})"
    assert trained_fast[name]["c_fc_spec"] == want


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in FAST])
def test_pipelined_training_matches_single_device_slow(tmp_path, name):
    _check(_run_worker(tmp_path, "train", name)[name])


def test_example_04_partitions_trains_and_prints_bubble(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # a user's own XLA flag survives the example's device count (it overwrote XLA_FLAGS): the dump appears
    dump = tmp_path / "xla_dump"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
        "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_module_re=train_step --xla_dump_hlo_pass_re=NONE"}
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "04_pipeline.py")], capture_output=True,
                       text=True, timeout=600, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert "gpt2 S=4, head on the last stage: layers_per_stage=[3, 4, 4, 1] (slowest stage 5.46 blocks)" in out
    assert "gpt2 S=5, as jaxpar runs it:   layers_per_stage=[2, 2, 2, 3, 3]" in out
    losses = [float(ln.split()[3]) for ln in out if ln.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < 0.75 * losses[0] and np.isfinite(losses).all()
    assert "bubble: theory 0.2000, counted 2/10 idle stage-iterations = 0.2000" in out
    assert any(f.name.endswith("jit_train_step.cpu_after_optimizations.txt") for f in dump.iterdir())


if __name__ == "__main__":
    kind, out_path, *names = sys.argv[1:]
    res = _forward_worker() if kind == "forward" else _train_worker(names)
    with open(out_path, "w") as f:
        json.dump(res, f)
