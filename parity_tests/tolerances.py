"""The parity bounds, re-exported from the project's one tolerance table, `jaxpar/tolerances.py`
(measured values and derivations are there: the `parity.*` entries). Kept so existing imports
keep working; new code imports `jaxpar.tolerances` directly.

Metrics (a = jaxpar or the row under test, b = the PyTorch reference, same weights and batches):
  logits_abs    max |a - b| over every logit (fp32 logits of the shared init)
  loss_rel      |a - b| / |b|                 (one loss, or every step of a trajectory)
  grad_rel      max|a - b| / max|b| per parameter tensor; the reported number is the worst tensor
  grad_l2_rel   ||a - b||_2 / ||b||_2 per tensor (bf16 rows)
  update_rel    ||Δa - Δb||_2 / ||Δb||_2 per tensor, Δ = params after k AdamW steps - init
"""

from jaxpar.tolerances import MODEL, TRAJECTORY, U_BF16, U_FP32  # noqa: F401
