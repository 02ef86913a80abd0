"""`horovod`: Horovod's data-parallel design rebuilt on mpi4py, run under `mpiexec -n N`.

What Horovod does, and where it is here:
  1. `hvd.broadcast_parameters(model.state_dict(), root_rank=0)`: rank 0 loads the initial
     weights, every other rank starts from HF's random init and receives them (`Bcast`).
  2. `hvd.DistributedOptimizer`: a hook per parameter fires when its gradient is final
     (`register_post_accumulate_grad_hook`) and hands it to the fusion buffer.
  3. Tensor fusion (`horovod.fusion_mb`, HOROVOD_FUSION_THRESHOLD): ready gradients are packed
     into one flat buffer; when the next one would not fit the buffer is submitted.
  4. A background thread performs the all-reduces (Horovod's background loop), so communication
     overlaps the rest of backward on the main thread: `horovod.algorithm=mpi` calls
     MPI_Allreduce, `ring` the explicit ring in torchref.comm.
  5. `optimizer.synchronize()` before `step()`: wait for every buffer, divide by N (Average),
     unpack into `.grad`.
  6. `horovod.compression=fp16` (Compression.fp16): buffers are cast to fp16 for the wire and
     back to fp32 after the reduction, halving the bytes.
Horovod's coordinator, which negotiates which tensors are ready on all ranks, is not needed:
the model and batch shapes are identical on every rank, so hooks fire in the same order.
"""

from __future__ import annotations

import contextlib
import queue
import threading

import numpy as np
import torch

from torchref.comm import ByteCounter, mpi_allreduce, ring_allreduce
from torchref.strategies.base import Hooks, Strategy, allreduce_train_loop


class FusionEngine(Hooks):
    """Gradient hooks -> fusion buffers -> background all-reduce -> averaged .grad."""

    def __init__(self, ctx, comm, model: torch.nn.Module):
        h = ctx.ref.horovod
        self.comm, self.n = comm, comm.Get_size()
        self.wire = np.float16 if h.compression == "fp16" else np.float32
        self.capacity = max(1, int(h.fusion_mb * 2**20) // np.dtype(self.wire).itemsize)  # elements
        self.reduce = ring_allreduce if h.algorithm == "ring" else mpi_allreduce
        self.counter = ByteCounter()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.pending: list[torch.nn.Parameter] = []  # grads packed into the open buffer
        self.pending_size = 0
        self.ready = 0
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.in_flight = 0
        self.sync = True  # False during the first grad_accum - 1 passes of a step
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    # ---- main thread (inside backward)
    @contextlib.contextmanager
    def microbatch(self, last: bool):
        """hvd.DistributedOptimizer(backward_passes_per_step=A): only the last pass all-reduces."""
        self.sync = last
        try:
            yield
        finally:
            self.sync = True

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.sync:  # an accumulation pass: the gradient stays in .grad
            return
        if self.pending and self.pending_size + p.numel() > self.capacity:
            self._submit()
        self.pending.append(p)
        self.pending_size += p.numel()
        self.ready += 1
        if self.ready == len(self.params):  # last gradient of this backward
            self._submit()

    def _submit(self) -> None:
        # Pack: fp32 grads -> one contiguous wire-dtype buffer (the cast is the compression).
        # On a GPU the buffer is staged through host memory (Horovod without CUDA-aware MPI).
        buf = np.concatenate([p.grad.detach().reshape(-1).cpu().numpy() for p in self.pending]).astype(self.wire)
        self.jobs.put((buf, self.pending))
        self.in_flight += 1
        self.pending, self.pending_size = [], 0

    # ---- background thread
    def _loop(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            buf, ps = item
            try:
                self.reduce(self.comm, buf, self.counter)
                self.done.put((buf, ps, None))
            except BaseException as e:  # noqa: BLE001  # surfaced on the main thread in after_backward
                self.done.put((buf, ps, e))

    # ---- main thread (synchronize)
    def after_backward(self) -> None:
        while self.in_flight:
            buf, ps, err = self.done.get()
            self.in_flight -= 1
            if err is not None:
                raise err
            avg = torch.from_numpy(buf.astype(np.float32)).to(ps[0].grad.device) / self.n  # decompress, Average
            i = 0
            for p in ps:
                k = p.numel()
                p.grad.copy_(avg[i:i + k].view_as(p.grad))
                i += k
        self.ready = 0

    def global_loss(self, local_loss: float) -> float:
        return self.comm.allreduce(local_loss) / self.n  # control traffic, not counted

    def bytes_this_step(self):
        return self.counter.take()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


def broadcast_parameters(comm, model: torch.nn.Module) -> None:
    """hvd.broadcast_parameters: every tensor of rank 0's state dict to all ranks (in place)."""
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            a = p.data.cpu().numpy()  # shares memory with the parameter on the CPU
            comm.Bcast(a, root=0)
            if p.device.type != "cpu":
                p.data.copy_(torch.from_numpy(a))


class Horovod(Strategy):
    name = "horovod"
    launcher = "mpi"

    def run(self, ctx) -> None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        engines = []

        def make(model):
            broadcast_parameters(comm, model)
            engines.append(FusionEngine(ctx, comm, model))
            return engines[-1]

        try:
            h = ctx.ref.horovod
            allreduce_train_loop(ctx, ctx.rank, ctx.world, make, initial_weights=(ctx.rank == 0),
                                 algorithm=h.algorithm, compression=h.compression, fusion_mb=h.fusion_mb)
        finally:
            for e in engines:
                e.close()
