"""Operator splitting (jaxpar.models.chunked) and remat modes: same fp32 loss and grads as the plain model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.jaxpr_walk import all_eqns

from jaxpar.config import ConfigError, ModelConfig, Remat, resolve
from jaxpar.models import gpt2
from jaxpar.tolerances import CHUNKED_BF16_GRAD_L2, KNOBS_BF16_GRAD_L2
from jaxpar.tolerances import CHUNKED_VS_PLAIN as TOL

CFG = ModelConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=32)
B, T = 2, 16


def _batch():
    rng = np.random.default_rng(1)
    x = rng.integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    return jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:])


def _params():
    """HF init with non-zero biases: the init's zero biases would hide a chunk mixing up bias entries."""
    rng = np.random.default_rng(2)
    return jax.tree_util.tree_map_with_path(
        lambda p, v: v + rng.standard_normal(v.shape).astype(np.float32) * 0.02
        if jax.tree_util.keystr(p).endswith("['bias']") else v, gpt2.init_params(CFG, 0))


@pytest.fixture(scope="module")
def reference():
    params = _params()
    x, y = _batch()
    loss, grads = jax.value_and_grad(lambda p: gpt2.GPT2(CFG, p).loss(x, y))(params)
    return params, float(loss), grads


def _rel_grad(a, b) -> float:
    return max(float(jnp.max(jnp.abs(u - v)) / jnp.max(jnp.abs(v))) for u, v in zip(jax.tree.leaves(a),
                                                                                    jax.tree.leaves(b)))


@pytest.mark.parametrize("remat,vc,mc", [("none", 4, 4), ("selective", 2, 8), ("full", 16, 2),
                                         ("full", 1, 1)])
def test_chunked_and_remat_equal_plain(reference, remat, vc, mc):
    params, loss0, grads0 = reference
    x, y = _batch()
    model = lambda p: gpt2.GPT2(CFG, p, remat=remat, vocab_chunks=vc, mlp_chunks=mc)  # noqa: E731
    loss, grads = jax.value_and_grad(lambda p: model(p).loss(x, y))(params)
    assert abs(float(loss) - loss0) / loss0 <= TOL["loss"]
    assert _rel_grad(grads, grads0) <= TOL["grad"]


BF16_CFG = ModelConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=64)


def _bf16_grads(**knobs):
    """precision=bf16 gradients of BF16_CFG on one fixed (8, 64) batch, jitted; knobs: GPT2's remat,
    vocab_chunks, mlp_chunks."""
    x = jnp.asarray(np.random.default_rng(1).integers(0, BF16_CFG.vocab_size, (8, 65)).astype(np.int32))
    loss = lambda p: gpt2.GPT2(BF16_CFG, p, policy="bf16", **knobs).loss(x[:, :-1], x[:, 1:])  # noqa: E731
    return jax.jit(jax.grad(loss))(gpt2.init_params(BF16_CFG, 0))


def _worst_l2(a, b) -> dict[str, float]:
    """||a - b||_2 / ||b||_2 per tensor, worst first."""
    l2 = {jax.tree_util.keystr(p): float(jnp.linalg.norm(u - v) / jnp.linalg.norm(v))
          for (p, u), (_, v) in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0])}
    return dict(sorted(l2.items(), key=lambda kv: -kv[1]))


@pytest.fixture(scope="module")
def bf16_plain_grads():
    return _bf16_grads()


@pytest.mark.parametrize("chunks", [2, 32])
def test_bf16_chunked_mlp_equals_bf16_plain(bf16_plain_grads, chunks):
    """precision=bf16: the chunked MLP rounds where the plain one does, at every chunk count. It adds
    c_proj's bias in fp32 (jaxpar.models.precision.add_bias; a bf16 add sums the bias gradient over the B*T
    positions in bf16, measured 2.3e-2) and sums the chunks' input gradients in fp32 (summed in bf16:
    6.4e-3 at 2 chunks, 9.9e-3 at 32, over this bound); only fp32 sum orders differ (jaxpar.models.chunked)."""
    l2 = _worst_l2(_bf16_grads(mlp_chunks=chunks), bf16_plain_grads)
    assert max(l2.values()) <= CHUNKED_BF16_GRAD_L2, list(l2.items())[:3]


