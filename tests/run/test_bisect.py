"""`jaxpar bisect` (jaxpar.run.bisection): clean pairs flag nothing, and each planted bug is named at
the first tensor it changes.

One device, in this process: a small GPT-2 (2 layers, D=32, 4 heads, vocab 64, B=8, T=16). The
torchref side is the shared reference (one run per module). The jaxpar sides run with jit
disabled: every planted bug changes the program, and op by op the ops compiled for the first run
serve every later one (a jitted side recompiles each time: ~4x slower over the 11 runs here); the
jitted path, and the CLI, are tests/run/test_bisect_mesh.py's. Each bug is planted by
monkeypatching one function of the product for one run; none is a product flag.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar import tolerances as T
from jaxpar.models import gpt2, mixed_attention
from jaxpar.run import bisection as bisect
from jaxpar.run.bisect_compare import compare, forward_order, param_order, report

# n_head 4 != n_layer 2 (a head count read for the layer count shows), B 8 != T 16
SMALL = "model=gpt2-tiny model.n_embd=32 model.n_head=4 model.vocab_size=64 train.seq_len=16"
JAX = f"jaxpar {SMALL}"
REF = f"torchref strategy=single {SMALL}"


@pytest.fixture(scope="module")
def ref():
    """(sides, params, batch, the torchref side's result) of JAX vs REF."""
    a, b, params = bisect.resolve_sides(JAX, REF)
    x, y = bisect.batch(a.cfg)
    return a, b, params, (x, y), bisect.run_side(b, params, x, y)


def bisect_jax(ref, side=None):
    """Run the jaxpar side (jit off) against the shared torchref result: (rows, one-sided, first)."""
    a, b, params, (x, y), rb = ref
    side = side or a
    with jax.disable_jit():
        ra = bisect.run_side(side, params, x, y)
    rows, one_sided = compare(ra, rb, side.cfg, b.cfg, (side.kind, b.kind))
    text, first = report(rows, one_sided, side.text, b.text)
    return rows, one_sided, first, text


def test_clean_jaxpar_vs_torchref_flags_nothing_and_lines_up_every_name(ref):
    rows, one_sided, first, text = bisect_jax(ref)
    assert first is None, text
    n_layer = ref[0].cfg.model.n_layer
    # every HF-side name is compared; the pre-softmax scores are jaxpar's alone (HF has no module there)
    assert one_sided == [f"transformer.h.{i}.attn.attn_scores" for i in range(n_layer)]
    names = [r.name for r in rows]
    assert names[:len(forward_order(n_layer)) - n_layer] == [n for n in forward_order(n_layer) if "scores" not in n]
    n_params = 2 + 12 * n_layer + 2
    assert len(rows) == len(names) == len(forward_order(n_layer)) - n_layer + 4 * n_params
    acts = [r for r in rows if "/" not in r.name and r.name != "loss"]
    assert max(r.max_rel for r in acts) <= T.TABLE["bisect.fp32.activation"].value
    assert text.splitlines()[-1] == f"clean: all {len(rows)} tensors within their bounds"


def test_clean_jaxpar_vs_hf_flags_nothing(tmp_path, ref):
    from gpt2common import hf

    cfg = ref[0].cfg
    hf.save_hf(str(tmp_path), cfg.model, gpt2.init_params(cfg.model, 7))
    a, b, params = bisect.resolve_sides("jaxpar train.seq_len=16", f"hf={tmp_path} train.seq_len=16")
    assert a.cfg.model == cfg.model and a.cfg.seed == 0  # the dir's shape; its weights, not init(seed)
    x, y = bisect.batch(a.cfg)
    with jax.disable_jit():
        ra = bisect.run_side(a, params, x, y)
    rows, _ = compare(ra, bisect.run_side(b, params, x, y), a.cfg, b.cfg, (a.kind, b.kind))
    text, first = report(rows, [], a.text, b.text)
    assert first is None, text


def _buggy_embed(self, tokens, key=None):
    T_ = tokens.shape[1]  # the bug: positions 1..T instead of 0..T-1
    x = gpt2._tap(self, "wte_out", self.wte.weight[...][tokens]) + gpt2._tap(
        self, "wpe_out", self.wpe.weight[...][1:T_ + 1][None])
    return gpt2._tap(self, "drop_out", self.policy.cast(x))


def _no_attention_residual(self, x, key=None):
    x = gpt2._tap(self, "resid_mid", self.attn(self.ln_1(x)))  # the bug: x + attn(...) lost its x
    x = x + self.mlp(self.ln_2(x))
    return gpt2._tap(self, "out", x)


def _off_by_one_causal_softmax(s):
    T_ = s.shape[-1]  # the bug: each query also sees the next key
    return jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T_, T_), bool), k=1), s, jnp.finfo(jnp.float32).min), axis=-1)


