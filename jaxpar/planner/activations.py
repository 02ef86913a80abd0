"""Activation bytes one GPT-2 layer keeps for backward (the planner's memory model, cost.py):
jaxpar's census of its own layer scan, and Megatron-LM's layer for the Megatron-engine what-if."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpar.planner.cost import Workload

# Residuals jaxpar's GPT-2 layer scan saves for backward, per T·b·D elements, counted with
# jax.ad_checkpoint.print_saved_residuals (tests/test_model_residuals.py pins the list,
# tests/test_planner_cost.py::test_layer_activations_match_the_census this formula). Per layer,
# shapes (b, T, ...), compute dtype unless fp32 is written:
#   (b, T, D)     ln_1 input, ln_1 output, ln_2 input, ln_2 output     REP_UNITS, replicated over t
#   (b, T, 1)     fp32 mean and rstd of ln_1 and ln_2                  LN_STATS_BYTES per token
#   (b, T, N, Hd) q, k, v, attention output                             QKVO_UNITS, split over t
#   (b, T, 4D)    c_fc output, GELU output                              MLP_UNITS, split over t
#   (b, N, T, T)  fp32 softmax probs (jaxpar.softmax / mixed_attention save nothing else; on CPU
#                 mixed_attention keeps only its causal query blocks' share, see `blocks`); on GPUs
#                 in bf16 the einsum core also keeps their bf16 copy (probs·V's operand)
# jaxpar.layernorm's hand-written backward saves x + 2 fp32 stats where autodiff kept six fp32
# (b, T, D) intermediates (recounted 2026-11-23, issue 12 residual diet). On GPUs in bf16 the
# scan also saves each layer's compute-dtype weight casts: `estimate` adds those separately.
REP_UNITS = 4  # compute dtype: ln_1 / ln_2 inputs and outputs, replicated over tensor
LN_STATS_BYTES = 16  # per token: fp32 mean + rstd of ln_1 and ln_2, replicated over tensor
QKVO_UNITS = 4  # q, k, v, attention output (split over tensor)
MLP_UNITS = 8  # c_fc out + GELU out, 2 × 4D (split over tensor)


# Megatron-LM's layer (the Megatron-engine what-if), Korthikanti et al. 2022 §4.1 and Table 2:
# sbh·(10 + 24/t) + 5·a·s²·b/t bytes per layer with t-way tensor parallelism, 34·sbh/t + 5·a·s²·b/t
# with sequence parallelism. Against jaxpar's census it adds the two hidden-dropout masks (1 byte per
# element, replicated: 2·sbh; Megatron's default hidden_dropout = attention_dropout = 0.1, which
# run_table_1.sh keeps) and keeps its attention probs in 16 bits: softmax output, its dropout mask
# (1 byte) and the dropped-out probs (2 + 1 + 2 = 5 bytes per score where jaxpar keeps fp32 + a
# bf16 copy, 6).
DROPOUT_MASK_BYTES = 2  # per token per hidden unit: the attention and MLP bias-dropout-add masks


def causal_blocks(T: int) -> int:
    """The number of causal query blocks jaxpar's CPU attention core splits T into (1: unblocked)."""
    from jaxpar.mixed_attention import causal_blocks as n  # lazily: the rest of the planner needs no jax

    return n(T)


def layer_activation_bytes(w: Workload, b: float, t: int, remat: str, mlp_chunks: int,
                           cb: int | None = None, probs_copy: bool | None = None,
                           megatron: bool = False, seq_parallel: bool = False, blocks: int = 1) -> tuple[float, float]:
    """(saved, live) bytes of one layer for one microbatch of b rows on one device.

    saved = T·b·(D·cb·(4 + 12/t) + 16) + N·T²·b/t·(4 + cb·probs_copy)        (remat=none)
    cb is the dtype of the saved activations, probs_copy whether the compute-dtype copy of the
    fp32 probs is saved too (default: cb < 4, jaxpar's einsum core in bf16 on GPU; XLA:CPU's
    attention core and fp32 keep the fp32 probs only). Flash attention keeps only the fp32 row
    statistics N·T·b/t·8 instead. selective drops the T² term, mlp_chunks > 1 drops the MLP units
    (both recomputed), full keeps only the block input T·b·D·cb. `live` is everything the layer
    holds while it runs (recompute peak).
    megatron: Megatron-LM's layer instead (see DROPOUT_MASK_BYTES): + 2·sbh dropout-mask bytes
    replicated, probs at 2·cb + 1 bytes per score; seq_parallel (megatron only) splits the
    replicated part and the saved block input over t (34·sbh/t with selective recompute).
    blocks: the causal query blocks of jaxpar's CPU attention core (`causal_blocks`); with nb of
    them it keeps probs for (nb + 1) / (2 nb) of the (T, T) scores (T = 256: 4 blocks, 5/8)."""
    T, D, N = w.seq_len, w.model.n_embd, w.model.n_head
    cb = w.cb if cb is None else cb
    probs_copy = cb < 4 if probs_copy is None else probs_copy
    sbh = T * b * D
    rep = sbh * REP_UNITS * cb + T * b * LN_STATS_BYTES
    qkvo = sbh * QKVO_UNITS * cb / t
    mlp = sbh * MLP_UNITS * cb / t
    causal = (blocks + 1) / (2 * blocks)  # 1 unblocked
    attn = N * T * b / t * 8 if w.attention == "flash" else N * T * T * causal * b / t * (4 + (cb if probs_copy else 0))
    sp = t if megatron and seq_parallel else 1
    if megatron:
        rep = (rep + sbh * DROPOUT_MASK_BYTES) / sp
        attn = N * T * T * b / t * (2 * cb + 1)
    live = rep + qkvo + mlp + attn
    if remat == "full":
        return sbh * cb / sp, live
    saved = rep + qkvo + (mlp if mlp_chunks == 1 else 0.0) + (attn if remat == "none" else 0.0)
    return saved, live


