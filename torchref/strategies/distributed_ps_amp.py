"""`distributed-ps-amp`: DDP with mixed precision, the successor of the study's Apex AMP O1.

Parameters, gradients, the all-reduce and AdamW stay fp32; the forward/backward matmuls run
under `torch.autocast(amp.dtype)` (bf16 by default; fp16 adds GradScaler dynamic loss scaling,
which is what Apex O1 + its dynamic scaler did). Losses differ from `single` within the bf16
bound in jaxpar/tolerances.py (`torchref.*` entries).
"""

from __future__ import annotations

from torchref.strategies.distributed_ps import DistributedPS


class DistributedPSAMP(DistributedPS):
    name = "distributed-ps-amp"
    amp = True