def _decay_everything(params):
    return jax.tree.map(lambda _: True, params)  # the bug: LayerNorm and biases decayed too


def _sum_over_positions(logits, targets):
    return gpt2.token_nll(logits, targets).sum(-1).mean()  # the bug: a sum over T, not the mean


# (monkeypatches: (object, attribute, value)...), the first tensor bisect must name
BUGS = {
    "attention scale 1/Hd, not 1/sqrt(Hd)": (
        [(m, "math", types.SimpleNamespace(sqrt=float)) for m in (gpt2, mixed_attention)],
        "transformer.h.0.attn.attn_weights"),
    "LayerNorm epsilon 1e-3, not 1e-5": (
        [(gpt2, "layer_norm", lambda x, w, b, eps, f=gpt2.layer_norm: f(x, w, b, 1e-3))], "transformer.h.0.ln_1"),
    "GELU erf, not tanh (gelu_new)": (
        [(gpt2, "gelu_tanh", lambda h: jax.nn.gelu(h, approximate=False))], "transformer.h.0.mlp.act"),
    "causal mask off by one": (
        [(gpt2, "causal_softmax", _off_by_one_causal_softmax),
         (mixed_attention, "causal_softmax", _off_by_one_causal_softmax)], "transformer.h.0.attn.attn_weights"),
    "attention residual missing": ([(gpt2.Block, "__call__", _no_attention_residual)], "transformer.h.0.ln_2:input"),
    "position embedding index shifted": ([(gpt2.GPT2, "embed", _buggy_embed)], "transformer.wpe"),
    "loss summed over positions": ([(gpt2, "cross_entropy", _sum_over_positions)], "loss"),
    "AdamW bias correction at count + 1": (
        [(optax, "safe_increment", lambda c: c + 2)], "update/transformer.ln_f.bias"),
    "weight decay on every parameter": (
        [("jaxpar.train.decay_mask", None, _decay_everything)], "update/transformer.ln_f.weight"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_is_named_where_it_first_shows(bug, ref, monkeypatch):
    patches, where = BUGS[bug]
    for obj, attr, value in patches:
        if attr is None:
            monkeypatch.setattr(obj, value)
        else:
            monkeypatch.setattr(obj, attr, value)
    rows, _, first, text = bisect_jax(ref)
    assert first is not None and first.name == where, text
    assert first.max_rel > first.bound
    assert text.splitlines()[-1].startswith(f"first over its bound: {where} (max rel ")
    before = rows[:rows.index(first)]
    assert before and not any(r.over for r in before)


def _scaled(result: dict, section: str, name: str, factor: float) -> dict:
    """A copy of one side's result with tensor `name` of `section` ("acts" or "grads") times
    `factor` (float64: the change is exactly factor - 1 relative, in every metric: inf, l2, rel)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in result.items()}
    out[section][name] = np.asarray(result[section][name], np.float64) * factor
    return out


# (kind, the row it is read at, the section of the result it lives in): one row of every kind of
# bisect_compare.bounds, so each entry of the bounds table is walked
KIND_ROWS = [("activation", "transformer.h.1.mlp.act", "acts"), ("loss", "loss", "acts"),
             ("grad", "transformer.h.0.mlp.c_fc.weight", "grads")]
# the bounds table by hand (the entries of jaxpar/tolerances.py each kind is judged by): fp32 on
# both sides, or a bf16 jaxpar side (scaled by the host's bf16 factor)
WANT = {False: {"activation": T.TABLE["bisect.fp32.activation"].value, "loss": T.TABLE["parity.fp32.loss"].value,
                "grad": T.TABLE["parity.fp32.grad"].value},
        True: {k: v * T.BF16_HOST_FACTOR for k, v in (("activation", T.TABLE["model.bf16.logits"].value),
                                                      ("loss", T.TABLE["parity.bf16.loss"].value),
                                                      ("grad", T.TABLE["parity.bf16.grad_l2"].value))}}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,row,section", KIND_ROWS, ids=[k for k, _, _ in KIND_ROWS])
def test_each_kind_is_judged_at_its_own_bound(ref, kind, row, section, bf16):
    """The bounds table walked at its boundary: a change of 0.5x its kind's bound reads clean,
    2x is named at that row with that bound in the `bound` column. The fp32 gradient bound (3e-6)
    is 2600x below the bf16 one (7.8e-3): fp32 gradient rows judged at the bf16 bound let a
    gradient-only bug up to ~1e-3 read clean. The torchref side against a copy of itself
    (no JAX run): the precision of the pair picks the bounds (a bf16 jaxpar side: bf16)."""
    import dataclasses

    a, b, _, _, rb = ref
    cfg_a = dataclasses.replace(a.cfg, precision="bf16" if bf16 else "fp32")
    bound = WANT[bf16][kind]
    name = row if section == "acts" else f"grad/{row}"
    for factor, over in ((0.5, False), (2.0, True)):
        rows, _ = compare(_scaled(rb, section, row, 1 + factor * bound), rb, cfg_a, b.cfg, ("jaxpar", b.kind))
        by = {r.name: r for r in rows}
        assert by[name].bound == pytest.approx(bound, rel=1e-12), (name, by[name])
        assert by[name].max_rel == pytest.approx(factor * bound, rel=1e-6), (name, by[name])
        first = next((r for r in rows if r.over), None)
        assert (first.name if first else None) == (name if over else None), (factor, first)
    # every row of the kind carries the same bound
    same = [r for r in rows if (r.name.startswith("grad/") if kind == "grad" else
                                r.name == "loss" if kind == "loss" else "/" not in r.name and r.name != "loss")]
    assert same and {r.bound for r in same} == {by[name].bound}


def test_a_side_that_goes_nonfinite_is_named_where_it_first_does(ref):
    """A NaN in one weight of block 1's MLP (c_fc) on one side: its activations are NaN from
    that matmul on, then the loss, every gradient and moment. NaN compares false with every bound,
    so a row must be over unless its max rel is *within* the bound: bisect names
    transformer.h.1.mlp.c_fc, with every row before it clean and every row after it over."""
    a, b, params, (x, y), rb = ref
    bad = {**params, "h": {**params["h"], "mlp": {**params["h"]["mlp"], "c_fc": dict(params["h"]["mlp"]["c_fc"])}}}
    w = np.array(bad["h"]["mlp"]["c_fc"]["weight"])  # (L, D, 4D): layer 1's first weight
    w[1, 0, 0] = np.nan
    bad["h"]["mlp"]["c_fc"]["weight"] = w
    rows, one_sided = compare(bisect.run_side(b, bad, x, y), rb, b.cfg, b.cfg, (b.kind, b.kind))
    text, first = report(rows, one_sided, b.text + " (NaN)", b.text)
    assert first is not None and first.name == "transformer.h.1.mlp.c_fc", text
    assert np.isnan(first.max_rel) and not any(r.over for r in rows[:rows.index(first)])
    # the global-norm clip spreads the NaN to every gradient, moment and update
    assert all(r.over for r in rows[rows.index(first):]), text
    assert text.splitlines()[-1].startswith("first over its bound: transformer.h.1.mlp.c_fc (max rel nan > bound ")

def test_bad_descriptions_are_one_error_line_naming_the_value(capsys):
    from jaxpar import cli

    cases = {
        ("jaxpar model=gpt2-tiny",): "bisect takes two run descriptions, A B or a=A b=B (got 'jaxpar model=gpt2-tiny')",
        ("jaxpr model=gpt2-tiny", "torchref strategy=single"):
            "a='jaxpr model=gpt2-tiny': a run description starts with jaxpar, torchref or hf=DIR",
        ("jaxpar model=gpt2-tiny", "torchref strategy=horovod model=gpt2-tiny"):
            "b='torchref strategy=horovod model=gpt2-tiny': bisect runs torchref in one process: give strategy=single",
        ("jaxpar model=gpt2-tiny", "torchref strategy=single mesh.data=2"):
            "b='torchref strategy=single mesh.data=2': key(s) mesh.data are jaxpar's; a torchref side takes "
            "model, model.*, seed and train.*",
        ("a=jaxpar model=gpt2-tiny", "b=jaxpar model=gpt2-tiny seed=1"):
            "a and b must start from the same weights and batch: seed is 0 in a='jaxpar model=gpt2-tiny' and 1 in "
            "b='jaxpar model=gpt2-tiny seed=1'",
        ("jaxpar model=gpt2-tiny", "hf=/nonexistent/dir"):
            "b: hf='/nonexistent/dir' is not an HF save_pretrained dir (no config.json)",
    }
    for argv, line in cases.items():
        assert cli.main(["bisect", *argv]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {line}\n", err


def test_the_batch_is_a_pure_function_of_seed_and_shape(ref):
    x, y = bisect.batch(ref[0].cfg)
    assert x.shape == y.shape == (8, 16) and x.dtype == np.int32
    assert (x[:, 1:] == y[:, :-1]).all() and 0 <= x.min() and x.max() < 64
    assert (bisect.batch(ref[0].cfg)[0] == x).all()


def test_main_prints_the_table_and_exits_1_at_the_first_tensor_over(tmp_path, ref, capsys):
    """`main` as the CLI calls it, on the two torch sides (no JAX): twice the learning rate leaves the
    forward, gradients and moments alone and doubles the update."""
    from gpt2common import hf

    cfg = ref[0].cfg
    hf.save_hf(str(tmp_path), cfg.model, gpt2.init_params(cfg.model, 0))
    a, b = "torchref strategy=single train.seq_len=16 train.lr=2e-3", f"hf={tmp_path} train.seq_len=16 train.lr=1e-3"
    assert bisect.main([f"a={a}", f"b={b}"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [f"a: {a}", f"b: {b}", ""]
    assert lines[3].split() == ["tensor", "shape", "max", "abs", "max", "rel", "bound", "verdict"]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[4:-1]}
    assert list(rows) == [n for n in forward_order(2) if "scores" not in n] + [
        f"{k}/{n}" for k in ("grad", "adam.mu", "adam.nu", "update") for n in param_order(2)[::-1]]
    assert rows["transformer.h.0.attn.attn_weights"][0] == "8x4x16x16" and rows["lm_head"][0] == "8x16x64"
    assert rows["transformer.h.0.attn.attn_weights"][1:] == ["0.00e+00", "0.00e+00", "3.00e-06", "ok"]
    over = [name for name, cols in rows.items() if cols[-1] == "OVER"]
    assert over[0] == "update/transformer.ln_f.bias" and all(n.startswith("update/") for n in over)
    assert lines[-1].startswith("first over its bound: update/transformer.ln_f.bias (max rel 1.00e+00 > bound ")
