"""`jaxpar bisect`'s model-key rule, as `train init=`'s: beside an hf=DIR side a model key is refused only
when it sets another shape than the weights (named, with the weights' values); keys that agree or set no
shape pass, and two sides that differ in a key that sets no shape (model.layer_norm_epsilon) are compared,
not refused: that difference is what bisect is for. Before, every model key beside hf= was refused
("model keys conflict with hf=...") and so were sides differing in layer_norm_epsilon or attention.

A small GPT-2 (2 layers, D=32, 2 heads, vocab 64; B=8, T=16); the compared runs are torch sides only
(no JAX, about a second each)."""

from __future__ import annotations

import pytest

from gpt2common import hf
from gpt2common.init import init_params
from jaxpar.run import bisection as bisect
from jaxpar.run.bisect_compare import compare, report

SMALL = "model=gpt2-tiny model.n_embd=32 model.n_head=2 model.vocab_size=64 train.seq_len=16"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """An HF dir of SMALL's shape (layer_norm_epsilon 1e-5, the preset's)."""
    a, _, _ = bisect.resolve_sides(f"jaxpar {SMALL}", f"jaxpar {SMALL}")
    d = tmp_path_factory.mktemp("hf")
    hf.save_hf(str(d), a.cfg.model, init_params(a.cfg.model, 3))
    return str(d), a.cfg.model


@pytest.mark.parametrize("keys", [SMALL, "model.dropout=0 model.attention=xla train.seq_len=16",
                                  "model.n_layer=2 model.layer_norm_epsilon=1e-3 train.seq_len=16"])
def test_model_keys_beside_hf_that_agree_or_set_no_shape_are_taken(hf_dir, keys):
    d, mc = hf_dir
    a, b, _ = bisect.resolve_sides(f"jaxpar {keys}", f"hf={d} train.seq_len=16")
    shape = [(f, getattr(mc, f)) for f in bisect.SHAPE_KEYS]
    assert [(f, getattr(a.cfg.model, f)) for f in bisect.SHAPE_KEYS] == shape == [
        (f, getattr(b.cfg.model, f)) for f in bisect.SHAPE_KEYS]
    given = dict(kv.split("=") for kv in keys.split())
    assert a.cfg.model.attention == given.get("model.attention", "auto")
    assert a.cfg.model.layer_norm_epsilon == float(given.get("model.layer_norm_epsilon", mc.layer_norm_epsilon))


@pytest.mark.parametrize("keys,shown,theirs", [
    ("model.n_layer=3", "model.n_layer=3", "n_layer=2"),
    ("model=gpt2-tiny", "model=gpt2-tiny", "n_embd=32, n_head=2, vocab_size=64"),
    ("model=gpt2-tiny model.n_embd=32 model.n_head=4", "model=gpt2-tiny, model.n_head=4", "n_head=2, vocab_size=64"),
])
def test_a_model_key_that_sets_another_shape_than_the_weights_is_refused_naming_it(hf_dir, keys, shown, theirs, capsys):
    from jaxpar import cli

    d, _ = hf_dir
    assert cli.main(["bisect", f"jaxpar {keys} train.seq_len=16", f"hf={d} train.seq_len=16"]) == 2
    assert capsys.readouterr().err == (f"error: a='jaxpar {keys} train.seq_len=16': model keys conflict with hf={d!r}, "
                                       f"whose weights set the model's shape: {shown} (the weights have {theirs})\n")


def test_sides_differing_in_layer_norm_epsilon_are_compared_and_the_first_layernorm_is_named(hf_dir):
    """eps 1e-2 vs the dir's 1e-5 on the hf side itself (passed to from_pretrained): the embeddings agree,
    the first LayerNorm (h.0.ln_1) is the first tensor over its bound."""
    d, _ = hf_dir
    a, b, params = bisect.resolve_sides(f"hf={d} model.layer_norm_epsilon=1e-2 train.seq_len=16",
                                        f"torchref strategy=single {SMALL}")
    assert (a.cfg.model.layer_norm_epsilon, b.cfg.model.layer_norm_epsilon) == (1e-2, 1e-5)
    x, y = bisect.batch(a.cfg)
    rows, one_sided = compare(bisect.run_side(a, params, x, y), bisect.run_side(b, params, x, y), a.cfg, b.cfg,
                              (a.kind, b.kind))
    text, first = report(rows, one_sided, a.text, b.text)
    assert first is not None and first.name == "transformer.h.0.ln_1", text
    assert not any(r.over for r in rows[:rows.index(first)])
