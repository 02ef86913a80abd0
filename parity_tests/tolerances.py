"""The one tolerance table of the cross-framework (jaxpar vs torchref) parity checks.

Never loosened to make a test pass: a row that exceeds its bound is a bug to find (or a
configuration to list as excluded, with the reason, in `parity_tests.matrix.EXCLUDED`).

Metrics (a = jaxpar or the row under test, b = the PyTorch reference, same weights and batches):
  logits_abs    max |a - b| over every logit (fp32 logits of the shared init)
  loss_rel      |a - b| / |b|                 (one loss, or every step of a trajectory)
  grad_rel      max|a - b| / max|b| per parameter tensor (inf-norm: "relative to the norm");
                the reported number is the worst tensor
  grad_l2_rel   ||a - b||_2 / ||b||_2 per tensor (bf16 rows: entries near zero carry no relative
                accuracy in bf16, so bf16 gradients are judged norm-wise)
  update_rel    ||Δa - Δb||_2 / ||Δb||_2 per tensor, Δ = params after k AdamW steps - init
                (the optimizer step compared in units of its own size)

| name                        | bound            | why |
|-----------------------------|------------------|-----|
| MODEL.logits_abs            | 1e-5             | issue 6; logits are O(1), fp32 rounding through 2-3 layers is ~1e-6 |
| MODEL.loss_rel              | 1e-6             | issue 6; ~16 fp32 ulps (u32 = 2^-24 = 6e-8) |
| MODEL.grad_rel              | 1e-5             | issue 6 |
| MODEL.update_rel            | 1e-4             | see "AdamW step" below (same grads fed to both) |
| FP32.loss_rel               | 1e-5             | trajectory of N=10 steps, every step (see "fp32 trajectories") |
| FP32.grad_rel               | 1e-5             | step-1 averaged gradient of every row vs the reference |
| BF16.loss_rel               | 2*U_BF16 = 7.8e-3| see "bf16 rows" |
| BF16.grad_l2_rel            | 4*U_BF16 = 1.6e-2| see "bf16 rows" |

AdamW step. Both optimizers start from the shared init and are fed the SAME gradient at each
step (torch's), so only the optax <-> torch.optim mapping and its fp32 arithmetic differ (see
`common.model_parity` for why each framework's own gradients are not used here). Per element the
update goes through ~10 fp32 operations on identical inputs (<= 10 u32 = 6e-7 of the update); the
final `p + Δ` rounds at ulp(|p|): LayerNorm weights are 1.0, so ulp = 1.2e-7 against |Δ| ≈ lr = 1e-3,
i.e. up to 1.2e-4 of an element's update and ~1e-5 norm-wise over a tensor. Bound 1e-4. A mapping
error is O(1e-2..1) in this metric: no bias correction scales the step-1 update by
(1-b1)/sqrt(1-b2) = 0.45; decay on an unmasked LayerNorm weight adds lr*wd*1 = 10% of the step;
a schedule off by one step changes lr by 100% at warmup; clipping with torch's 1e-6 epsilon or
without clipping changes m/sqrt(v) from step 2 on (compared at k = 1 and k = 3).

fp32 trajectories. Every synchronous configuration computes the same mean gradient; they differ
only in the order of fp32 sums (sharded matmuls, all-reduces, per-worker means, bucket order). A
reordering costs a few ulps per step; over 10 AdamW steps the sign-sensitivity above amplifies
them mildly. Measured on gpt2-tiny (10 steps): <= 3e-7 relative. 1e-5 is the same bound the
jaxpar-sharded and torchref-strategy tables use (jaxpar/tolerances.py, torchref/tolerances.py), so
a row passes here exactly when it would pass against its own framework's single device. A real
fault (a 1/N missing from an average, a schedule off by one step, a mask on the wrong tensor)
moves the loss by >1e-3 within 10 steps.

bf16 rows (jaxpar precision=bf16; torchref -amp = autocast(bf16)), against the fp32 reference.
U_BF16 = 2^-8 is bf16's unit roundoff (8 significand bits). torchref's table allows u on an
AMP loss: one rounding of the bf16 result. jaxpar's bf16 policy rounds more than autocast does
(its residual stream and every activation are bf16, not only the matmul operands), so a second
independent u is allowed: 2u. The gradient bound is torchref's: two bf16 products per layer in
backward, each with two rounded operands, <= 4u norm-wise. Measured (10 steps, gpt2-tiny): see
the report; the bounds were written before the measurement and not changed after it.
"""

U_FP32 = 2.0**-24
U_BF16 = 2.0**-8

# Single-device model parity (fp32): forward, backward, optimizer step.
MODEL = {"logits_abs": 1e-5, "loss_rel": 1e-6, "grad_rel": 1e-5, "update_rel": 1e-4}

# N-step training trajectories and step-1 gradients, by the row's precision.
TRAJECTORY = {
    "fp32": {"loss_rel": 1e-5, "grad_rel": 1e-5},
    "bf16": {"loss_rel": 2 * U_BF16, "grad_l2_rel": 4 * U_BF16},
}
