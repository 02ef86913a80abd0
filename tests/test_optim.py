"""jaxpar.optim's one-pass AdamW tail against the optax chain it replaces (train.make_optimizer:
clip_by_global_norm -> adamw with the decay mask, then apply_updates and the whole-state select
the step used before), and the structure XLA:CPU compiles it to. fp32, small shapes.

Bit-identity is checked in a child process whose XLA:CPU codegen has no FMA instructions
(`--xla_cpu_max_isa=AVX`): XLA:CPU lets LLVM contract any a*b+c into one fused multiply-add, and
which ones it contracts depends on how each program is fused. Since jax 0.12.1 the optax chain
recomputes a moment inside the weights' fusion with a different contraction than the fusion that
stores it (1 ulp in 6 of 192 weights of a leaf after 5 steps), so with FMAs the two programs agree
only by a compiler's choice. Without them every HLO op is one IEEE rounding, and equal bits mean
the same float operations in the same order. tests/test_properties_optim.py bounds the default
codegen's values against optax and torch over the whole input space.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar import config as C
from jaxpar import optim, train
from jaxpar.models import gpt2
from jaxpar.parallel.layout import build_layout

MC = C.ModelConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
TC = C.TrainConfig(steps=6, warmup_steps=2, lr=3e-2, weight_decay=0.1, grad_clip=1.0)


def tree(seed, scale):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, scale, s.shape).astype(np.float32)),
                        gpt2.abstract_params(MC))


@functools.cache  # one compile per config across the tests
def reference(tc):
    """The step's tail before jaxpar.optim: optax update, apply, select on loss/grad/new-weight norms."""
    tx = train.make_optimizer(tc)

    def tail(params, opt_state, grads, loss):
        grad_norm = optax.tree.norm(grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(new_params))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt, opt_state)

    return jax.jit(tail)


@functools.cache
def fused(tc):
    update = optim.make_update(tc, train.lr_schedule(tc), train.decay_mask)

    def tail(params, opt_state, grads, loss):
        grad_norm = optax.tree.norm(grads)
        return update(grads, grad_norm, opt_state, params, jnp.isfinite(loss) & jnp.isfinite(grad_norm))

    return jax.jit(tail, donate_argnums=(0, 1))


def run(tail, tc, grad_scales, losses=None):
    params = tree(0, 0.5)
    opt_state = train.make_optimizer(tc).init(params)
    for k, s in enumerate(grad_scales):
        loss = jnp.float32(np.nan if losses and losses[k] else 2.0)
        params, opt_state = tail(params, opt_state, tree(10 + k, s), loss)
    return jax.tree.map(np.asarray, (params, opt_state))


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb) >= 16
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


CASES = ["clip_active", "clip_inactive", "no_clip_no_decay", "nonfinite_step"]
NO_FMA = "--xla_cpu_max_isa=AVX"  # AVX has no FMA3: LLVM emits each multiply and add on its own


# grads ~N(0, 0.1) over ~28k weights: norm ~17 -> clipped; N(0, 1e-4): norm ~0.017 -> not clipped.
def case_config(case):
    """(tc, gradient scales, non-finite losses) of `case`: 5 steps, warmup into cosine."""
    tc = {"no_clip_no_decay": dataclasses.replace(TC, grad_clip=0.0, weight_decay=0.0)}.get(case, TC)
    scales = [1e-4] * 5 if case == "clip_inactive" else [0.1, 1e-4, 0.1, 0.1, 1e-4]
    losses = [0, 0, 1, 0, 0] if case == "nonfinite_step" else None  # step 3 skipped: counts stay behind
    return tc, scales, losses


