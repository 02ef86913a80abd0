"""Tolerance table for sharded-vs-single-device comparisons (one place; never loosened to pass).

Relative error of a loss: |a - b| / |b|. Of a gradient leaf: max|a - b| / max|b| (inf-norm,
so tiny entries do not blow it up). Same weights (numpy init, device_put) and same batches.

* fp32: sharding only reorders fp32 sums (partial matmuls + all-reduce, split batch means),
  so every strategy agrees with one device to ~1e-6; the bound is 1e-5.
* bf16 (bf16 matmul inputs/activations, fp32 params, grads and reductions): a different sum
  order changes which bf16 roundings happen; differences grow to ~1e-3 on the loss and
  ~1e-2 on gradients after 5 steps. Bounds: loss 1e-2, grads 5e-2.

Operator splitting (jaxpar.ops) and remat are exact rewrites of the model on one device.
"""

SHARDED_VS_SINGLE = {
    "fp32": {"loss": 1e-5, "grad": 1e-5},
    "bf16": {"loss": 1e-2, "grad": 5e-2},
}
# Operator splitting / remat vs the plain model, fp32, one device: only the summation order of
# the MLP's chunked second matmul and the scan over loss chunks change (inf-norm, as above).
CHUNKED_VS_PLAIN = {"loss": 1e-6, "grad": 1e-6}
# Multi-process (2 processes × 2 devices) vs one process × 4 devices, fp32 losses.
MULTIPROCESS_VS_SINGLE = {"loss": 1e-5}
# A Flax NNX model of the user's own (examples/08) on data=2 x fsdp=2 x tensor=2 vs one device, fp32:
# losses of every step and the first step's gradients (same weights; inf-norm, as above). Measured:
# 1e-7 (loss), 4e-7 (gradients).
FLAX_MODEL_SHARDED_VS_SINGLE = {"loss": 1e-6, "grad": 1e-6}
