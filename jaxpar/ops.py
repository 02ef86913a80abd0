"""Operator splitting: chunked logits + cross-entropy and chunked MLP (peak-memory cuts).

Both are exact rewrites of the unchunked ops (same math, only the summation order of the
MLP's second matmul changes) and free of parallelism: chunks follow dims that the sharding
rules leave alone or split evenly, so the logical-axis annotations still hold.

* `chunked_cross_entropy(x, w, targets, k)`: mean token cross-entropy of logits x·wᵀ without
  ever holding the full (B, T, V) fp32 logits. The sequence dim T is cut into k chunks of
  T/k tokens (T is never sharded; the batch dim keeps its data/fsdp split and the vocab its
  tensor split); a `lax.scan` computes each chunk's (B, T/k, V) fp32 logits, their logsumexp
  and target logit, and adds the chunk's summed NLL. The scan body is `jax.checkpoint`-ed, so
  backward recomputes one chunk's logits at a time: peak (B, T/k, V) instead of 3 × (B, T, V),
  for one extra head forward (2·B·T·D·V FLOPs) -- what the planner's cost model charges.
* `chunked_mlp(x, w_fc, b_fc, w_proj, b_proj, k, cast)`: GPT-2 MLP with its 4D hidden dim cut
  into k chunks. Chunk c takes hidden units c, c+k, c+2k, ... (strided, so that a hidden dim
  split over `tensor` in contiguous blocks splits every chunk evenly too); each chunk
  computes gelu(x·W_fc[:, c] + b_fc[c])·W_proj[c] and the scan sums them. The body is
  checkpointed, so the (B, T, 4D) hidden activations and GELU pieces are never saved: backward
  recomputes them chunk by chunk (one extra c_fc matmul, 8·B·T·D² FLOPs). x enters the scan as
  fp32 (exact: it holds compute-dtype values), so backward sums the k chunks' input gradients in
  fp32 and rounds the total once, as the unchunked MLP does; a bf16 x would have them summed in
  bf16, an error growing with k (2L/64, worst gradient l2 vs unchunked bf16: 6.4e-3 at k=2, 7.7e-3
  at 4, 9.9e-3 at 32; summed in fp32 1.4e-3 at every k on a Zen 4 host, <= 2.8e-3 on emulated AVX2; tests/test_ops.py). Its price under bf16:
  x's saved copy is fp32 (compiled temp memory, 4L/256 T256 B8, k=4: 121.0 -> 129.0 MiB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.activations import gelu_tanh
from jaxpar.logical import constrain
from jaxpar.precision import FP32, add_bias


def _token_nll_sum(x, w, targets, policy):
    """Sum over tokens of logsumexp(logits) - logits[target]; x (B, t, D), w (V, D), targets (B, t)."""
    logits = policy.einsum("btd,vd->btv", x, w)  # (B, t, V) fp32
    logits = constrain(logits, ("batch", "seq", "vocab"))
    lse = jax.nn.logsumexp(logits, axis=-1)
    onehot = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    target_logit = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)
    return jnp.sum(lse - target_logit)


def chunked_cross_entropy(x, w, targets, chunks: int, policy=FP32):
    """Mean fp32 cross-entropy of logits x·wᵀ, in `chunks` token chunks along T.

    x (B, T, D) compute dtype (after ln_f), w (V, D) fp32 master (tied wte), targets (B, T);
    `policy` (jaxpar.precision) does the logits matmul."""
    B, T, D = x.shape
    if T % chunks:
        raise ValueError(f"seq_len {T} is not divisible by vocab_chunks {chunks}")
    n = T // chunks
    # (B, T, D) -> (k, B, T/k, D): chunk on the unsharded seq dim, batch keeps its split.
    xs = x.reshape(B, chunks, n, D).swapaxes(0, 1)
    ys = targets.reshape(B, chunks, n).swapaxes(0, 1)

    @jax.checkpoint
    def body(acc, xy):
        xc, yc = xy
        return acc + _token_nll_sum(xc, w, yc, policy), None

    # zeros_like, not zeros: inside a shard_map (jaxpar.parallel.fsdp) x varies over the manual
    # axes and the carry must have the body output's varying-axes type
    total, _ = jax.lax.scan(body, jnp.zeros_like(x, jnp.float32, shape=()), (xs, ys))
    return total / (B * T)


def chunked_mlp(x, w_fc, b_fc, w_proj, b_proj, chunks: int, policy=FP32):
    """gelu(x·w_fc + b_fc)·w_proj + b_proj with the hidden dim F in `chunks` strided chunks.

    x (B, T, D) compute dtype; w_fc (D, F), b_fc (F,), w_proj (F, D), b_proj (D,) fp32 params;
    `policy` (jaxpar.precision) does the matmuls."""
    D, F = w_fc.shape
    if F % chunks:
        raise ValueError(f"MLP hidden dim {F} is not divisible by mlp_chunks {chunks}")
    # hidden unit j = i·k + c  ->  chunk c, position i (strided chunks, see module docstring)
    wf = jnp.moveaxis(w_fc.reshape(D, F // chunks, chunks), 2, 0)  # (k, D, F/k)
    bf = b_fc.reshape(F // chunks, chunks).T  # (k, F/k)
    wp = jnp.moveaxis(w_proj.reshape(F // chunks, chunks, D), 1, 0)  # (k, F/k, D)

    @jax.checkpoint
    def body(acc, w):
        wf_c, bf_c, wp_c = w
        h = policy.linear("btd,df->btf", xf, wf_c, bf_c)
        h = constrain(gelu_tanh(h), ("batch", "seq", "mlp"))
        return acc + policy.einsum("btf,fd->btd", h, wp_c, a_elementwise=True), None  # fp32 partial sum

    # zeros_like, not zeros: inside the pipeline's shard_map x varies over the manual axes and the
    # scan carry must have the same varying-axes type as the body's output (acc + h·W varies as x).
    acc0 = jnp.zeros_like(x, jnp.float32)
    xf = x.astype(jnp.float32)  # (B, T, D): its cotangent, the k chunks' sum, in fp32 (module docstring)
    y, _ = jax.lax.scan(body, acc0, (wf, bf, wp))
    return add_bias(y.astype(x.dtype), b_proj)
