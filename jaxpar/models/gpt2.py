"""GPT-2 in flax NNX, identical in architecture to HF transformers' GPT2LMHeadModel.

Pre-LayerNorm blocks, learned positions, tanh-approximate GELU ("gelu_new"), tied
input/output embedding, attention scaled by 1/sqrt(head_dim), residual projections
initialised with std 0.02/sqrt(2*n_layer) as HF does. No parallelism here: parameters
carry logical axis names (`axes` metadata, see `param_axes`) and key activations are
annotated with `constrain`; the sharding rules decide what those names mean.

Parameters are a plain nested dict using HF's names (`weight`, `bias`), with the
transformer blocks stacked on a leading `layers` dim and run with `lax.scan`, so
compile time does not grow with depth. Shapes (L layers, D=n_embd, N heads,
Hd=head_dim, F=4D, V vocab, P positions):

  wte.weight (V, D)                       wpe.weight (P, D)
  h.ln_1.{weight,bias} (L, D)             h.ln_2.{weight,bias} (L, D)
  h.attn.c_attn.weight (L, D, 3, N, Hd)   h.attn.c_attn.bias (L, 3, N, Hd)
  h.attn.c_proj.weight (L, N, Hd, D)      h.attn.c_proj.bias (L, D)
  h.mlp.c_fc.weight (L, D, F)             h.mlp.c_fc.bias (L, F)
  h.mlp.c_proj.weight (L, F, D)           h.mlp.c_proj.bias (L, D)
  ln_f.{weight,bias} (D,)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpt2common.init import init_params, param_shapes  # noqa: F401  (numpy, shared with torchref)
from jaxpar import ops
from jaxpar.activations import gelu_tanh
from jaxpar.config import ModelConfig
from jaxpar.logical import constrain
from jaxpar.precision import Policy, get_policy

Params = dict[str, Any]

# Logical axes of one block's parameters (the stacked copy prepends "layers").
BLOCK_AXES: Params = {
    "ln_1": {"weight": ("embed",), "bias": ("embed",)},
    "attn": {
        "c_attn": {"weight": ("embed", None, "heads", "head_dim"), "bias": (None, "heads", "head_dim")},
        "c_proj": {"weight": ("heads", "head_dim", "embed"), "bias": ("embed",)},
    },
    "ln_2": {"weight": ("embed",), "bias": ("embed",)},
    "mlp": {
        "c_fc": {"weight": ("embed", "mlp"), "bias": ("mlp",)},
        "c_proj": {"weight": ("mlp", "embed"), "bias": ("embed",)},
    },
}


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def param_axes(cfg: ModelConfig | None = None) -> Params:
    """Logical axis names of every parameter, same tree as the params."""
    return {
        "wte": {"weight": ("vocab", "embed")},
        "wpe": {"weight": ("seq", "embed")},
        "h": jax.tree.map(lambda a: ("layers", *a), BLOCK_AXES, is_leaf=_is_axes),
        "ln_f": {"weight": ("embed",), "bias": ("embed",)},
    }


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> Params:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg), is_leaf=_is_axes)


def count_params(params: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------- modules


def _param(value, axes) -> nnx.Param:
    return nnx.Param(value, axes=axes)


def _dropout(x, rate: float, key):
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


class LayerNorm(nnx.Module):
    """LayerNorm with fp32 statistics; returns the input's dtype."""

    def __init__(self, p: Params, axes: Params, eps: float):
        self.weight, self.bias, self.eps = _param(p["weight"], axes["weight"]), _param(p["bias"], axes["bias"]), eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]
        return y.astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention; c_attn column-wise, c_proj row-wise in (in, out) layout."""

    def __init__(self, cfg: ModelConfig, p: Params, axes: Params, policy: Policy):
        self.c_attn_w = _param(p["c_attn"]["weight"], axes["c_attn"]["weight"])
        self.c_attn_b = _param(p["c_attn"]["bias"], axes["c_attn"]["bias"])
        self.c_proj_w = _param(p["c_proj"]["weight"], axes["c_proj"]["weight"])
        self.c_proj_b = _param(p["c_proj"]["bias"], axes["c_proj"]["bias"])
        self.policy, self.dropout = policy, cfg.dropout
        self.impl = attention_impl(cfg.attention, policy, cfg.dropout)
        self.remat_core = False  # remat=selective: recompute scores/softmax/probs·V in backward

    def __call__(self, x, key=None):  # x: (B, T, D) compute dtype
        pol = self.policy
        # (B, T, D) x (D, 3, N, Hd) -> (B, T, 3, N, Hd)
        qkv = pol.linear("btd,dcnh->btcnh", x, self.c_attn_w[...], self.c_attn_b[...])
        q, k, v = (constrain(qkv[:, :, i], ("batch", "seq", "heads", "head_dim")) for i in range(3))
        k1 = None
        if key is not None:
            k1, key = jax.random.split(key)
        # selective remat saves q, k, v and o only: the (B, N, T, T) scores and probs are recomputed
        core = self._core if self.impl == "einsum" else self._sdpa
        core = jax.checkpoint(core, prevent_cse=False) if self.remat_core else core
        o = core(q, k, v, k1)
        # (B, T, N, Hd) x (N, Hd, D) -> (B, T, D): row-parallel under tensor sharding
        y = pol.linear("btnh,nhd->btd", o, self.c_proj_w[...], self.c_proj_b[...])
        return _dropout(y, self.dropout, key)

    def _sdpa(self, q, k, v, key):  # jax.nn.dot_product_attention (no dropout: see attention_impl)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.impl)

    def _core(self, q, k, v, key):  # (B, T, N, Hd) x3 -> (B, T, N, Hd)
        pol = self.policy
        T, hd = q.shape[1], q.shape[-1]
        # Scores and softmax in fp32: (B, N, T, T)
        s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))
        s = jnp.where(causal, s, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(s, axis=-1)
        if key is not None:
            probs = _dropout(probs, self.dropout, key)
        # batched dots stay compute-dtype out: XLA:CPU's generic dot (batched dots land there)
        # has no bf16 x bf16 -> fp32 kernel ("Unsupported element type for DotThunk")
        return jnp.einsum("bnts,bsnh->btnh", probs.astype(pol.compute_dtype), v)


def attention_impl(choice: str, policy: Policy, dropout: float) -> str:
    """model.attention -> "einsum" (jaxpar's core above) | "xla" | "cudnn" (jax.nn.dot_product_attention).

    auto: cuDNN flash attention on GPU when it applies (bf16 operands; it has no attention
    dropout), else the einsum core, whose matmuls follow the precision policy (fp32-output
    bf16 dots on CPU, jaxpar.precision). xla / cudnn force that implementation of
    jax.nn.dot_product_attention, which has no dropout (config.validate refuses them with
    model.dropout > 0)."""
    if choice != "auto":
        return choice
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and dropout == 0 and policy.compute_dtype in (jnp.bfloat16, jnp.float16) else "einsum"


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, p: Params, axes: Params, policy: Policy):
        self.c_fc_w = _param(p["c_fc"]["weight"], axes["c_fc"]["weight"])
        self.c_fc_b = _param(p["c_fc"]["bias"], axes["c_fc"]["bias"])
        self.c_proj_w = _param(p["c_proj"]["weight"], axes["c_proj"]["weight"])
        self.c_proj_b = _param(p["c_proj"]["bias"], axes["c_proj"]["bias"])
        self.policy, self.dropout = policy, cfg.dropout
        self.chunks = 1  # train.mlp_chunks: > 1 runs jaxpar.ops.chunked_mlp

    def __call__(self, x, key=None):  # (B, T, D) -> (B, T, F) -> (B, T, D)
        pol = self.policy
        if self.chunks > 1:
            y = ops.chunked_mlp(x, self.c_fc_w[...], self.c_fc_b[...], self.c_proj_w[...], self.c_proj_b[...],
                                self.chunks, pol)
            return _dropout(y, self.dropout, key)
        h = pol.linear("btd,df->btf", x, self.c_fc_w[...], self.c_fc_b[...])
        h = constrain(gelu_tanh(h), ("batch", "seq", "mlp"))  # fp32 math, saves only h: jaxpar.activations
        y = pol.linear("btf,fd->btd", h, self.c_proj_w[...], self.c_proj_b[...])
        return _dropout(y, self.dropout, key)


class Block(nnx.Module):
    """x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    def __init__(self, cfg: ModelConfig, p: Params, axes: Params, policy: Policy):
        eps = cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(p["ln_1"], axes["ln_1"], eps)
        self.attn = Attention(cfg, p["attn"], axes["attn"], policy)
        self.ln_2 = LayerNorm(p["ln_2"], axes["ln_2"], eps)
        self.mlp = MLP(cfg, p["mlp"], axes["mlp"], policy)

    def __call__(self, x, key=None):
        k1 = k2 = None
        if key is not None:
            k1, k2 = jax.random.split(key)
        x = x + self.attn(self.ln_1(x), k1)
        x = x + self.mlp(self.ln_2(x), k2)
        return constrain(x, ("batch", "seq", "embed"))


def block_apply(cfg: ModelConfig, policy: Policy, layer_params: Params, x, key=None, selective: bool = False,
                mlp_chunks: int = 1):
    """One transformer block as a pure function of its (unstacked) params: (B, T, D) -> (B, T, D).
    selective: recompute the attention core in backward; mlp_chunks: see jaxpar.ops.chunked_mlp."""
    block = Block(cfg, layer_params, BLOCK_AXES, policy)
    block.attn.remat_core, block.mlp.chunks = selective, mlp_chunks
    return block(x, key)


def remat_mode(remat: bool | str) -> str:
    """train.remat value -> "none" | "selective" | "full" (bools from older callers: True = full)."""
    if isinstance(remat, bool) or remat is None:
        return "full" if remat else "none"
    return remat


def scan_unroll(policy: Policy, n_layer: int) -> int:
    """How many layers one `lax.scan` iteration runs. bf16 on CPU: all of them, up to 12
    (a Python-style layer loop; compile time grows with depth, hence the cap): measured
    in one process, interleaved, loaded 2-core host, median s/step scan -> unrolled: 4L/128
    0.30 -> 0.16, 6L/384 9.7 -> 6.2, GPT-2 124M (T256 B2) 23.2 -> 14.7. fp32 gained nothing
    (0.43 -> 0.43, 13.1 -> 16.1), so it keeps the rolled scan (benchmarks/README.md)."""
    cpu_bf16 = policy.compute_dtype == jnp.bfloat16 and jax.default_backend() == "cpu"
    return n_layer if cpu_bf16 and n_layer <= 12 else 1


def run_blocks(cfg: ModelConfig, policy: Policy, stacked: Params, x, key=None, remat: bool | str = False,
               mlp_chunks: int = 1):
    """Scan `block_apply` over a stack of layers (leading dim of every leaf). Pipeline
    stages call this on their own slice of the stack.

    remat: "none" | "selective" (attention scores/softmax recomputed, matmul outputs saved) |
    "full" (jax.checkpoint of each block: only its input is saved); True/False = full/none."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    mode = remat_mode(remat)

    def body(h, xs):
        layer_params, k = xs
        return block_apply(cfg, policy, layer_params, h, k, mode == "selective", mlp_chunks), None

    if mode == "full":
        body = jax.checkpoint(body, prevent_cse=False)
    keys = None if key is None else jax.random.split(key, n)
    x, _ = jax.lax.scan(body, x, (stacked, keys), unroll=scan_unroll(policy, n))
    return x


class GPT2(nnx.Module):
    """GPT2LMHeadModel. `embed` -> `blocks` -> `head` are separate so pipeline stages
    can run the first and last parts on their own stages."""

    def __init__(self, cfg: ModelConfig, params: Params, policy: Policy | str = "fp32", remat: bool | str = False,
                 vocab_chunks: int = 1, mlp_chunks: int = 1):
        policy = get_policy(policy) if isinstance(policy, str) else policy
        axes = param_axes(cfg)
        self.cfg, self.policy, self.remat = cfg, policy, remat
        self.vocab_chunks, self.mlp_chunks = vocab_chunks, mlp_chunks
        self.wte = _param(params["wte"]["weight"], axes["wte"]["weight"])
        self.wpe = _param(params["wpe"]["weight"], axes["wpe"]["weight"])
        # The stacked blocks stay a plain dict of Params: `run_blocks` scans over them.
        self.h = nnx.data(jax.tree.map(_param, params["h"], axes["h"], is_leaf=lambda x: not isinstance(x, dict)))
        self.ln_f = LayerNorm(params["ln_f"], axes["ln_f"], cfg.layer_norm_epsilon)

    def embed(self, tokens, key=None):  # (B, T) int32 -> (B, T, D) compute dtype
        T = tokens.shape[1]
        x = self.wte[...][tokens] + self.wpe[...][:T][None]
        x = _dropout(x, self.cfg.dropout, key)
        return constrain(self.policy.cast(x), ("batch", "seq", "embed"))

    def blocks(self, x, key=None):
        stacked = jax.tree.map(lambda v: v[...], self.h, is_leaf=lambda v: isinstance(v, nnx.Variable))
        return run_blocks(self.cfg, self.policy, stacked, x, key, self.remat, self.mlp_chunks)

    def head(self, x):  # (B, T, D) -> (B, T, V) fp32 logits via the tied embedding
        x = self.ln_f(x)
        logits = self.policy.einsum("btd,vd->btv", x, self.wte[...])
        return constrain(logits, ("batch", "seq", "vocab"))

    def loss(self, x, targets):  # (B, T, D), (B, T) -> mean fp32 cross-entropy
        if self.vocab_chunks == 1:
            return cross_entropy(self.head(x), targets)
        # never materialises the (B, T, V) logits: jaxpar.ops.chunked_cross_entropy
        return ops.chunked_cross_entropy(self.ln_f(x), self.wte[...], targets, self.vocab_chunks, self.policy)

    def __call__(self, tokens, key=None):
        k_embed = k_blocks = None
        if key is not None:
            k_embed, k_blocks = jax.random.split(key)
        return self.head(self.blocks(self.embed(tokens, k_embed), k_blocks))


def token_nll(logits, targets):
    """Per-token negative log-likelihood in fp32: logits (B, T, V), targets (B, T) int -> (B, T).

    Written as logsumexp(logits) - logits[target] with the target picked by a one-hot
    select, not log_softmax + take_along_axis: no (B, T, V) log-prob array is written, and
    the backward is one fused elementwise pass (softmax - onehot) instead of a scatter into
    zeros. On CPU (V=50257) this cut head+loss fwd+bwd from 6.6 s to 4.1 s
    (benchmarks/README.md); the values are the same to fp32 rounding.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
    onehot = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]  # (B, T, V) bool, fused
    target_logit = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)  # (B, T)
    return lse - target_logit


def cross_entropy(logits, targets):
    """Mean token cross-entropy in fp32. logits (B, T, V) fp32, targets (B, T) int."""
    return token_nll(logits, targets).mean()


def forward(cfg: ModelConfig, params: Params, tokens, policy: Policy | str = "fp32", key=None, remat=False):
    """Logits (B, T, V) fp32 from a plain params dict."""
    return GPT2(cfg, params, policy, remat)(tokens, key)


def loss_fn(cfg: ModelConfig, params: Params, tokens, targets, policy: Policy | str = "fp32", key=None, remat=False,
            vocab_chunks: int = 1, mlp_chunks: int = 1):
    """Mean fp32 loss; vocab_chunks / mlp_chunks > 1 split the head+loss / MLP (jaxpar.ops)."""
    k_embed = k_blocks = None
    if key is not None:
        k_embed, k_blocks = jax.random.split(key)
    model = GPT2(cfg, params, policy, remat, vocab_chunks, mlp_chunks)
    return model.loss(model.blocks(model.embed(tokens, k_embed), k_blocks), targets)