@pytest.mark.parametrize("knobs", [{"remat": "selective"}, {"remat": "full"}, {"vocab_chunks": 4},
                                   {"remat": "full", "vocab_chunks": 4, "mlp_chunks": 4}], ids=str)
def test_bf16_memory_knobs_keep_the_gradient(bf16_plain_grads, knobs):
    """precision=bf16: remat and vocab chunking change memory, not the gradient beyond bf16 noise. The
    bf16-only code under them (the fused-qkv attention core checkpointed by remat=selective, the
    chunked head on bf16 activations) against the plain bf16 model; a recomputed forward (remat=full's, and
    on jax 0.12 selective's attention core) may round q, k, v and p differently from the forward under XLA's
    excess precision, 4 operands per layer (jaxpar.tolerances knobs.bf16.grad_l2: sqrt(4*L)*U_BF16)."""
    l2 = _worst_l2(_bf16_grads(**knobs), bf16_plain_grads)
    assert max(l2.values()) <= KNOBS_BF16_GRAD_L2, list(l2.items())[:3]


def test_chunked_head_never_materialises_full_logits():
    """The jaxpr of the chunked loss holds no (B, T, V) array, forward or backward."""
    params = gpt2.init_params(CFG, 0)
    x, y = _batch()
    f = jax.grad(lambda p: gpt2.GPT2(CFG, p, vocab_chunks=4).loss(x, y))
    shapes = set()

    for eqn in all_eqns(jax.make_jaxpr(f)(params)):
        shapes.update(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    assert (B, T, CFG.vocab_size) not in shapes
    assert (B, T // 4, CFG.vocab_size) in shapes


def test_selective_saves_no_attention_scores():
    """remat=selective keeps no (B, N, T, T) residual; remat=none keeps some."""
    from jax.ad_checkpoint import print_saved_residuals  # noqa: F401  (documented counting tool)

    params = gpt2.init_params(CFG, 0)
    x, y = _batch()

    def residual_shapes(remat):
        f = lambda p: gpt2.GPT2(CFG, p, remat=remat).loss(x, y)  # noqa: E731
        _, res = jax.vjp(f, params)
        return {tuple(a.shape) for a in jax.tree.leaves(res) if hasattr(a, "shape")}

    scores = (B, CFG.n_head, T, T)
    assert any(s[-4:] == scores for s in residual_shapes("none"))
    assert not any(s[-4:] == scores for s in residual_shapes("selective"))


def test_remat_config_values():
    assert resolve(["train.remat=true"]).train.remat == "full"
    assert resolve(["train.remat=false"]).train.remat == "none"
    assert resolve(["train.remat=selective"]).train.remat == "selective"
    with pytest.raises(ConfigError, match=r"^train.remat='some' must be one of none, selective, full \(or true/false\)$"):
        resolve(["train.remat=some"])
    # the model takes the enum or its value: the bools of the old API are refused, not read as full/none
    assert gpt2.GPT2(CFG, remat="selective").remat is Remat.SELECTIVE
    for bad in (True, "true", "some"):
        with pytest.raises(ValueError, match="is not a valid Remat"):
            gpt2.GPT2(CFG, remat=bad)
    with pytest.raises(ConfigError, match=r"^train.seq_len=256 is not divisible by train.vocab_chunks=3$"):
        resolve(["train.vocab_chunks=3"])
    with pytest.raises(ConfigError, match=r"names unknown groups \(head\); choose from embed, attn, mlp$"):
        resolve(["sharding.replicate=embed,head"])
