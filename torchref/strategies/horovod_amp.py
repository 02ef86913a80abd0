"""`horovod-amp`: the Horovod strategy with torch.autocast mixed precision (Apex AMP O1's
successor): fp32 master weights, grads and all-reduce; bf16 (or fp16 + GradScaler) matmuls."""

from __future__ import annotations

from torchref.strategies.horovod import Horovod


class HorovodAMP(Horovod):
    name = "horovod-amp"
    amp = True
