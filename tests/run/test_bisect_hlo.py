"""The model's taps (`jaxpar.models.gpt2._tap`, read by `jaxpar bisect` through nnx.capture) cost
the training step nothing: its lowered program is the same text with the taps as with taps that
are plain identities, and it returns the state and the three metrics, nothing sown."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar import config as C
from jaxpar.models import gpt2
from jaxpar.parallel.layout import build_layout
from jaxpar.train import build_trainer

CFG = C.resolve(["model=gpt2-tiny", "model.n_embd=32", "model.n_head=2", "model.vocab_size=64", "train.seq_len=16",
                 "train.batch_size=8", "precision=fp32"])


def _lowered():
    tr = build_trainer(build_layout(CFG, 1), devices=jax.devices()[:1])
    state = tr.abstract_state()
    batch = jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=tr.batch_sharding)
    return tr.step_fn.lower(state, batch, batch), state


def test_the_train_step_is_the_same_program_with_or_without_taps(monkeypatch):
    lowered, state = _lowered()
    text = lowered.as_text()
    monkeypatch.setattr(gpt2, "_tap", lambda module, name, value: value)
    assert _lowered()[0].as_text() == text
    main = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
    assert main.count("jax.result_info") == len(jax.tree.leaves(state)) + 3  # state + loss, grad_norm, finite


def test_a_capture_reads_every_tap_of_a_block_and_nothing_outside_one():
    mc = CFG.model
    params = gpt2.init_params(mc, 0)
    block = gpt2.Block(mc, gpt2.get_policy("fp32"), jax.tree.map(lambda a: a[0], params["h"]))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 32)), jnp.float32)
    y, got = nnx.capture(block, nnx.Intermediate)(x)
    names = sorted(".".join(map(str, p)) for p, _ in nnx.to_flat_state(got))
    # the CPU attention core keeps its scores and probs inside its custom VJP: bisect's einsum-core policy reads them
    assert names == ["attn.c_attn_out", "attn.c_proj_out", "attn.heads_out", "ln_1.y", "ln_2.y", "mlp.act_out",
                     "mlp.c_fc_out", "mlp.c_proj_out", "out", "resid_mid"]
    fresh = gpt2.Block(mc, gpt2.get_policy("fp32"), jax.tree.map(lambda a: a[0], params["h"]))
    assert np.array_equal(fresh(x), y)  # outside a capture: the same output, nothing recorded
    assert not nnx.state(fresh, nnx.Intermediate) and not hasattr(fresh, "__captures__")
