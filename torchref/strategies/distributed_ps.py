"""`distributed-ps`: PyTorch DistributedDataParallel, as the study ran it.

Every worker holds a replica and the optimizer ("distributed parameter server": the parameters
and their update are sharded across nobody and replicated on everyone). DDP registers autograd
hooks that pack gradients into buckets of `ddp.bucket_mb` (in reverse registration order,
roughly the order backward produces them) and launches an asynchronous all-reduce per bucket
as soon as it is full, overlapping communication with the rest of backward; `backward()` returns
after all buckets are reduced and divided by N. The initial weights are broadcast from rank 0
when DDP wraps the model.

Bytes: the comm hook below is `default_hooks.allreduce_hook` (DDP's documented Python twin of its
built-in all-reduce: divide by N, all-reduce) plus a counter of the ring volume of each bucket.
The metrics row of each step lists the buckets' sizes (`ddp_bucket_bytes`, in reduction order).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from torchref.comm import ByteCounter, ring_volume
from torchref.strategies.base import Hooks, Strategy, allreduce_train_loop


class DDPHooks(Hooks):
    def __init__(self, ctx, model: torch.nn.Module):
        self.ctx, self.model, self.counter, self.n = ctx, model, ByteCounter(), ctx.world
        self.buckets: list[int] = []  # bytes of each bucket reduced this step

    def wrap(self, model):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = self.ctx.device
        ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                  bucket_cap_mb=self.ctx.ref.ddp.bucket_mb, broadcast_buffers=False)
        counter, n, buckets = self.counter, self.n, self.buckets

        def counting_allreduce(state, bucket):
            buf = bucket.buffer()
            buckets.append(buf.numel() * buf.element_size())
            v = ring_volume(buckets[-1], n)
            counter.add(v, v)
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(dist.group.WORLD, counting_allreduce)
        self.ddp = ddp
        return ddp

    def microbatch(self, last: bool):
        # Accumulation passes before the last keep their gradients local (DDP's no_sync).
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def global_loss(self, local_loss: float) -> float:
        t = torch.tensor([local_loss], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(t)  # control traffic for the log, not counted
        return float(t[0]) / self.n

    def bytes_this_step(self):
        return self.counter.take()

    def step_metrics(self) -> dict:
        sizes = list(self.buckets)
        self.buckets.clear()
        return {"ddp_bucket_bytes": sizes}


class DistributedPS(Strategy):
    name = "distributed-ps"

    def run(self, ctx) -> None:
        ctx.init_process_group()
        try:
            allreduce_train_loop(ctx, ctx.rank, ctx.world, lambda model: DDPHooks(ctx, model),
                                 bucket_mb=ctx.ref.ddp.bucket_mb)
        finally:
            dist.destroy_process_group()
