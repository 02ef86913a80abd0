"""Communication: byte counters, the explicit ring all-reduce, flatten/unflatten.

Byte accounting (what `bytes_sent` / `bytes_received` in metrics.jsonl mean):
  * Counted: gradient and weight payloads only. The 4-8 byte loss/step scalars that feed the
    metrics log travel on the same links but are excluded, so counters equal the analytic volume.
  * Measured where torchref moves the bytes itself: single-ps (every send/recv) and the ring
    all-reduce (every Sendrecv).
  * Modelled where a library moves them out of sight (DDP's gloo/NCCL all-reduce, MPI_Allreduce):
    the bandwidth-optimal ring volume 2(N-1)/N * nbytes sent and received per worker per buffer,
    which is what ring (gloo, NCCL) and reduce-scatter+all-gather (MPICH, large messages) move.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ByteCounter:
    sent: int = 0
    received: int = 0

    def add(self, sent: int = 0, received: int = 0) -> None:
        self.sent += int(sent)
        self.received += int(received)

    def take(self) -> tuple[int, int]:
        """Return (sent, received) since the last take and reset."""
        s, r = self.sent, self.received
        self.sent = self.received = 0
        return s, r


def ring_volume(nbytes: int, n: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of `nbytes`: 2(N-1)/N * nbytes
    (exact when nbytes splits evenly into N chunks; rounded down otherwise)."""
    return 2 * (n - 1) * nbytes // n


def ring_allreduce(comm, buf: np.ndarray, counter: ByteCounter | None = None, tag: int = 7000) -> np.ndarray:
    """In-place sum over `comm` of a contiguous 1-D numpy buffer, as an explicit ring.

    Written for clarity, Baidu/Horovod style, N ranks, buffer split into N chunks c_0..c_{N-1}
    (np.array_split: sizes differ by at most one element, any length works, even < N):
      reduce-scatter, N-1 steps: at step s rank r sends c_{(r-s)%N} to r+1 and adds what it
        receives from r-1 into c_{(r-s-1)%N}; afterwards rank r holds the full sum of c_{(r+1)%N}.
      all-gather, N-1 steps: at step s rank r sends c_{(r+1-s)%N} (fully reduced) to r+1 and
        overwrites c_{(r-s)%N} with what r-1 sends.
    Each rank sends and receives 2(N-1) chunks, i.e. ~2(N-1)/N of the buffer; the sum over ranks
    of bytes sent is exactly 2(N-1) * buf.nbytes.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        return buf
    assert buf.ndim == 1 and buf.flags.c_contiguous
    chunks = np.array_split(buf, n)  # views into buf
    right, left = (r + 1) % n, (r - 1) % n
    tmp = np.empty(max(c.size for c in chunks), dtype=buf.dtype)
    for s in range(n - 1):  # reduce-scatter
        send, dst = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        recv = tmp[: dst.size]
        comm.Sendrecv(send, dest=right, sendtag=tag + s, recvbuf=recv, source=left, recvtag=tag + s)
        dst += recv
        if counter is not None:
            counter.add(send.nbytes, recv.nbytes)
    for s in range(n - 1):  # all-gather
        send, dst = chunks[(r + 1 - s) % n], chunks[(r - s) % n]
        comm.Sendrecv(send, dest=right, sendtag=tag + n + s, recvbuf=dst, source=left, recvtag=tag + n + s)
        if counter is not None:
            counter.add(send.nbytes, dst.nbytes)
    return buf


def mpi_allreduce(comm, buf: np.ndarray, counter: ByteCounter | None = None) -> np.ndarray:
    """In-place MPI_Allreduce(SUM); bytes counted with the ring model (see module docstring)."""
    from mpi4py import MPI

    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    if counter is not None:
        v = ring_volume(buf.nbytes, comm.Get_size())
        counter.add(v, v)
    return buf


def flatten(tensors):
    import torch

    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat, tensors) -> None:
    """Copy consecutive slices of `flat` into `tensors` (in place)."""
    i = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[i:i + n].view_as(t))
        i += n


def send(t, dst: int, counter: ByteCounter | None = None, tag: int = 0):
    """Non-blocking torch.distributed send, counted; returns the work handle."""
    import torch.distributed as dist

    if counter is not None:
        counter.add(sent=t.numel() * t.element_size())
    return dist.isend(t, dst, tag=tag)


def recv(t, src: int | None, counter: ByteCounter | None = None, tag: int = 0):
    """Non-blocking receive into `t` (counted); src=None is not supported by irecv, use recv_any."""
    import torch.distributed as dist

    if counter is not None:
        counter.add(received=t.numel() * t.element_size())
    return dist.irecv(t, src, tag=tag)