@pytest.fixture(scope="module")
def no_fma_runs(tmp_path_factory):
    """{case: (want, got)}, the optax chain's and jaxpar.optim's (params, opt_state) after 5 steps,
    computed by this file run as a script under NO_FMA (XLA_FLAGS is read once, when the CPU backend
    starts) and rebuilt here from their leaves."""
    out = tmp_path_factory.mktemp("no_fma") / "runs.npz"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {NO_FMA}".strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=root)
    r = subprocess.run([sys.executable, __file__, str(out)], env=env, cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = {}
    with np.load(out) as z:
        for c in CASES:
            params = tree(0, 0.5)
            structure = jax.tree.structure((params, train.make_optimizer(case_config(c)[0]).init(params)))
            for side in ("want", "got"):  # each side's leaf count is the optimizer's own: no leaf added or lost
                assert sum(k.startswith(f"{c}/{side}/") for k in z.files) == structure.num_leaves, (c, side)
            runs[c] = tuple(jax.tree.unflatten(structure, [z[f"{c}/{side}/{i}"] for i in range(structure.num_leaves)])
                            for side in ("want", "got"))
    return runs


@pytest.mark.parametrize("case", CASES)
def test_bit_identical_to_the_optax_chain(case, no_fma_runs):
    want, got = no_fma_runs[case]
    assert_bit_equal(got, want)
    count = jax.tree.leaves(got[1])[0]  # the first leaf of the chain's state: ScaleByAdamState.count
    assert int(count) == (4 if case == "nonfinite_step" else 5)
    p0 = tree(0, 0.5)
    assert not np.array_equal(got[0]["wte"]["weight"], p0["wte"]["weight"])  # the weights moved


def test_nonfinite_loss_or_grad_keeps_the_whole_state_and_a_bad_weight_keeps_its_value():
    tc = dataclasses.replace(TC, eps=0.0)
    update = jax.jit(optim.make_update(tc, train.lr_schedule(tc), train.decay_mask))
    params = tree(0, 0.5)
    opt_state = train.make_optimizer(tc).init(params)
    grads = tree(1, 0.1)
    norm = optax.tree.norm(grads)
    p, s = update(grads, norm, opt_state, params, jnp.bool_(False))  # loss or grad norm not finite:
    assert_bit_equal((p, s), (params, opt_state))  # nothing changes, counts included
    # eps=0 and a zero gradient: mu = nu = 0 and 0/0 for those weights only; they keep their values
    grads["wpe"]["weight"] = grads["wpe"]["weight"].at[3].set(0.0)
    p, s = update(grads, optax.tree.norm(grads), opt_state, params, jnp.bool_(True))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((p, s)))
    wpe, wpe0 = np.asarray(p["wpe"]["weight"]), np.asarray(params["wpe"]["weight"])
    np.testing.assert_array_equal(wpe[3], wpe0[3])
    assert (wpe[:3] != wpe0[:3]).all() and int(jax.tree.leaves(s)[0]) == 1  # (the old step dropped it whole)


def fusions_by_shape(hlo: str) -> dict[str, int]:
    """Count of fusions and copies in a compiled module by output shape (e.g. 'f32[2,32,128]'),
    less the gradient norm's squares (XLA:CPU materialises g*g before some reductions)."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (f32\[[\d,]*\])\{[\d,]*\} (?:fusion|copy)\(", line)
        if m and "/square" not in line:
            out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def test_one_pass_per_state_array_in_the_compiled_tail():
    """Per parameter leaf (all leaves here have distinct shapes but the (L, D) LayerNorm/bias ones):
    the clipped gradient, mu, nu and the params are one fusion each; no copy of an array, and no
    reduction other than the gradient norm. The optax chain with its select compiled to 8."""
    params = tree(0, 0.5)
    opt_state = train.make_optimizer(TC).init(params)
    args = (params, opt_state, tree(1, 0.1), jnp.float32(2.0))
    shape = f"f32[{MC.n_layer},{MC.n_embd},{4 * MC.n_embd}]"  # h.mlp.c_fc.weight
    hlo = fused(TC).lower(*args).compile().as_text()
    new, old = fusions_by_shape(hlo), fusions_by_shape(reference(TC).lower(*args).compile().as_text())
    assert (new[shape], old[shape]) == (4, 7)
    no_clip = dataclasses.replace(TC, grad_clip=0.0)
    assert fusions_by_shape(fused(no_clip).lower(*args).compile().as_text())[shape] == 3
    reductions = re.findall(r"^\s*%\S+ = f32\[\] fusion\(", hlo, re.M)
    assert len(reductions) <= len(jax.tree.leaves(params))  # one per gradient leaf (the norm), no more


def test_the_train_step_reads_each_moment_once():
    """In the compiled train step, each mu/nu argument is read by exactly one op (its update fusion):
    a second pass over the optimizer state (a select after the update, a norm of the new state)
    would read it again or copy it."""
    cfg = C.resolve(["model=gpt2-tiny", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                     "model.vocab_size=64", "train.seq_len=16", "train.batch_size=2", "precision=fp32"])
    tr = train.build_trainer(build_layout(cfg, jax.device_count()))
    state = tr.abstract_state()
    x = jax.ShapeDtypeStruct((2, 16), jnp.int32, sharding=tr.batch_sharding)
    hlo = tr.step_fn.lower(state, x, x).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    moments = re.findall(r"^\s*(%\S*(?:__mu__|__nu__)\S*) = f32\[", entry, re.M)
    assert len(moments) == 2 * len(jax.tree.leaves(state["params"]))
    for name in moments:
        readers = re.findall(r"^\s*%\S+ = .*\b(fusion|copy|select)\(.*" + re.escape(name) + r"[,)]", entry, re.M)
        assert readers == ["fusion"], (name, readers)


if __name__ == "__main__":  # the child of `no_fma_runs`: python tests/test_optim.py OUT.npz
    arrays = {}
    for c in CASES:
        tc, scales, losses = case_config(c)
        for side, tail in (("want", reference(tc)), ("got", fused(tc))):
            arrays.update({f"{c}/{side}/{i}": x for i, x in enumerate(jax.tree.leaves(run(tail, tc, scales, losses)))})
    np.savez(sys.argv[1], **arrays)
