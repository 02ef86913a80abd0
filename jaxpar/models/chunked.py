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
  recomputes them chunk by chunk (one extra c_fc matmul, 8·B·T·D² FLOPs). In bf16 a hand-written
  backward (`_chunk_scan_fp32_dx`) sums the k chunks' input gradients in fp32 and rounds the total
  once, as the unchunked MLP does; autodiff of the scan summed them in bf16, an error growing with k
  (2L/64, worst gradient l2 vs unchunked bf16: 6.4e-3 at k=2, 7.7e-3 at 4, 9.9e-3 at 32; now 1.4e-3
  at every k on a Zen 4 host, <= 2.8e-3 on emulated AVX2; tests/models/test_chunked.py). It saves what autodiff
  saved (x in bf16, the re-laid weights). Compiled temp memory, bf16 4L/256 T256 B8 k=4 (XLA:CPU):
  rolled layers (14) 361.6 -> 359.6 MiB; unrolled (4) 121.0 -> 127.9, the fp32 gradient carry.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.models.gelu import gelu_tanh
from jaxpar.models.precision import FP32, add_bias
from jaxpar.parallel.logical import constrain


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
    `policy` (jaxpar.models.precision) does the logits matmul."""
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
    `policy` (jaxpar.models.precision) does the matmuls."""
    D, F = w_fc.shape
    if F % chunks:
        raise ValueError(f"MLP hidden dim {F} is not divisible by mlp_chunks {chunks}")
    # hidden unit j = i·k + c  ->  chunk c, position i (strided chunks, see module docstring)
    wf = jnp.moveaxis(w_fc.reshape(D, F // chunks, chunks), 2, 0)  # (k, D, F/k)
    bf = b_fc.reshape(F // chunks, chunks).T  # (k, F/k)
    wp = jnp.moveaxis(w_proj.reshape(F // chunks, chunks, D), 1, 0)  # (k, F/k, D)

    if x.dtype == jnp.float32:  # the scan's autodiff sums the chunks' input gradients in fp32 already
        y = _chunk_scan(policy, x, wf, bf, wp)
    else:
        y = _chunk_scan_fp32_dx(policy, x, wf, bf, wp)
    return add_bias(y.astype(x.dtype), b_proj)


def _chunk(policy, x, wf_c, bf_c, wp_c):
    """One chunk's gelu(x·wf_c + bf_c)·wp_c: x (B, T, D), wf_c (D, F/k), bf_c (F/k,), wp_c (F/k, D) -> fp32 (B, T, D)."""
    h = policy.linear("btd,df->btf", x, wf_c, bf_c)
    h = constrain(gelu_tanh(h), ("batch", "seq", "mlp"))
    return policy.einsum("btf,fd->btd", h, wp_c, a_elementwise=True)


def _chunk_scan(policy, x, wf, bf, wp):
    """Sum over chunks of `_chunk`: (B, T, D) fp32. The body is checkpointed: backward recomputes each
    chunk's hidden values instead of saving them."""

    @jax.checkpoint
    def body(acc, w):
        return acc + _chunk(policy, x, *w), None

    # zeros_like, not zeros: inside the pipeline's shard_map x varies over the manual axes and the
    # scan carry must have the same varying-axes type as the body's output (acc + h·W varies as x).
    y, _ = jax.lax.scan(body, jnp.zeros_like(x, jnp.float32), (wf, bf, wp))
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_scan_fp32_dx(policy, x, wf, bf, wp):
    """`_chunk_scan` for a compute-dtype (bf16) x, with a backward that sums the chunks' input
    gradients in fp32 and rounds the total once, as the unchunked MLP's one matmul does. Autodiff of
    the scan would sum them in x's dtype (bf16): an error growing with k (module docstring). The
    residuals are what autodiff saves (x in its own dtype and the re-laid weights): x is upcast in
    backward only, a transient (B, T, D) fp32 value."""
    return _chunk_scan(policy, x, wf, bf, wp)


def _chunk_scan_fwd(policy, x, wf, bf, wp):
    return _chunk_scan(policy, x, wf, bf, wp), (x, wf, bf, wp)


def _chunk_scan_bwd(policy, res, g):
    x, wf, bf, wp = res
    xf = x.astype(jnp.float32)  # exact; the dots round it back to the policy's operand dtype

    def body(dx, w):  # recompute chunk c and pull g back through it: dx (B, T, D) fp32 running sum
        _, pull = jax.vjp(functools.partial(_chunk, policy), xf, *w)
        dx_c, *dw = pull(g)
        return dx + dx_c, tuple(dw)

    dx, dw = jax.lax.scan(body, jnp.zeros_like(xf), (wf, bf, wp))
    return (dx.astype(x.dtype), *dw)


_chunk_scan_fp32_dx.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)
