"""Activation bytes one GPT-2 layer keeps for backward (the planner's memory model, cost.py):
jaxpar's census of its own layer scan, and Megatron-LM's layer for the Megatron-engine what-if."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpar.planner.cost import Workload

# Residuals jaxpar's GPT-2 layer scan saves for backward, per T·b·D elements, counted with
# jax.ad_checkpoint.print_saved_residuals (tests/models/test_model_residuals.py pins the list,
# tests/planner/test_planner_cost.py::test_layer_activations_match_the_census this formula). Per layer,
# shapes (b, T, ...), compute dtype unless fp32 is written:
#   (b, T, D)     ln_1 input, ln_1 output, ln_2 input, ln_2 output     REP_UNITS, replicated over t
#   (b, T, 1)     fp32 mean and rstd of ln_1 and ln_2                  LN_STATS_BYTES per token
#   (b, T, N, Hd) q, k, v, attention output                             QKVO_UNITS, split over t
#   (b, T, 4D)    c_fc output, GELU output                              MLP_UNITS, split over t
#   (b, N, T, T)  fp32 softmax probs (jaxpar.models.softmax / mixed_attention save nothing else; on CPU
#                 mixed_attention keeps only its causal query blocks' share, see `blocks`); on GPUs
#                 in bf16 the einsum core also keeps their bf16 copy (probs·V's operand)
# jaxpar.models.layernorm's hand-written backward saves x + 2 fp32 stats where autodiff kept six fp32
# (b, T, D) intermediates. On GPUs in bf16 the
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
    from jaxpar.models.mixed_attention import causal_blocks as n  # lazily: the rest of the planner needs no jax

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
    replicated, probs at 2·cb + 1 bytes per score. seq_parallel (tensor.sequence_parallel) splits the
    replicated part (LayerNorm inputs / outputs and stats; Megatron's dropout masks) and the saved
    block input over t (Megatron: 34·sbh/t with selective recompute).
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
    sp = t if seq_parallel else 1  # the residual stream's (b, T/t, D) shards outside the matmul pairs
    # jaxpar's layer running (forward recompute or backward) holds the all-gathered LayerNorm outputs
    # and their gradients: `live` keeps the whole rep (XLA:CPU, tensor=4: the remat=full and selective
    # peaks fall by the saved shards only, within 0.4%); Megatron's count shards it (Table 2)
    live_rep = rep
    rep = rep / sp
    if megatron:
        rep += sbh * DROPOUT_MASK_BYTES / sp
        attn = N * T * T * b / t * (2 * cb + 1)
        live_rep = rep
    live = live_rep + qkvo + mlp + attn
    if remat == "full":
        return sbh * cb / sp, live
    saved = rep + qkvo + (mlp if mlp_chunks == 1 else 0.0) + (attn if remat == "none" else 0.0)
    return saved, live




# XLA:CPU's unrolled fp32 layer loop (gpt2.scan_unroll: every layer up to 12 in one scan step), per
# layer beyond what the rolled scan saves, in (b, T, D) fp32 units u = T·b·D·4 (seen in the
# compiler's peak live set, `--xla_dump_to` *-live-range.txt "Live ranges at ... (peak)"):
UNROLL_T_UNITS = 2  # the (D, b·T) transposed copies of the ln_1 and ln_2 outputs: the LHS of the c_attn
# and c_fc weight-gradient dots (precision._weight_grad), made in forward and kept to the layer's
# backward; + 1/t: the attention output's (D/t, b·T) copy, c_proj's LHS (mlp c_proj's swaps its
# operands in fp32 and copies the incoming gradient instead, in backward: not kept). With
# mlp_chunks > 1 ln_1's only: c_fc's weight gradient runs inside the chunk loop (its own rolled scan)
UNROLL_MLP_UNITS = 4  # one more (b, T, 4D/t) MLP hidden value (4/t units); none with mlp_chunks > 1
UNROLL_CHUNKED_UNITS = 2  # mlp_chunks > 1 instead: the chunk loop's backward (b, T, D) gradient carry,
# zero-initialised in forward, and a second (b, T, D) ln_2 output value (one fused for the loop's input)
UNROLL_PROBS_COPIES = 1  # a second copy of the kept fp32 probs (each causal query block's)
UNROLL_HEAD_UNITS = 3  # at the peak (the head's backward): ln_f's input, output and transposed output


def layers_unrolled(n_layer: int, remat: str) -> bool:
    """Whether XLA:CPU runs the n_layer layers unrolled (`gpt2.scan_unroll` on "cpu": up to 12 layers,
    remat none only)."""
    from jaxpar.models.gpt2 import scan_unroll  # lazily: the rest of the planner needs no jax

    return scan_unroll(n_layer, "cpu", remat) > 1


def unrolled_layer_bytes(w: Workload, b: float, t: int, mlp_chunks: int, blocks: int = 1,
                         seq_parallel: bool = False) -> float:
    """Bytes one layer keeps from forward to backward in XLA:CPU's unrolled fp32 step (one microbatch of
    b rows on one device; remat none, the only remat the model unrolls): what `layer_activation_bytes`
    saves plus the copies above, u = T·b·D·4, P = the kept fp32 probs N·T²·b/t·4·(nb + 1)/(2 nb):

        saved(none) + u·(2 + 1/t + 4/t) + P      (mlp_chunks = 1)
        saved(none) + u·(1 + 1/t + 2) + P        (mlp_chunks > 1)

    (With remat the model keeps the scan rolled: unrolled, XLA merged each layer's recomputation with
    its forward and remat saved nothing, row 1's 8×1×1×1 mesh 91.43 MiB for none, selective and full
    alike, rolled 85.99 / 82.37 / 71.52; gpt2.scan_unroll.) Measured per layer (unrolled minus rolled
    compiled step, slope over L = 2, 4, 6): 6.00 MiB at 1×1×8×1 (b 16, T 128, D 256, formula 6.0),
    2.49 MiB at 8×1×1×1 (2.5)."""
    T, D, N = w.seq_len, w.model.n_embd, w.model.n_head
    u = T * b * D * 4
    probs = N * T * T * (blocks + 1) / (2 * blocks) * b / t * 4
    # seq_parallel splits `saved`'s LayerNorm part only: the transposed copies are of the gathered values
    saved, _ = layer_activation_bytes(w, b, t, "none", mlp_chunks, 4, False, seq_parallel=seq_parallel, blocks=blocks)
    if mlp_chunks == 1:
        extra = u * (UNROLL_T_UNITS + 1 / t + UNROLL_MLP_UNITS / t)
    else:
        extra = u * (UNROLL_T_UNITS - 1 + 1 / t + UNROLL_CHUNKED_UNITS)
    return saved + extra + UNROLL_PROBS_COPIES * probs


def unrolled_peak_bytes(w: Workload, b: float, t: int, blocks: int = 1) -> float:
    """Besides the head's logits, what XLA:CPU's unrolled fp32 step holds at its peak (the head's
    backward, before the first layer's) on top of every layer's `unrolled_layer_bytes`, in place of
    the rolled step's one live layer: ln_f's input, output and its (D, b·T) transposed copy (the tied
    head's wte-gradient LHS) and a broadcast constant the size of one layer's kept probs."""
    T, D, N = w.seq_len, w.model.n_embd, w.model.n_head
    return UNROLL_HEAD_UNITS * T * b * D * 4 + N * T * T * (blocks + 1) / (2 * blocks) * b / t * 4


def unrolled_gathered_bytes(full: dict, el: dict, sharded: dict) -> float:
    """Per layer, XLA's auto-sharded ZeRO-3 in the unrolled fp32 step (fsdp > 1 outside
    jaxpar.parallel.fsdp's map, i.e. mlp_chunks > 1: with remat the scan stays rolled): it
    all-gathers each layer's attention weights in forward and keeps them to the layer's backward, one
    fp32 gathered copy per layer (the MLP's are gathered per chunk inside the chunk loop), where the
    grads term counts their 1/f shards. full / el: parameter elements per layer before / after the
    fsdp split (cost.group_elems); seen in row 20's peak live set (2x4x1x1, selective remat then
    unrolled): f32[768,256] c_attn, f32[256,256] c_proj."""
    return 4 * (full["attn"] - el["attn"]) if sharded["attn"] else 0.0
